"""Acceptance: which draft tokens the target keeps, and the token it adds after them.

Every routine returns ``(path, bonus)``: ``path`` is the accepted node chain starting at the root
(node 0), ``bonus`` the target's token after the last accepted node. The request gains
``tokens[path[1:]] + [bonus]``: between 1 and depth + 1 tokens.

Greedy: follow the child whose token equals the target's argmax at the current node (the longest
matching path); the bonus is the argmax where the walk stops. Output is exactly greedy decoding.

Sampling, deterministic drafts (n-gram, top-k trees: the draft distribution is one-hot): at the
current node with target distribution p, try the children in order; accept child x with probability
p(x) / sum(p); on rejection set p(x) = 0 and try the next sibling; when every child is rejected (or
there are none) sample the bonus from what is left of p. Each emitted token is then distributed
exactly as p (SpecInfer's multi-draft rule specialised to one-hot drafts).

Sampling, drafts drawn from a draft distribution q (a sampled chain; siblings drawn independently):
accept x with probability min(1, p(x) / q(x)); on rejection the residual becomes
norm(max(p - q, 0)) and the next sibling is tried, else the bonus is drawn from the residual; after
an accepted leaf the bonus is drawn from p (Leviathan et al. 2023, Chen et al. 2023; SpecInfer).

Random numbers come from the caller (``uniforms[node, j]``, strictly inside (0, 1)), so the engine
draws them from its counter RNG and tests from any generator.
"""

from __future__ import annotations

import numpy as np

from plait.speculative.tree import DraftTree


def greedy_accept(tree: DraftTree, target_ids: list[int]) -> tuple[list[int], int]:
    """``target_ids[i]``: the target's argmax token at node i."""
    path = [0]
    node = 0
    while True:
        want = target_ids[node]
        nxt = next((c for c in tree.children(node) if tree.tokens[c] == want), None)
        if nxt is None:
            return path, want
        path.append(nxt)
        node = nxt


def _sample(p: np.ndarray, u: float) -> int:
    """Inverse-CDF draw from the unnormalised non-negative vector p."""
    c = np.cumsum(p)
    idx = int(np.searchsorted(c, u * c[-1], side="right"))
    idx = min(idx, len(p) - 1)
    while p[idx] <= 0 and idx > 0:  # u * total landed on the edge of a zero run: step back
        idx -= 1
    return idx


def tree_accept_sampled(tree: DraftTree, probs: np.ndarray, uniforms: np.ndarray,
                        draft_probs: np.ndarray | None = None) -> tuple[list[int], int]:
    """Sampled acceptance over a tree. ``probs[i]``: the target distribution at node i (float64
    [w, V]); ``uniforms``: [w, >= max children + 1].

    ``draft_probs`` None: one-hot drafts (accept child x with probability p(x) under the residual,
    on rejection zero p(x)). Otherwise ``draft_probs[c]`` is the draft distribution q that child c
    was drawn from (siblings drawn independently from their parent's q): accept with probability
    min(1, p(x) / q(x)), on rejection the residual becomes norm(max(p - q, 0)) (SpecInfer's
    multi-draft rule; with one child per node it is the classic chain rule).
    """
    path = [0]
    node = 0
    while True:
        p = probs[node].astype(np.float64, copy=True)
        p /= p.sum()
        kids = tree.children(node)
        accepted = None
        for j, child in enumerate(kids):
            x = tree.tokens[child]
            if draft_probs is None:
                if uniforms[node, j] < p[x]:
                    accepted = child
                    break
                p[x] = 0.0
            else:
                q = draft_probs[child].astype(np.float64)
                if q[x] <= 0 or uniforms[node, j] * q[x] < p[x]:  # u < min(1, p/q)
                    accepted = child
                    break
                p = np.maximum(p - q, 0.0)
            total = p.sum()
            if total <= 0:  # nothing left to sample: exact arithmetic never gets here; guard rounding
                p = probs[node].astype(np.float64, copy=True)
                total = p.sum()
            p /= total
        if accepted is None:
            return path, _sample(p, uniforms[node, len(kids)])
        path.append(accepted)
        node = accepted


def chain_accept_sampled(tree: DraftTree, probs: np.ndarray, draft_probs: np.ndarray,
                         uniforms: np.ndarray) -> tuple[list[int], int]:
    """A chain sampled from a draft model: the classic min(1, p/q) rule (a tree with one child per
    node). ``draft_probs[i]`` (i >= 1): the draft distribution node i was drawn from."""
    return tree_accept_sampled(tree, probs, uniforms, draft_probs)
