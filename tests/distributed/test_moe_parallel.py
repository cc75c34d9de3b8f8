"""Mixture-of-experts models over two real processes (gloo): tensor parallelism shards each expert's
intermediate dimension, expert parallelism places whole experts on ranks, and both run under DP
attention. Greedy tokens must equal one rank's (fp32; reduction order differs, the argmax must not)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_no_leaks, make_engine, prompt_ids, single_rank_outputs

GREEDY12 = {"temperature": 0.0, "max_new_tokens": 12}
PROMPTS = prompt_ids(4)


def _tokens(engine) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(PROMPTS, GREEDY12)]


@pytest.mark.parametrize(("arch", "layout"), [
    ("qwen2-moe", {"tp_size": 2}),  # experts and the shared expert split along their intermediate dims
    ("gpt-oss", {"tp_size": 2, "ep_size": 2}),  # four experts (and their biases) per rank, sinks split by head
    ("qwen3-moe", {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}),
])
def test_parallel_greedy_tokens_equal_one_rank(arch, layout, tiny_model_dir):
    path = tiny_model_dir(arch)
    expected = single_rank_outputs(path, PROMPTS, GREEDY12)
    with make_engine(path, dist_timeout=60, **layout) as engine:
        experts = next(m.mlp.experts for m in engine.runner.model.model.layers if hasattr(m.mlp, "experts"))
        ep = layout.get("ep_size", 1)
        assert experts.num_local_experts == 8 // ep and experts.moe_tp_size == 2 // ep
        assert _tokens(engine) == [expected[tuple(p)] for p in PROMPTS]
        if not layout.get("enable_dp_attention"):
            assert_no_leaks(engine)
