"""Speculative decoding with DP attention (tp = dp = 2: each rank schedules, drafts and verifies its own
requests; a round's verify forwards meet at the sharded MLP, a rank with nothing to verify joins them
with an IDLE batch) and with plain dp 2 replicas (each replica has its own speculative worker). Greedy
output equals one rank's non-speculative output, with mixed prompt lengths, chunked prefill, radix
hits and retraction; no KV slot is left in use on any rank."""

from __future__ import annotations

import pytest

from plait.parallel.dp_attention import DPAttentionScheduler
from plait.testing import make_eagle_head, make_tiny_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 10}
PROMPTS = prompt_ids(5)  # 3 to 20 tokens: several prefill chunks of 16 for the longest
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "dist_timeout": 60,
                "chunked_prefill_size": 16}
REPLICAS = {"dp_size": 2, "chunked_prefill_size": 16}
LAYOUTS = {"dp_attention": DP_ATTENTION, "replicas": REPLICAS}
NGRAM_CHAIN = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
NGRAM_TREE = {**NGRAM_CHAIN, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}
DRAFT_TREE = {"speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4}
DRAFT_CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(target):
    with make_engine(target) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """EAGLE3 captures target layers [2, L // 2, L - 3]: it needs at least three."""
    return make_tiny_model(tmp_path_factory.mktemp("three_layers"), "llama", seed=0, num_hidden_layers=3)


@pytest.fixture(scope="module")
def three_layer_reference(three_layers):
    with make_engine(three_layers) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _spec_stats(engine):
    return engine.scheduler.spec_worker.stats


def _check_no_leaks(engine) -> None:
    sched = engine.scheduler
    if isinstance(sched, DPAttentionScheduler):
        assert_no_leaks(engine)  # rank 0's pools
        for _ in range(2):  # rank 1 reports its KV use in the next round's exchange
            sched.step()
        assert sched.remote_kv_tokens_in_use == {1: 0}, "rank 1: KV slots leaked"
        return
    assert not sched.has_work()
    for i, (rs, rr) in enumerate(zip(sched.replicas, engine.runner.replicas, strict=True)):
        assert rs.kv_tokens_in_use() == 0, f"replica {i}: KV slots leaked"
        assert rs.tree_cache.protected_size() == 0, f"replica {i}: prefix-cache nodes still locked"
        assert rr.req_to_token_pool.available_size() == rr.req_to_token_pool.size, f"replica {i}: rows leaked"


def _check_every_rank_speculated(engine) -> None:
    if isinstance(engine.scheduler, DPAttentionScheduler):
        spec_rounds = list(engine.runner.count_sync.spec_rounds)  # requests verified per rank
        assert any(min(counts) > 0 for counts in spec_rounds), "both ranks verify in one round"
        assert engine.runner.phase_forwards["SPEC"] > 0
    else:
        assert all(s.spec_worker.stats.verify_steps > 0 for s in engine.scheduler.replicas)


def _check(engine, reference, again: bool = True) -> None:
    first = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == reference
    if again:  # radix-cache hits; n-gram drafts from the first answers
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert _spec_stats(engine).verify_steps > 0
    _check_every_rank_speculated(engine)
    _check_no_leaks(engine)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ngram_chain_with_retraction_keeps_greedy_output_exact(target, reference, layout, monkeypatch):
    """A small KV pool: requests are retracted and re-prefilled (their drafts and trees rebuilt)."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(target, **LAYOUTS[layout], **NGRAM_CHAIN, max_total_tokens=32) as engine:
        _check(engine, reference)
        assert engine.scheduler.stats.num_retractions > 0
        assert sum(n for k, n in _spec_stats(engine).accept_histogram.items() if k > 0) > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ngram_tree_keeps_greedy_output_exact(target, reference, layout, monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(target, **LAYOUTS[layout], **NGRAM_TREE) as engine:
        _check(engine, reference)
        assert sum(n for k, n in _spec_stats(engine).accept_histogram.items() if k > 0) > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_standalone_keeps_greedy_output_exact(target, reference, tmp_path, layout, monkeypatch):
    """Each rank (replica) runs its own replicated draft model over its own KV pool."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    flags = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft), **DRAFT_TREE}
    with make_engine(target, **LAYOUTS[layout], **flags) as engine:
        _check(engine, reference, again=False)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("fmt", "shape"), [("EAGLE", DRAFT_CHAIN), ("EAGLE3", DRAFT_TREE)], ids=["EAGLE", "EAGLE3"])
def test_eagle_keeps_greedy_output_exact(three_layers, three_layer_reference, tmp_path, layout, fmt, shape,
                                         monkeypatch):
    """Each rank's head reads the target's whole embedding and LM head (whole under DP attention)."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    head = make_eagle_head(tmp_path / fmt, three_layers, fmt)
    flags = {"speculative_algorithm": fmt, "speculative_draft_model_path": str(head), **shape}
    with make_engine(three_layers, **LAYOUTS[layout], **flags) as engine:
        _check(engine, three_layer_reference, again=False)
