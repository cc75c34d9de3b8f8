"""Top-k draft trees from a draft model (SGLang-style expansion), model-agnostic.

Step 0 expands the root into its ``topk`` best tokens. Every later step expands each of the
``topk`` frontier nodes into its ``topk`` best children and keeps the ``topk`` best of those
``topk * topk`` candidates by cumulative log-probability as the next frontier. After the last step
the ``num_draft_tokens - 1`` best non-root nodes by score form the tree.

Invariant of the final selection: a child's score is its parent's plus a log-probability (<= 0), and
children come after their parents in node order, so sorting by (score descending, node index) puts
every parent before its children and any prefix of that order is closed under ancestors.

``score_nodes(request_ids, trees, frontier)`` runs the draft over every node of the partial trees of
the given requests (custom ancestor mask; node i at position prefix + depth(i)) and returns, per
request, the ``topk`` best log-probabilities at each of its frontier nodes and their token ids
(``frontier_topk``: the top-k is taken on the device and only ``[rows, topk]`` comes to the host,
not full-vocabulary rows). Recomputing the earlier nodes each step keeps the draft KV free of tree
state: no slots are held.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from plait.speculative.tree import DraftTree
from plait.transfer import to_host

# Per request: (log-probabilities [len(frontier), topk], token ids [len(frontier), topk]) on the host.
ScoreFn = Callable[[list[int], list[DraftTree], list[list[int]]], list[tuple[torch.Tensor, torch.Tensor]]]


def frontier_topk(logprobs: torch.Tensor, rows_per_request: list[int], topk: int
                  ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``logprobs`` [sum(rows), V] (any device) -> per request its rows' ``topk`` best values and
    ids, through one copy of ``[sum(rows), topk]`` pairs to the host."""
    values, ids = logprobs.float().topk(topk, dim=-1)
    host = to_host(torch.cat([values.double(), ids.double()], dim=1))  # ids < 2**53: exact in float64
    values_h = torch.from_numpy(host[:, :topk]).float()
    ids_h = torch.from_numpy(host[:, topk:]).long()
    return list(zip(values_h.split(rows_per_request), ids_h.split(rows_per_request), strict=True))


@dataclass
class _Partial:
    tokens: list[int]
    parents: list[int] = field(default_factory=lambda: [-1])
    scores: list[float] = field(default_factory=lambda: [0.0])
    depths: list[int] = field(default_factory=lambda: [0])
    frontier: list[int] = field(default_factory=lambda: [0])

    def tree(self) -> DraftTree:
        return DraftTree(list(self.tokens), list(self.parents))


def expand_trees(roots: list[int], max_depths: list[int], topk: int, num_draft_tokens: int,
                 score_nodes: ScoreFn) -> list[DraftTree]:
    parts = [_Partial([r]) for r in roots]
    for step in range(max(max_depths)):
        live = [i for i, p in enumerate(parts) if p.frontier and step < max_depths[i]]
        if not live:
            break
        best = score_nodes(live, [parts[i].tree() for i in live], [parts[i].frontier for i in live])
        for i, (top_v, top_i) in zip(live, best, strict=True):
            p = parts[i]
            cands = [(p.scores[f] + v, f, t) for f, vs, ts in zip(p.frontier, top_v.tolist(), top_i.tolist(),
                                                                    strict=True)
                     for v, t in zip(vs, ts, strict=True)]
            cands.sort(key=lambda c: -c[0])  # stable: ties keep the frontier/top-k order
            new = []
            for score, parent, tok in cands[:topk]:
                new.append(len(p.tokens))
                p.tokens.append(tok)
                p.parents.append(parent)
                p.scores.append(score)
                p.depths.append(p.depths[parent] + 1)
            p.frontier = new
    return [_select(p, num_draft_tokens) for p in parts]


def _select(p: _Partial, num_draft_tokens: int) -> DraftTree:
    order = sorted(range(1, len(p.tokens)), key=lambda n: (-p.scores[n], n))[: num_draft_tokens - 1]
    keep = [0, *sorted(order)]  # node order again: parents before children
    new_index = {old: new for new, old in enumerate(keep)}
    return DraftTree([p.tokens[n] for n in keep], [-1] + [new_index[p.parents[n]] for n in keep[1:]])
