"""The SGLang-drop-in engine features on a GPU (CUDA graphs, overlap scheduling and the Triton
backend on): prompt-token logprobs against transformers, logit_bias through replayed decode steps,
and a stream left early freeing its KV."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

import plait  # noqa: E402
from plait.testing import make_tiny_model  # noqa: E402
from tests.conftest import hf_model  # noqa: E402
from tests.helpers import prompt_ids  # noqa: E402

GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_model(tmp_path_factory.mktemp("sglang_gpu"), "llama", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = plait.Engine(model=str(model_dir), device="cuda", max_total_tokens=16384, chunked_prefill_size=16,
                       disable_radix_cache=True)
    yield eng
    eng.shutdown()


def test_prompt_logprobs_on_gpu_match_transformers(engine, model_dir):
    prompts = prompt_ids(8, seed=5)
    # Requests that decode (graph replay) share steps with ones that score their prompts.
    outs = engine.generate(prompts, [{**GREEDY, "max_new_tokens": 8, "logprobs": True, "logprob_start_len": 0}
                                     if i % 2 == 0 else {**GREEDY, "max_new_tokens": 8} for i in range(8)])
    hf = hf_model(model_dir)
    for i in range(0, 8, 2):
        ids = prompts[i]
        with torch.no_grad():
            logp = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
        want = [logp[q, ids[q + 1]].item() for q in range(len(ids) - 1)]
        got = [lp for lp, _, _ in outs[i].meta_info["input_token_logprobs"][1:]]
        assert got == pytest.approx(want, abs=2e-3)


def test_logit_bias_on_gpu_forces_a_token_through_graph_replays(engine):
    prompts = prompt_ids(4, seed=6)
    alone = engine.generate(prompts[2], {**GREEDY, "max_new_tokens": 24, "ignore_eos": True})
    outs = engine.generate(prompts, [
        {**GREEDY, "max_new_tokens": 24, "ignore_eos": True, "logit_bias": {"42": 100}},
        {"temperature": 0.9, "seed": 3, "max_new_tokens": 24, "ignore_eos": True, "logit_bias": {"43": 100}},
        {**GREEDY, "max_new_tokens": 24, "ignore_eos": True},
        {**GREEDY, "max_new_tokens": 24, "ignore_eos": True, "logit_bias": {"44": 100}}])
    assert outs[0].token_ids == [42] * 24 and outs[1].token_ids == [43] * 24 and outs[3].token_ids == [44] * 24
    assert outs[2].token_ids == alone.token_ids  # no bias leaks into the row without one


def test_leaving_a_stream_on_gpu_frees_its_kv(engine):
    free = engine.runner.allocator.available_size()
    stream = engine.generate_stream(prompt_ids(1, seed=7)[0], {**GREEDY, "max_new_tokens": 2000, "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 20:
            break
    stream.close()
    assert engine.runner.allocator.available_size() == free
    assert engine.load().num_running == 0 and not engine.scheduler.has_work()
