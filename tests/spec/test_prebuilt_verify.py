"""Chain batches built ahead (``PrebuiltChainBatches``): a launch that takes prebuilt inputs gets the
batch a fresh build makes, an entry serves one batch, and inputs that differ in anything the build
reads are not taken. In the engine, the chained verifies of a lone request take their inputs
prebuilt (and the KV slots held for them) while greedy output stays unchanged and no slot leaks."""

from __future__ import annotations

import random

import pytest
import torch

from plait.speculative.tree import DraftTree
from plait.speculative.verify_batch import DraftRow, PrebuiltChainBatches, build_verify_batch
from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

CHAIN = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}


def _batch(rng: random.Random) -> tuple[list[DraftRow], list[DraftTree], int | None]:
    bs = rng.randrange(1, 4)
    rows = [DraftRow(rng.randrange(1, 50), rng.randrange(1, 8)) for _ in range(bs)]
    trees = [DraftTree.chain(rng.randrange(400), [rng.randrange(400) for _ in range(rng.randrange(4))])
             for _ in range(bs)]
    pad = rng.choice([None, max(t.width for t in trees) + rng.randrange(2)])
    return rows, trees, pad


def _fields(fb) -> list:
    ext = fb.extend
    return [fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc, ext.seq_lens,
            ext.prefix_lens, ext.start_loc, fb.seq_lens_cpu, fb.seq_lens_sum, ext.num_tokens, ext.seq_lens_cpu,
            ext.prefix_lens_cpu, fb.spec_info.num_tokens_per_req, fb.spec_info.custom_mask]


def _same(a: list, b: list) -> bool:
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b, strict=True))


def test_a_prebuilt_batch_equals_a_fresh_build_and_serves_one_launch():
    rng = random.Random(0)
    for _ in range(100):
        batches = [_batch(rng) for _ in range(rng.randrange(1, 4))]
        prebuilt = PrebuiltChainBatches()
        prebuilt.prepare(batches, "cpu")
        for rows, trees, pad in batches:
            slots = torch.arange(100, 100 + sum(t.width for t in trees))
            fresh = build_verify_batch(rows, trees, slots, "cpu", pad_width=pad, causal_chains=True)
            taken = build_verify_batch(rows, trees, slots, "cpu", pad_width=pad, causal_chains=True,
                                       prebuilt=prebuilt)
            assert _same(_fields(taken), _fields(fresh))
        assert not prebuilt  # every entry was taken once


@pytest.mark.parametrize("change", ["kv_len", "pool_row", "token", "pad"])
def test_a_batch_whose_inputs_differ_is_built_not_taken(change):
    rows, trees, pad = [DraftRow(20, 3)], [DraftTree.chain(7, [8, 9])], None
    prebuilt = PrebuiltChainBatches()
    prebuilt.prepare([(rows, trees, pad)], "cpu")
    if change == "kv_len":
        rows = [DraftRow(21, 3)]
    elif change == "pool_row":
        rows = [DraftRow(20, 4)]
    elif change == "token":
        trees = [DraftTree.chain(7, [8, 10])]
    else:
        pad = 4
    slots = torch.arange(3)
    fb = build_verify_batch(rows, trees, slots, "cpu", pad_width=pad, causal_chains=True, prebuilt=prebuilt)
    fresh = build_verify_batch(rows, trees, slots, "cpu", pad_width=pad, causal_chains=True)
    assert _same(_fields(fb), _fields(fresh))
    assert prebuilt  # the prepared entry is still there, untaken


def test_chained_verifies_of_one_request_take_prebuilt_inputs_and_output_is_unchanged(tiny_model_dir):
    path = tiny_model_dir("llama")
    prompts = prompt_ids(3)
    reference = [o.token_ids for o in make_engine(path).generate(prompts, GREEDY)]
    engine = make_engine(path, max_running_requests=1, **CHAIN)
    engine.generate(prompts, GREEDY)  # fills the n-gram cache with the answers
    worker = engine.scheduler.spec_worker
    taken = {"hit": 0, "miss": 0}
    inner = worker.prebuilt.take

    def counted(key):
        out = inner(key)
        taken["hit" if out is not None else "miss"] += 1
        return out

    worker.prebuilt.take = counted
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == reference
    # Repeats land on the guessed outcome: most chained launches found their inputs built.
    assert taken["hit"] > 2 * taken["miss"], taken
    assert worker._reserved_slots is None  # the slots held for a next launch went to it or back
    assert_no_leaks(engine)
