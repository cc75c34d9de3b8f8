"""Top-k draft trees from a draft model (SGLang-style expansion), model-agnostic, on the device.

Step 0 expands the root into its ``topk`` best tokens. Every later step expands each of the
``topk`` frontier nodes into its ``topk`` best children and keeps the ``topk`` best of those
``topk * topk`` candidates by cumulative log-probability as the next frontier (ties keep the
frontier/top-k order). After the last step the ``num_draft_tokens - 1`` best non-root nodes by
(score descending, node index) within the request's depth limit form the tree.

Node layout (static, so nothing about the shapes depends on the draft's choices): node 0 is the
root; step s adds nodes ``[1 + s*topk, 1 + (s+1)*topk)``, all at depth s + 1. Tokens, parents,
cumulative scores and the ancestor matrix live on the device; the host sees them once, after the
last step (one copy), to build the trees: ``expand_on_device`` is the device half (no host sync, a
graph records it), ``trees_from_packed`` the host half. Every request is expanded
``max(max_depths)`` steps and nodes deeper than its own limit are left out of its selection: a
level's nodes depend only on the levels above it, so this equals stopping early.

Invariant of the final selection: a child's score is its parent's plus a log-probability (<= 0), and
children come after their parents in node order, so sorting by (score descending, node index) puts
every parent before its children and any prefix of that order is closed under ancestors.

``step_fn(width, tokens, parents, ancestors)`` runs the draft over the first ``width`` nodes of
every request (``tokens``/``parents`` int64 ``[bs, width]``, ``ancestors`` bool ``[bs, width, width]``,
row i True at i and its ancestors; node i at position prefix + depth(i)) and returns the
log-probabilities ``[bs, F, V]`` at the frontier: the last F nodes (F = 1 at step 0, ``topk``
later). Recomputing the earlier nodes each step keeps the draft KV free of tree state.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.speculative.tree import DraftTree
from plait.transfer import to_host

StepFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def node_depth(node: int, topk: int) -> int:
    return 0 if node == 0 else 1 + (node - 1) // topk


def level_tree(width: int, topk: int) -> DraftTree:
    """A tree with the node layout's depths (tokens 0, each node's parent the first node one level
    up): the shape of a partial expansion, for building batches whose tokens and mask come from
    the device."""
    parents = [-1] + [0 if node_depth(n, topk) == 1 else 1 + (node_depth(n, topk) - 2) * topk
                      for n in range(1, width)]
    return DraftTree([0] * width, parents)


def expand_trees(roots: torch.Tensor, max_depths: list[int], topk: int, num_draft_tokens: int,
                 step_fn: StepFn) -> list[DraftTree]:
    """``roots``: int64 ``[bs]`` on the draft's device."""
    packed = expand_on_device(roots, max(max_depths), topk, step_fn)
    return trees_from_packed(packed, max_depths, topk, num_draft_tokens)


def expand_on_device(roots: torch.Tensor, steps: int, topk: int, step_fn: StepFn) -> torch.Tensor:
    """The device half of ``expand_trees``: ``steps`` expansion steps, no host sync and every shape a
    function of (bs, steps, topk), so a graph can record it (plait.speculative.tree_draft_graph).
    Returns float64 ``[bs, 3 * n]`` (n = 1 + steps * topk): node tokens, parents, cumulative scores."""
    bs, device = roots.shape[0], roots.device
    n_max = 1 + steps * topk
    tokens = torch.zeros(bs, n_max, dtype=torch.int64, device=device)
    tokens[:, 0] = roots
    parents = torch.full((bs, n_max), -1, dtype=torch.int64, device=device)
    scores = torch.zeros(bs, n_max, dtype=torch.float64, device=device)  # float64: host-exact sums
    ancestors = torch.zeros(bs, n_max, n_max, dtype=torch.bool, device=device)
    ancestors[:, 0, 0] = True
    for s in range(steps):
        width = 1 + s * topk
        first = 0 if s == 0 else width - topk  # the frontier: the last level's nodes
        lp = step_fn(width, tokens[:, :width], parents[:, :width], ancestors[:, :width, :width])
        values, ids = lp.float().topk(topk, dim=-1)  # [bs, F, topk]
        cand = (scores[:, first:width, None] + values.double()).reshape(bs, -1)  # frontier-major order
        best = torch.sort(cand, dim=1, descending=True, stable=True).indices[:, :topk]
        new = slice(width, width + topk)
        tokens[:, new] = ids.reshape(bs, -1).gather(1, best)
        parent = first + best // topk
        parents[:, new] = parent
        scores[:, new] = cand.gather(1, best)
        ancestors[:, new, :] = ancestors.gather(1, parent[:, :, None].expand(bs, topk, n_max))
        # Each new node is its own ancestor: the diagonal of its block, filled in place (no index
        # tensor, nothing from the host: a graph records it).
        ancestors[:, new, new].diagonal(dim1=1, dim2=2).fill_(True)
    return torch.cat([tokens.double(), parents.double(), scores], dim=1)  # ids < 2**53: exact


def trees_from_packed(packed: torch.Tensor, max_depths: list[int], topk: int,
                      num_draft_tokens: int) -> list[DraftTree]:
    """The host half: one copy of ``expand_on_device``'s output ``[bs, 3 * n]``, then each request's
    best ``num_draft_tokens - 1`` nodes within its depth limit."""
    n_max = packed.shape[1] // 3
    host = to_host(packed)
    return [_select(host[b, :n_max].astype(int).tolist(), host[b, n_max : 2 * n_max].astype(int).tolist(),
                    host[b, 2 * n_max :].tolist(), depth, topk, num_draft_tokens)
            for b, depth in enumerate(max_depths)]


def _select(tokens: list[int], parents: list[int], scores: list[float], max_depth: int, topk: int,
            num_draft_tokens: int) -> DraftTree:
    nodes = range(1, 1 + max_depth * topk)  # levels within this request's depth limit
    order = sorted(nodes, key=lambda n: (-scores[n], n))[: num_draft_tokens - 1]
    keep = [0, *sorted(order)]  # node order again: parents before children
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree([tokens[n] for n in keep], [-1] + [new_index[parents[n]] for n in keep[1:]])
