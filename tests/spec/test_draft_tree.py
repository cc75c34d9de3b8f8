"""SGLang-style top-k tree expansion (plait.speculative.draft_tree) on a scripted draft."""

from __future__ import annotations

import torch

from plait.speculative.draft_tree import expand_trees, frontier_topk

V = 8


def _scripted(table: dict[int, list[float]], topk: int = 2):
    """Log-probs by the frontier node's token (default: uniform), recording each call's partial trees."""
    calls = []

    def score(ids, trees, frontier):
        calls.append([(t.tokens, list(f)) for t, f in zip(trees, frontier, strict=True)])
        rows = [torch.tensor(table.get(t.tokens[n], [0.0] * V)).log_softmax(-1)
                for t, f in zip(trees, frontier, strict=True) for n in f]
        return frontier_topk(torch.stack(rows), [len(f) for f in frontier], topk)

    return score, calls


def test_frontier_topk_brings_only_the_best_pairs_per_request():
    logprobs = torch.tensor([[-3.0, -1.0, -2.0], [-0.5, -4.0, -1.5], [-2.0, -2.5, -0.1]])
    (v0, i0), (v1, i1) = frontier_topk(logprobs, [1, 2], topk=2)
    assert i0.tolist() == [[1, 2]] and v0.tolist() == [[-1.0, -2.0]]
    assert i1.tolist() == [[0, 2], [2, 0]] and v1.shape == (2, 2)


def test_each_step_keeps_the_topk_best_children_by_cumulative_score():
    # root 0 -> 1 (p .5), 2 (p .3); 1 -> 3 (p .9); 2 -> 4 (p .9): keep 1->3 and 2->4, drop 1's runner-up.
    table = {0: [0, 5, 4.5, 0, 0, 0, 0, 0], 1: [0, 0, 0, 9, 0, 5, 0, 0], 2: [0, 0, 0, 0, 9, 0, 0, 0]}
    score, calls = _scripted({k: [float(x) for x in v] for k, v in table.items()})
    (tree,) = expand_trees([0], [2], topk=2, num_draft_tokens=5, score_nodes=score)
    assert tree.tokens == [0, 1, 2, 3, 4]
    assert tree.parents == [-1, 0, 0, 1, 2]
    assert len(calls) == 2 and calls[1][0] == ([0, 1, 2], [1, 2])  # step 1 scores the whole partial tree


def test_final_selection_is_ancestor_closed_and_respects_each_depth_limit():
    score, _ = _scripted({})  # uniform: every child scores its depth * log(1/8)
    trees = expand_trees([0, 0], [3, 1], topk=2, num_draft_tokens=4, score_nodes=score)
    deep, shallow = trees
    assert deep.width == 4 and max(deep.depths()) <= 2  # depth-1 nodes outrank deeper ones
    assert all(p < i for i, p in enumerate(deep.parents) if i)
    assert shallow.width == 3 and max(shallow.depths()) == 1
