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

The engine runs the one-hot rule on the device (``one_hot_decisions``): every node's decisions are
computed at once, as if the walk reached it, so only ``[nodes, children + 1]`` integers travel to the
host (not full-vocabulary probability rows), and the host walk (``walk_decisions``) just reads them.
``accept_trees`` applies the right rule to every request of a verify batch.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import numpy as np
import torch

from plait.sampling import (
    Sampler,
    SamplingBatchInfo,
    add_gumbel_noise_,
    counter_uniforms,
    greedy_ids,
)
from plait.scheduler.req import Req
from plait.speculative.tree import DraftTree
from plait.transfer import PendingHostCopy, host_tensor, ints_to_device, to_device, to_host

# Counter-RNG stream of the acceptance draws (stream 0 is the sampler's Gumbel noise).
ACCEPT_STREAM = 1


def greedy_accept(tree: DraftTree, target_ids: list[int]) -> tuple[list[int], int]:
    """``target_ids[i]``: the target's argmax token at node i."""
    if tree.is_chain:  # the walk without child lists: node k + 1 is node k's only child
        tokens, k = tree.tokens, 0
        while k + 1 < len(tokens) and tokens[k + 1] == target_ids[k]:
            k += 1
        return list(range(k + 1)), target_ids[k]
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


def child_token_table(trees: list[DraftTree], num_cols: int) -> list[int]:
    """Row-major ``[sum(widths), num_cols]`` table of each node's children's tokens, in sibling order,
    -1 where there is no child. A token repeated among siblings is -1 too: the walk zeroed p(x) at
    the first one, so the repeat can never be accepted."""
    table: list[int] = []
    for tree in trees:
        for node in range(tree.width):
            seen: set[int] = set()
            row = []
            for child in tree.children(node):
                tok = tree.tokens[child]
                row.append(-1 if tok in seen else tok)
                seen.add(tok)
            table.extend(row + [-1] * (num_cols - len(row)))
    return table


def one_hot_decisions(scores: torch.Tensor, child_tokens: torch.Tensor, uniforms: torch.Tensor,
                      noise_keys: torch.Tensor, use_triton: bool | None = None) -> torch.Tensor:
    """The one-hot sampled rule for many nodes at once, on the scores' device.

    ``scores``: float32 [R, V], the warped logits of each node's target distribution (softmax of a
    row is p; the tensor is read, not modified). ``child_tokens``: int64 [R, C] (``child_token_table``).
    ``uniforms``: [R, C] strictly inside (0, 1). ``noise_keys``: int64 [R], the Gumbel keys of the
    residual draw (the plain sampler's keys for the node's step: a node without children draws the
    token the plain sampler would).

    Returns int64 [R, C + 1]: column j < C is 1 when child j is accepted given that children
    0..j-1 were rejected (u_j < p(x_j) / (1 - sum of their p)); column C is a draw from p with every
    child removed, the bonus when all of them are rejected.
    """
    r, v = scores.shape
    valid = child_tokens >= 0
    probs = torch.softmax(scores, dim=-1)
    p_child = probs.gather(1, child_tokens.clamp(min=0)) * valid
    before = p_child.cumsum(dim=1) - p_child  # mass of the siblings tried (and rejected) first
    accept = uniforms * (1.0 - before).clamp(min=0.0) < p_child
    # Children out of the residual: a column past the vocabulary absorbs the padding (-1) entries,
    # so a scatter never writes two different values to one place.
    cols = torch.where(valid, child_tokens, v)
    drop = torch.zeros((r, v + 1), dtype=torch.bool, device=scores.device).scatter_(1, cols, True)[:, :v]
    residual = scores.masked_fill(drop, -math.inf)
    # Children covering p's whole support can still all be rejected through rounding (exact
    # arithmetic accepts one): draw from p itself then, as the host rule does.
    empty = residual.amax(dim=1, keepdim=True) == -math.inf
    residual = torch.where(empty, scores, residual)
    bonus = greedy_ids(add_gumbel_noise_(residual, noise_keys, use_triton))
    return torch.cat([accept.long(), bonus[:, None].long()], dim=1)


def walk_decisions(tree: DraftTree, decisions: np.ndarray) -> tuple[list[int], int]:
    """``(path, bonus)`` from ``one_hot_decisions`` rows of this tree's nodes (``decisions[node]``):
    at each node the first accepted child in sibling order, else the node's residual draw."""
    path = [0]
    node = 0
    while True:
        row = decisions[node]
        nxt = next((c for j, c in enumerate(tree.children(node)) if row[j]), None)
        if nxt is None:
            return path, int(row[-1])
        path.append(nxt)
        node = nxt


def accept_trees(reqs: Sequence[Req], trees: list[DraftTree], logits: torch.Tensor, use_triton: bool,
                 max_draws: int, row_widths: list[int] | None = None, greedy: torch.Tensor | None = None,
                 greedy_host: PendingHostCopy | None = None) -> list[tuple[list[int], int]]:
    """``(path, bonus)`` per request of a verify batch. ``logits``: float32 ``[rows, V]``;
    ``row_widths``: logits rows per request when the verify batch was padded (real nodes first),
    default the trees' widths. ``greedy``: the logits' argmax when the forward computed it already
    (verify graphs); ``greedy_host``: its copy to the host, started already (then every request is
    greedy, and ``logits`` gives only the row count: a later forward may have overwritten it).
    ``max_draws``: uniforms drawn per node for soft drafts (at least the most children a node has,
    plus one for the bonus).

    Greedy rows take the argmax; sampled rows with one-hot drafts (n-gram, top-k trees, and requests
    riding along without a draft) decide on the device (``one_hot_decisions``); both come to the host
    in one copy. Only drafts with a soft draft distribution bring probability rows to the host."""
    # The sampler's rule for greedy rows, so a request gets the same treatment on both paths.
    sampled = [i for i, r in enumerate(reqs) if not r.sampling_params.samples_argmax]
    if not sampled:
        # Every request greedy (the common case): only the argmax comes to the host, read as a list
        # in one call (no numpy view, slicing or decision tables on the path to the next launch).
        if greedy_host is not None:
            argmax = greedy_host.wait().tolist()
        else:
            argmax = host_tensor(greedy if greedy is not None else greedy_ids(logits)).tolist()
        results = []
        start = 0
        for tree, rows in zip(trees, row_widths or [t.width for t in trees], strict=True):
            results.append(greedy_accept(tree, argmax[start : start + tree.width]))
            start += rows
        return results
    widths = [t.width for t in trees]
    row_starts = [0, *itertools.accumulate(row_widths or widths)]
    one_hot = [i for i in sampled if trees[i].draft_probs is None]
    soft = [i for i in sampled if trees[i].draft_probs is not None]
    assert greedy_host is None or not sampled, "a started argmax copy serves greedy requests only"
    parts = [greedy if greedy is not None else greedy_ids(logits)] if greedy_host is None else []
    num_cols = 1
    if one_hot:
        num_cols = max(1, max(len(trees[i].children(n)) for i in one_hot for n in range(widths[i])))
        rows, info = _node_rows(reqs, trees, one_hot, row_starts, logits)
        children = ints_to_device([child_token_table([trees[i] for i in one_hot], num_cols)], logits.device)[0]
        unif = counter_uniforms(info.seeds, info.steps, num_cols, stream=ACCEPT_STREAM)
        decisions = one_hot_decisions(Sampler.warp(logits[rows], info), children.view(-1, num_cols), unif,
                                      info.noise_keys, use_triton)
        parts.append(decisions.flatten())
    if greedy_host is not None:
        host = greedy_host.wait()
    else:
        host = to_host(parts[0] if len(parts) == 1 else torch.cat(parts))
    argmax = host[: logits.shape[0]].tolist()
    decided: dict[int, np.ndarray] = {}
    k = 0
    table = host[logits.shape[0]:].reshape(-1, num_cols + 1)
    for i in one_hot:
        decided[i] = table[k : k + widths[i]]
        k += widths[i]
    probs_of: dict[int, np.ndarray] = {}
    unif_of: dict[int, np.ndarray] = {}
    if soft:
        rows, info = _node_rows(reqs, trees, soft, row_starts, logits)
        probs = to_host(torch.softmax(Sampler.warp(logits[rows], info), dim=-1).double())
        unif_all = to_host(counter_uniforms(info.seeds, info.steps, max_draws, stream=ACCEPT_STREAM))
        k = 0
        for i in soft:
            probs_of[i], unif_of[i] = probs[k : k + widths[i]], unif_all[k : k + widths[i]]
            k += widths[i]
    results = []
    for i, tree in enumerate(trees):
        if i in decided:
            results.append(walk_decisions(tree, decided[i]))
        elif i in probs_of:
            assert tree.draft_probs is not None
            results.append(tree_accept_sampled(tree, probs_of[i], unif_of[i],
                                               tree.draft_probs.double().cpu().numpy()))
        else:
            results.append(greedy_accept(tree, argmax[row_starts[i] : row_starts[i] + tree.width]))
    return results


def _node_rows(reqs: Sequence[Req], trees: list[DraftTree], which: list[int], row_starts: list[int],
               logits: torch.Tensor) -> tuple[torch.Tensor, SamplingBatchInfo]:
    """Logits rows of the nodes of requests ``which`` (tree order) and their sampling info: a node
    at depth d emits the request's token number len(output_ids) + d, which keys its draws."""
    row_idx: list[int] = []
    params, seeds, steps = [], [], []
    for i in which:
        row_idx.extend(range(row_starts[i], row_starts[i] + trees[i].width))
        for d in trees[i].depths():
            params.append(reqs[i].sampling_params)
            seeds.append(reqs[i].seed)
            steps.append(len(reqs[i].output_ids) + d)
    # build() reads only the length of output_ids here (no penalties on speculative rows).
    info = SamplingBatchInfo.build(params, seeds=seeds, output_ids=[range(s) for s in steps],
                                   prompt_ids=[[] for _ in params], eos_token_ids=(),
                                   vocab_size=logits.shape[1], device=logits.device)
    return ints_to_device([row_idx], logits.device)[0], info


def mask_tree_logits(reqs: Sequence[Req], trees: list[DraftTree], logits: torch.Tensor,
                     row_widths: list[int] | None = None) -> torch.Tensor:
    """A copy of a verify batch's logits with every constrained request's node rows masked by its
    grammar: node i's row allows what may follow the root-to-i path (the root's token is accepted
    already). Rows of unconstrained requests and padding rows are left as they are. Each matcher is
    walked and restored (xgrammar's ``traverse_draft_tree``), so it still follows ``output_ids``."""
    from plait.sampling.grammar import allocate_vocab_mask, apply_vocab_mask

    bitmask = allocate_vocab_mask(logits.shape[0], logits.shape[1])
    start = 0
    for req, tree, width in zip(reqs, trees, row_widths or [t.width for t in trees], strict=True):
        if req.grammar is not None:
            first_child, next_sibling = tree_links(tree)
            tokens = torch.tensor(tree.tokens, dtype=torch.int64)
            req.grammar.fill_draft_tree(first_child, next_sibling, tokens, bitmask[start : start + tree.width])
        start += width
    masked = logits.clone(memory_format=torch.contiguous_format)
    apply_vocab_mask(masked, to_device(bitmask, logits.device))
    return masked


def tree_links(tree: DraftTree) -> tuple[torch.Tensor, torch.Tensor]:
    """First-child and next-sibling node index of every node (int64 [w], -1 for none): the layout
    xgrammar's draft-tree walk reads."""
    first_child = [-1] * tree.width
    next_sibling = [-1] * tree.width
    for node in range(tree.width):
        kids = tree.children(node)
        if kids:
            first_child[node] = kids[0]
        for a, b in zip(kids, kids[1:], strict=False):
            next_sibling[a] = b
    return torch.tensor(first_child, dtype=torch.int64), torch.tensor(next_sibling, dtype=torch.int64)
