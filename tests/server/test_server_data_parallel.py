"""`plait serve --dp-size 2`: the scheduler process runs two replicas behind its balancer; results
equal the offline single-replica Engine's and /metrics counts both replicas' KV pools."""

from __future__ import annotations

from tests.helpers import prompt_ids
from tests.server.conftest import MAIN_ENGINE_FLAGS


def test_dp2_server_equals_the_offline_engine(start_server, offline_engine):
    srv = start_server("dp2", dp_size=2, **MAIN_ENGINE_FLAGS)
    prompts = prompt_ids(6)
    refs = offline_engine.generate(prompts, {"max_new_tokens": 16, "ignore_eos": True, "temperature": 0.0})
    out = srv.openai().completions.create(model=srv.model, prompt=prompts, max_tokens=16, temperature=0.0,
                                          extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.model_extra["token_ids"] for c in out.choices] == [r.token_ids for r in refs]
    m = srv.wait_idle()
    assert m["plait:kv_slots_in_use"] == 0
    assert m["plait:kv_slots_total"] == 2 * MAIN_ENGINE_FLAGS["max_total_tokens"]
