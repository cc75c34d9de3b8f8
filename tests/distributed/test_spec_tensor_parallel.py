"""Speculative decoding with tensor parallelism (tp 2 over gloo, rank 1 a spawned process): rank 0
drafts and accepts; every rank verifies the same trees (the step broadcast carries the tokens per
request and the tree mask) and mirrors rank 0's request-pool writes, accepted tree paths included.
Greedy output equals one rank's non-speculative output; no KV slot is left in use."""

from __future__ import annotations

import pytest

from plait.testing import make_eagle_head, make_tiny_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids

GREEDY = {"temperature": 0.0, "max_new_tokens": 12}
PROMPTS = prompt_ids(6)
TP2 = {"tp_size": 2, "dist_timeout": 60, "chunked_prefill_size": 24}
NGRAM_CHAIN = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
NGRAM_TREE = {**NGRAM_CHAIN, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(target):
    with make_engine(target) as engine:
        return [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]


def _check(engine, reference) -> None:
    first = engine.generate(PROMPTS, GREEDY)
    again = engine.generate(PROMPTS, GREEDY)  # radix-cache hits; n-gram drafts from the first answers
    assert [o.token_ids for o in first] == reference
    assert [o.token_ids for o in again] == reference
    assert engine.scheduler.spec_worker.stats.verify_steps > 0
    assert_no_leaks(engine)


@pytest.mark.parametrize("flags", [NGRAM_CHAIN, NGRAM_TREE], ids=["chain", "tree"])
def test_ngram_under_tp2_keeps_greedy_output_exact(target, reference, flags, monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(target, **TP2, **flags) as engine:
        _check(engine, reference)
        hist = engine.scheduler.spec_worker.stats.accept_histogram
        assert sum(n for k, n in hist.items() if k > 0) > 0  # drafts were accepted, trees remapped


def test_standalone_under_tp2_keeps_greedy_output_exact(target, reference, tmp_path, monkeypatch):
    """The draft model is replicated on rank 0 (it is small; rank 0 drafts alone), the target sharded."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    flags = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft),
             "speculative_eagle_topk": 2, "speculative_num_steps": 2, "speculative_num_draft_tokens": 4}
    with make_engine(target, **TP2, **flags) as engine:
        _check(engine, reference)


@pytest.fixture(scope="module")
def six_layers(tmp_path_factory):
    """EAGLE3 captures target layers [2, L // 2, L - 3]: it needs a deeper target."""
    return make_tiny_model(tmp_path_factory.mktemp("six_layers"), "llama", seed=0, num_hidden_layers=6)


@pytest.mark.parametrize("fmt", ["EAGLE", "EAGLE3"])
def test_eagle_under_tp2_keeps_greedy_output_exact(six_layers, tmp_path, fmt, monkeypatch):
    """The head runs on rank 0 with whole copies of the target's embedding and LM head."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    prompts = PROMPTS[:4]
    with make_engine(six_layers) as engine:
        reference = [o.token_ids for o in engine.generate(prompts, GREEDY)]
    head = make_eagle_head(tmp_path / fmt, six_layers, fmt)
    flags = {"speculative_algorithm": fmt, "speculative_draft_model_path": str(head),
             "speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4}
    with make_engine(six_layers, **TP2, **flags) as engine:
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference
        assert engine.scheduler.spec_worker.stats.verify_steps > 0
        assert_no_leaks(engine)
