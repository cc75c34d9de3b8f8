"""STANDALONE speculative decoding: a separate draft model with its own KV pool over the target's
slot numbering. Greedy output equals non-speculative greedy output; with the target itself as the
draft every guess is accepted, which holds only if the draft's KV is right at every position
(mirrored prefill chunks, prefix-cache hits, re-prefill after retraction, draft-extend over accepted
tokens)."""

from __future__ import annotations

import pytest

from plait.attention.plan_check import PlanCheckingBackend
from plait.testing import make_tiny_model
from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(8)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def small_draft(tmp_path_factory):
    """A 1-layer draft with the target's tokenizer (different weights: many guesses are rejected)."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def reference(model_path):
    return [o.token_ids for o in make_engine(model_path).generate(PROMPTS, GREEDY)]


def _standalone(draft, **kw):
    return {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft), **kw}


def test_a_small_draft_keeps_greedy_output_exact(model_path, small_draft, reference):
    engine = make_engine(model_path, **_standalone(small_draft))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    hist = engine.scheduler.spec_worker.stats.accept_histogram
    assert hist[0] > 0 and sum(hist.values()) > 0
    assert all(o.meta_info["spec_verify_ct"] > 0 for o in outs)
    assert_no_leaks(engine)


def test_the_target_as_its_own_draft_accepts_everything_through_cache_hits_and_chunks(model_path, reference):
    engine = make_engine(model_path, chunked_prefill_size=5, **_standalone(model_path, speculative_num_steps=2,
                                                                             speculative_num_draft_tokens=3))
    engine.generate(PROMPTS[:4], GREEDY)
    outs = engine.generate(PROMPTS, GREEDY)  # half the prompts hit the prefix cache
    assert [o.token_ids for o in outs] == reference
    hist = engine.scheduler.spec_worker.stats.accept_histogram
    assert set(hist) <= {1, 2} and hist[2] > 0  # only the token budget cuts a draft short
    assert_no_leaks(engine)


def test_retraction_re_prefills_the_draft_too(model_path, reference):
    engine = make_engine(model_path, max_total_tokens=220, disable_radix_cache=True, **_standalone(model_path))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.stats.num_retractions > 0
    assert engine.scheduler.spec_worker.stats.accept_histogram[3] > 0
    assert_no_leaks(engine)


def test_per_step_draft_backends_carry_the_effective_name(model_path, small_draft):
    engine = make_engine(model_path, **_standalone(small_draft, speculative_draft_attention_backend="torch_native"))
    multi = engine.scheduler.spec_worker.decode_backend
    assert multi.name == "torch_native" and len(multi.children) == 3
    for child in multi.children:
        assert child.name == "torch_native"
        assert isinstance(child, PlanCheckingBackend) and child.inner.name == "torch_native"


def test_top_k_draft_trees_keep_greedy_output_exact(model_path, small_draft, reference):
    engine = make_engine(model_path, **_standalone(small_draft, speculative_eagle_topk=2,
                                                   speculative_num_draft_tokens=5))
    worker = engine.scheduler.spec_worker
    widths: list[int] = []
    branching: list[bool] = []
    real_propose = worker.propose

    def propose(sched, reqs, depths):
        trees = real_propose(sched, reqs, depths)
        for t in trees:
            widths.append(t.width)
            branching.append(any(len(t.children(n)) > 1 for n in range(t.width)))
        return trees

    worker.propose = propose
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert max(widths) == 5 and any(branching)  # real trees, not chains
    assert worker.draft_graphs is None
    assert_no_leaks(engine)


def test_the_target_as_its_own_tree_draft_accepts_full_depth(model_path, reference):
    engine = make_engine(model_path, **_standalone(model_path, speculative_num_steps=3, speculative_eagle_topk=2,
                                                   speculative_num_draft_tokens=6))
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert engine.scheduler.spec_worker.stats.accept_histogram[3] > 0
    assert_no_leaks(engine)


def test_the_kv_budget_holds_the_draft_pool_too(model_path, small_draft):
    """Both pools have the same slot count, so the slots are sized by target + draft bytes per token
    (the CPU budget is fixed bytes; on a GPU the draft's weights come off the budget as well)."""
    from plait.executor.sizing import CPU_KV_BUDGET_BYTES
    from plait.mem.pools import MHATokenToKVPool

    engine = make_engine(model_path, max_total_tokens=None, **_standalone(small_draft))
    runner = engine.runner
    target, draft = runner.model_config, engine.scheduler.spec_worker.draft_config
    per_token = sum(MHATokenToKVPool.bytes_per_token(c.dtype, c.num_layers, c.num_kv_heads, c.head_dim)
                    for c in (target, draft))
    assert runner.max_total_tokens == CPU_KV_BUDGET_BYTES // per_token
    assert engine.scheduler.spec_worker.kv_pool.size == runner.max_total_tokens
    engine.shutdown()


def test_weight_bytes_counts_every_projection_of_the_model(small_draft):
    import torch
    from safetensors.torch import load_file

    from plait.models.loader import load_model_config, weight_bytes

    mc = load_model_config(str(small_draft), "float32")
    on_disk = sum(t.numel() for f in small_draft.glob("*.safetensors") for t in load_file(f).values())
    assert weight_bytes(mc) == on_disk * torch.tensor([], dtype=torch.float32).element_size()
