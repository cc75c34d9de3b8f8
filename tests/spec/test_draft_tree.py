"""SGLang-style top-k tree expansion on the device (plait.speculative.draft_tree) on a scripted draft."""

from __future__ import annotations

import pytest
import torch

from plait.speculative.draft_tree import expand_trees, level_tree
from plait.speculative.tree import DraftTree, build_verify_mask, build_verify_mask_from_ancestors

V = 8


def _scripted(table: dict[int, list[float]], topk: int = 2):
    """Log-probs by the frontier node's token (default: uniform), recording each step's partial trees."""
    calls = []

    def step(width, tokens, parents, ancestors):
        calls.append((width, tokens.tolist(), parents.tolist(), ancestors.clone()))
        frontier = 1 if width == 1 else topk
        rows = [[torch.tensor(table.get(int(t), [0.0] * V)).log_softmax(-1) for t in row[width - frontier :]]
                for row in tokens]
        return torch.stack([torch.stack(r) for r in rows])

    return step, calls


def test_each_step_keeps_the_topk_best_children_by_cumulative_score():
    # root 0 -> 1 (p .5), 2 (p .3); 1 -> 3 (p .9); 2 -> 4 (p .9): keep 1->3 and 2->4, drop 1's runner-up.
    table = {0: [0, 5, 4.5, 0, 0, 0, 0, 0], 1: [0, 0, 0, 9, 0, 5, 0, 0], 2: [0, 0, 0, 0, 9, 0, 0, 0]}
    step, calls = _scripted({k: [float(x) for x in v] for k, v in table.items()})
    (tree,) = expand_trees(torch.tensor([0]), [2], topk=2, num_draft_tokens=5, step_fn=step)
    assert tree.tokens == [0, 1, 2, 3, 4]
    assert tree.parents == [-1, 0, 0, 1, 2]
    # step 1 scores the whole partial tree: root and its two children, each seeing itself and the root
    assert [c[0] for c in calls] == [1, 3] and calls[1][1] == [[0, 1, 2]] and calls[1][2] == [[-1, 0, 0]]
    assert calls[1][3][0].tolist() == [[True, False, False], [True, True, False], [True, False, True]]


def test_final_selection_is_ancestor_closed_and_respects_each_depth_limit():
    step, _ = _scripted({})  # uniform: every child scores its depth * log(1/8)
    deep, shallow = expand_trees(torch.tensor([0, 0]), [3, 1], topk=2, num_draft_tokens=4, step_fn=step)
    assert deep.width == 4 and max(deep.depths()) <= 2  # depth-1 nodes outrank deeper ones
    assert all(p < i for i, p in enumerate(deep.parents) if i)
    assert shallow.width == 3 and max(shallow.depths()) == 1


def test_requests_of_a_batch_expand_independently():
    table = {0: [0, 5, 4.5, 0, 0, 0, 0, 0], 7: [0, 0, 0, 0, 0, 0, 3, 6]}
    step, _ = _scripted({k: [float(x) for x in v] for k, v in table.items()})
    a, b = expand_trees(torch.tensor([0, 7]), [1, 1], topk=2, num_draft_tokens=3, step_fn=step)
    assert a.tokens == [0, 1, 2] and b.tokens == [7, 7, 6]


def test_level_tree_has_the_layouts_depths():
    assert level_tree(7, topk=3).depths() == [0, 1, 1, 1, 2, 2, 2]


def test_mask_from_device_ancestors_equals_the_host_mask():
    trees = [DraftTree([0, 1, 2, 3, 4], [-1, 0, 0, 1, 2]), DraftTree([0, 5, 6, 7, 8], [-1, 0, 0, 2, 2])]
    ancestors = torch.stack([torch.from_numpy(t.ancestor_mask().numpy()) for t in trees])
    assert torch.equal(build_verify_mask_from_ancestors(ancestors, [3, 6]), build_verify_mask(trees, [3, 6], "cpu"))


@pytest.mark.parametrize("parents", [(-1, 0, 1, 2), (-1, 0, 0, 1, 2, 3)], ids=["chain", "tree"])
def test_a_batch_of_one_tree_shape_gets_the_mask_each_block_gets_alone(parents):
    # Each block is the request's own mask whatever its neighbours: prefix columns all True, the
    # node part its ancestor mask.
    prefix = [0, 7, 3, 12, 1] * 4
    tree = DraftTree(list(range(10, 10 + len(parents))), list(parents))
    batched = build_verify_mask([tree] * len(prefix), prefix, "cpu")
    alone = torch.cat([build_verify_mask([tree], [p], "cpu") for p in prefix])
    assert torch.equal(batched, alone)
