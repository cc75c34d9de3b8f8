"""Mixture-of-experts models over two real processes (gloo): tensor parallelism shards each expert's
intermediate dimension, expert parallelism places whole experts on ranks, and both run under DP
attention. Greedy tokens must equal one rank's (fp32; reduction order differs, the argmax must not)."""

from __future__ import annotations

import pytest

from tests.helpers import assert_no_leaks, make_engine, prompt_ids, single_rank_outputs

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PROMPTS = prompt_ids(3)


@pytest.mark.parametrize(("arch", "layout"), [
    # Each expert (and its biases) split along its intermediate dim, the bias added by one rank; sinks
    # split by head with the attention heads.
    ("gpt-oss", {"tp_size": 2}),
    # Under DP attention, four experts per rank (ep 2) and the shared expert's partial sums combined
    # by DP attention's reduce-scatter.
    ("qwen2-moe", {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "ep_size": 2}),
])
def test_parallel_greedy_tokens_equal_one_rank(arch, layout, tiny_model_dir):
    path = tiny_model_dir(arch)
    expected = single_rank_outputs(path, PROMPTS, GREEDY)
    with make_engine(path, dist_timeout=60, max_total_tokens=256, **layout) as engine:
        layers = engine.runner.model.model.layers
        experts = next(m.mlp.experts for m in layers if hasattr(m.mlp, "experts"))
        ep = layout.get("ep_size", 1)
        assert experts.num_local_experts == 8 // ep and experts.moe_tp_size == 2 // ep
        if ep == 1:
            assert layers[0].self_attn.attn.sinks.numel() == 2  # 4 heads over 2 ranks
        else:
            assert experts.local_expert(0) == 0 and experts.local_expert(4) is None  # rank 0: experts 0..3
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [expected[tuple(p)] for p in PROMPTS]
        if not layout.get("enable_dp_attention"):
            assert_no_leaks(engine)
