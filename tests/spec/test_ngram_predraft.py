"""Pre-drafting: the NGRAM proposals prepared while a verify runs, one per way it can end, equal the
proposals drafted after it; lookups over a hypothesised continuation equal lookups after indexing it.
The engine-level check (greedy output unchanged, proposals ready) is in test_ngram_greedy.py."""

from __future__ import annotations

import copy
import random

import pytest

from plait.speculative.ngram import NgramDrafter, RequestIndex
from plait.speculative.tree import DraftTree


def test_lookups_over_pending_tokens_equal_lookups_after_indexing_them():
    rng = random.Random(0)
    for _ in range(300):
        tokens = [rng.randrange(4) for _ in range(rng.randrange(1, 14))]
        pending = [rng.randrange(4) for _ in range(rng.randrange(0, 6))]
        base = RequestIndex(max_window=3, min_window=1)
        base.extend(tokens)
        grown = RequestIndex(max_window=3, min_window=1)
        grown.extend(tokens + pending)
        for n in (1, 2, 3):
            for key in {tuple((tokens + pending)[i : i + n]) for i in range(len(tokens + pending) - n + 1)}:
                for limit in (1, 2, 3):
                    assert base.followers(key, limit, pending) == grown.followers(key, limit), (tokens, pending, key)


def _context(seed: int) -> list[int]:
    """A context that repeats itself with variations, so lookups match and branch."""
    rng = random.Random(seed)
    motif = [rng.randrange(10, 18) for _ in range(12)]
    out: list[int] = []
    for _ in range(8):
        out.extend(t if rng.random() > 0.4 else rng.randrange(10, 18) for t in motif)
    return out + motif[:4]  # ends inside the motif: the lookup matches


@pytest.mark.parametrize("topk,max_nodes", [(1, 4), (2, 6)], ids=["chain", "tree"])
def test_predrafted_proposal_equals_the_one_drafted_after_each_acceptance_length(topk, max_nodes):
    checked = {d: 0 for d in range(4)}  # accepted drafts -> outcomes compared
    for seed in range(40):
        drafter = NgramDrafter(min_window=2, max_window=4, capacity=1000)
        drafter.cache.insert(_context(seed + 100))  # a finished request: the global cache answers too
        context = _context(seed)
        tree = drafter.propose("r", context, max_depth=3, max_nodes=max_nodes, topk=topk)
        assert tree is not None
        prepared = drafter.predraft("r", context, tree, max_depth=3, max_nodes=max_nodes, topk=topk)
        for gained, tree_then in prepared.items():
            after = copy.deepcopy(drafter)  # the request's index as the next step finds it
            for depth in (1, 2, 3):
                expected = after.propose("r", context + list(gained), max_depth=depth, max_nodes=max_nodes,
                                         topk=topk)
                got = None if tree_then is None else tree_then.truncated(depth)
                assert (got and (got.tokens, got.parents)) == (expected and (expected.tokens, expected.parents))
            checked[len(gained) - 1] += 1
    assert all(checked.values()), checked  # every acceptance length, 0 to 3 drafts, was compared


def test_each_outcome_gains_an_accepted_path_and_a_bonus_that_was_not_rejected():
    drafter = NgramDrafter(min_window=2, max_window=4, capacity=1000)
    context = _context(3)
    tree = drafter.propose("r", context, max_depth=3, max_nodes=6, topk=2)
    assert tree is not None
    paths = {0: []}
    for node in range(1, tree.width):
        paths[node] = paths[tree.parents[node]] + [tree.tokens[node]]
    for gained in drafter.predraft("r", context, tree, max_depth=3, max_nodes=6, topk=2):
        node = next(n for n, p in paths.items() if p == list(gained[:-1]))
        assert gained[-1] not in [tree.tokens[c] for c in tree.children(node)]


def test_truncating_a_tree_keeps_its_shallow_levels():
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, 0, 0, 1, 2, 3])
    assert tree.truncated(1).tokens == [1, 2, 3]
    assert tree.truncated(2).parents == [-1, 0, 0, 1, 2]
    assert tree.truncated(3) is tree
    with pytest.raises(ValueError, match="breadth-first"):
        DraftTree([1, 2, 3, 4], [-1, 0, 1, 0]).truncated(1)

