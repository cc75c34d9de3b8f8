"""Speculative decoding with DP attention (tp = dp = 2: each rank schedules, drafts and verifies its own
requests; a round's verify forwards meet at the sharded MLP, a rank with nothing to verify joins them
with an IDLE batch) and with plain dp 2 replicas (each replica has its own speculative worker). Greedy
output equals one rank's non-speculative output, with mixed prompt lengths, chunked prefill, radix
hits and retraction; no KV slot is left in use."""

from __future__ import annotations

import pytest

from plait.parallel.dp_attention import DPAttentionScheduler
from plait.testing import make_eagle_head, make_tiny_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 10}
PROMPTS = prompt_ids(5)
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "dist_timeout": 60,
                "chunked_prefill_size": 16}
REPLICAS = {"dp_size": 2, "chunked_prefill_size": 16}
NGRAM_CHAIN = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
NGRAM_TREE = {**NGRAM_CHAIN, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}
LAYOUTS = {"dp_attention": DP_ATTENTION, "replicas": REPLICAS}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(target):
    with make_engine(target) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _spec_stats(engine):
    return engine.scheduler.spec_worker.stats


def _check_no_leaks(engine) -> None:
    if isinstance(engine.scheduler, DPAttentionScheduler):
        assert_no_leaks(engine)  # rank 0's pool (the other rank's is checked by its own leak guard)
        return
    sched = engine.scheduler
    assert not sched.has_work()
    for i, (rs, rr) in enumerate(zip(sched.replicas, engine.runner.replicas, strict=True)):
        assert rs.kv_tokens_in_use() == 0, f"replica {i}: KV slots leaked"
        assert rs.tree_cache.protected_size() == 0, f"replica {i}: prefix-cache nodes still locked"
        assert rr.req_to_token_pool.available_size() == rr.req_to_token_pool.size, f"replica {i}: rows leaked"


def _check(engine, reference, prompts=PROMPTS) -> None:
    first = engine.generate(prompts, GREEDY)
    again = engine.generate(prompts, GREEDY)  # radix-cache hits; n-gram drafts from the first answers
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in again] == reference
    assert _spec_stats(engine).verify_steps > 0
    _check_no_leaks(engine)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("flags", [NGRAM_CHAIN, NGRAM_TREE], ids=["chain", "tree"])
def test_ngram_keeps_greedy_output_exact(target, reference, layout, flags, monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(target, **LAYOUTS[layout], **flags) as engine:
        _check(engine, reference)
        assert sum(n for k, n in _spec_stats(engine).accept_histogram.items() if k > 0) > 0
