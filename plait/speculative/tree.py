"""Draft trees: node 0 is the root (the request's last accepted token, whose KV is not written yet);
every other node is a guessed token whose parent comes earlier in the node order.

A chain is the tree where node i's parent is i - 1. Verification runs every node in one
TARGET_VERIFY forward: node i sits at position ``prefix_len + depth(i)`` and attends to the whole
prefix and to its own ancestors (itself included), which is the custom mask built here in the layout
``plait.attention.base.custom_mask_of`` reads: per request a row-major ``[w, prefix_len + w]`` bool
block, blocks concatenated in request order.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import numpy as np
import torch

from plait.transfer import to_device


@dataclass
class DraftTree:
    tokens: list[int]  # node -> token id; tokens[0] is the root
    parents: list[int]  # node -> parent node; parents[0] == -1
    # Draft probability of each node's token under its parent's draft distribution, for sampled
    # chains from a draft model (None: the draft is deterministic, i.e. one-hot).
    draft_probs: torch.Tensor | None = None  # [w, V]: row i is the distribution node i was drawn from
    _children: list[list[int]] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if len(self.tokens) != len(self.parents) or not self.tokens or self.parents[0] != -1:
            raise ValueError("a draft tree needs a root (parent -1) and one parent per node")
        for i, p in enumerate(self.parents[1:], start=1):
            if not 0 <= p < i:
                raise ValueError(f"node {i} has parent {p}: parents must come earlier in the node order")

    @classmethod
    def chain(cls, root: int, guesses: list[int]) -> DraftTree:
        return cls([root, *guesses], [-1, *range(len(guesses))])

    @property
    def is_chain(self) -> bool:
        """Whether node i's parent is i - 1 for every node (one guess per level)."""
        return _is_chain(tuple(self.parents))

    @property
    def width(self) -> int:
        """Tokens verified for this request (root included): its ``num_tokens_per_req``."""
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        if self._children is None:
            kids: list[list[int]] = [[] for _ in self.tokens]
            for i, p in enumerate(self.parents[1:], start=1):
                kids[p].append(i)
            self._children = kids
        return self._children[node]

    def depths(self) -> list[int]:
        return list(depths_of(tuple(self.parents)))

    def truncated(self, max_depth: int) -> DraftTree:
        """The nodes at most ``max_depth`` below the root. Node order is breadth first (n-gram and
        level trees are grown so), which makes them a prefix of the nodes."""
        if max_depth >= self.width - 1:  # no node is deeper than the node count below the root
            return self
        depths = depths_of(tuple(self.parents))
        keep = sum(1 for d in depths if d <= max_depth)
        if keep == self.width:
            return self
        if any(d > max_depth for d in depths[:keep]):
            raise ValueError("truncated() needs a tree whose nodes are in breadth-first order")
        probs = None if self.draft_probs is None else self.draft_probs[:keep]
        return DraftTree(self.tokens[:keep], self.parents[:keep], probs)

    def ancestor_mask(self) -> torch.Tensor:
        """bool [w, w]: row i is True at i and at every ancestor of i."""
        return torch.from_numpy(_ancestor_mask(tuple(self.parents)).copy())

    def path_tokens(self, path: list[int]) -> list[int]:
        return [self.tokens[n] for n in path]


@functools.lru_cache(maxsize=1024)
def _is_chain(parents: tuple[int, ...]) -> bool:
    return all(p == i - 1 for i, p in enumerate(parents))


@functools.lru_cache(maxsize=1024)
def depths_of(parents: tuple[int, ...]) -> tuple[int, ...]:
    """Each node's depth below the root, for a tree shape (a step's trees share a few shapes)."""
    d = [0] * len(parents)
    for i in range(1, len(parents)):
        d[i] = d[parents[i]] + 1
    return tuple(d)


@functools.lru_cache(maxsize=1024)
def _ancestor_mask(parents: tuple[int, ...]) -> np.ndarray:
    """The ancestor mask of a tree shape (read-only; a step's trees share a few shapes)."""
    w = len(parents)
    m = np.zeros((w, w), dtype=np.bool_)
    for i in range(w):
        m[i, i] = True
        if i:
            m[i] |= m[parents[i]]
    m.flags.writeable = False
    return m


def verify_mask_size(widths: list[int], prefix_lens: list[int]) -> int:
    """Entries of the flattened custom mask of a TARGET_VERIFY batch."""
    return sum(w * (pre + w) for w, pre in zip(widths, prefix_lens, strict=True))


def fill_verify_mask(flat: np.ndarray, shapes: list[tuple[int, ...]], prefix_lens: list[int]) -> None:
    """Write the flattened custom mask of trees with parents ``shapes`` into ``flat`` (bool,
    ``verify_mask_size`` entries): every prefix column True, the node columns the ancestor mask."""
    flat[:] = True
    start = 0
    for parents, pre in zip(shapes, prefix_lens, strict=True):
        w = len(parents)
        size = w * (pre + w)
        if w > 1:  # a root-only block is all True
            flat[start : start + size].reshape(w, pre + w)[:, pre:] = _ancestor_mask(parents)
        start += size


def build_verify_mask(trees: list[DraftTree], prefix_lens: list[int], device: torch.device | str) -> torch.Tensor:
    """The flattened custom mask of a TARGET_VERIFY batch (see the module docstring)."""
    flat = np.empty(verify_mask_size([t.width for t in trees], prefix_lens), dtype=np.bool_)
    fill_verify_mask(flat, [tuple(t.parents) for t in trees], prefix_lens)
    return to_device(torch.from_numpy(flat), device)  # pinned, asynchronous: no wait for the GPU queue


def build_verify_mask_from_ancestors(ancestors: torch.Tensor, prefix_lens: list[int]) -> torch.Tensor:
    """``build_verify_mask`` for trees of one width whose ancestor matrices are on the device
    (``[bs, w, w]`` bool): the same layout, built there (no read of the device tensors)."""
    bs, w, _ = ancestors.shape
    sizes = [w * (pre + w) for pre in prefix_lens]
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    pre = np.asarray(prefix_lens, dtype=np.int64)[:, None, None]
    rows = np.arange(w)[None, :, None]
    cols = np.arange(w)[None, None, :]
    where = starts[:, None, None] + rows * (pre + w) + pre + cols  # entry (b, i, j) of the w x w parts
    flat = torch.ones(sum(sizes), dtype=torch.bool, device=ancestors.device)
    flat[to_device(torch.from_numpy(where.reshape(-1)), ancestors.device)] = ancestors.reshape(-1)
    return flat


def node_mask_positions(prefix_lens: torch.Tensor, width: int) -> torch.Tensor:
    """Where the node region of each request's block lies in the flat custom mask of a batch whose
    requests all have ``width`` nodes: int64 ``[bs * width * width]``, entry (b, i, j) of the node
    region at ``start_b + i * (prefix_b + width) + prefix_b + j``. Device ops only, every shape a
    function of (bs, width): a graph records it and reads ``prefix_lens`` (int64 ``[bs]``) per replay."""
    device = prefix_lens.device
    row = prefix_lens + width  # a block's row length
    sizes = row * width
    starts = torch.cumsum(sizes, 0) - sizes
    i = torch.arange(width, device=device)[None, :, None]
    j = torch.arange(width, device=device)[None, None, :]
    where = (starts + prefix_lens)[:, None, None] + i * row[:, None, None] + j
    return where.reshape(-1)
