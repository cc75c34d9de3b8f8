"""Radix prefix cache over token ids (page size 1), in the style of SGLang's RadixCache.

The tree maps token-id prefixes to the KV-pool slots that hold their keys/values, so a new
request whose prompt shares a prefix with earlier traffic can reuse those slots instead of
recomputing them. Each edge (node) carries a run of tokens and the matching run of slots.

Ownership model:
  * Slots stored in the tree belong to the tree. They go back to the allocator only through
    ``evict`` or ``reset``, via ``allocator.free``.
  * A request that uses a matched prefix locks ``MatchResult.last_node`` (``inc_lock_ref``) for as
    long as it reads those slots, and unlocks it (``dec_lock_ref``) when done. Locked nodes (and all
    their ancestors, since a prefix is only usable with everything before it) are never evicted.
  * ``evictable_size`` counts slots in unlocked nodes, ``protected_size`` those in locked nodes;
    their sum is every slot the tree holds (``total_size``).

LRU uses a monotonic counter rather than wall-clock time so that eviction order is deterministic
(ties, which only arise between nodes touched by the same call, break on node creation order).
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

__all__ = ["MatchResult", "RadixCache", "SlotFreer", "TreeNode"]


class SlotFreer(Protocol):
    """The part of the KV slot allocator the cache needs: returning slots."""

    def free(self, indices: torch.Tensor) -> None:
        """Return KV slots (int64 1-D tensor) to the allocator."""
        ...


# Node ids come from a process-wide counter so they are unique across caches and resets; they are
# the deterministic tie-breaker for LRU and make pretty_print output stable.
_node_ids = itertools.count()


class TreeNode:
    """One edge of the radix tree: a run of tokens (``key``) and their KV slots (``value``)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access", "id")

    def __init__(
        self,
        key: tuple[int, ...],
        value: torch.Tensor,
        parent: TreeNode | None,
        last_access: int,
    ) -> None:
        # Children keyed by their first token: with page size 1 siblings always differ there.
        self.children: dict[int, TreeNode] = {}
        self.parent = parent
        self.key = key
        self.value = value
        # Number of outstanding locks on this node or any descendant (inc_lock_ref walks upward).
        self.lock_ref = 0
        self.last_access = last_access
        self.id = next(_node_ids)

    @property
    def is_leaf(self) -> bool:
        return not self.children

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        return f"TreeNode(id={self.id}, len={len(self.key)}, lock_ref={self.lock_ref})"


@dataclass
class MatchResult:
    """Result of ``RadixCache.match_prefix``."""

    # int64 [n] slots of the matched prefix (an empty tensor when nothing matched). A fresh tensor:
    # the caller may keep or modify it without affecting the tree.
    kv_indices: torch.Tensor
    # Deepest matched node (the root when nothing matched). Lock it while the request uses the prefix.
    last_node: TreeNode


def _as_key(token_ids: Sequence[int]) -> tuple[int, ...]:
    # Plain ints so children dict lookups hash by value (a 0-d tensor would hash by identity).
    if isinstance(token_ids, (list, tuple)):
        return tuple(token_ids)
    return tuple(int(t) for t in token_ids)


def common_prefix_len(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens ``a`` and ``b`` share (same-typed sequences: tuples, or lists)."""
    n = min(len(a), len(b))
    if a[:n] == b[:n]:  # the common case (a whole node matches): one C-level comparison
        return n
    i = 0
    while a[i] == b[i]:  # stops before n: the spans differ
        i += 1
    return i


class RadixCache:
    """Radix tree from token-id prefixes to KV slot indices, with LRU eviction and ref locking."""

    def __init__(
        self, allocator: SlotFreer, disable: bool = False, device: torch.device | str = "cpu"
    ) -> None:
        self.allocator = allocator
        self.disable = disable
        self.device = torch.device(device)
        self._clock = 0
        self.reset_state()

    # ------------------------------------------------------------------ state

    def reset_state(self) -> None:
        """Start from an empty tree WITHOUT freeing anything (use ``reset`` to free slots)."""
        self.root = TreeNode((), self._empty(), None, self._clock)
        self._evictable_size = 0
        self._protected_size = 0

    def _empty(self) -> torch.Tensor:
        return torch.empty(0, dtype=torch.int64, device=self.device)

    def _tick(self) -> int:
        self._clock += 1
        return self._clock

    @property
    def enabled(self) -> bool:
        """False when constructed with ``disable=True``: the cache then never matches or stores."""
        return not self.disable

    # ------------------------------------------------------------------ lookup / insert

    def match_prefix(self, token_ids: Sequence[int]) -> MatchResult:
        """Longest cached prefix of ``token_ids``.

        When the match ends inside a node, that node is split so that ``last_node`` covers exactly
        the matched tokens (and can be locked without protecting the unmatched tail). Every node on
        the matched path has its LRU access time refreshed.
        """
        if self.disable or len(token_ids) == 0:
            return MatchResult(self._empty(), self.root)
        values: list[torch.Tensor] = []
        node, _ = self._descend(_as_key(token_ids), self._tick(), values)
        kv = torch.cat(values) if values else self._empty()
        return MatchResult(kv, node)

    def _descend(self, key: tuple[int, ...], now: int, values: list[torch.Tensor] | None = None
                 ) -> tuple[TreeNode, int]:
        """Walk from the root along ``key``, splitting the last node met where the match ends inside it,
        refreshing every node on the path to ``now`` (and appending their slots to ``values``).
        Returns the deepest node matched and how many tokens of ``key`` it covers."""
        node = self.root
        node.last_access = now
        pos, n = 0, len(key)
        while pos < n:
            child = node.children.get(key[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, key[pos : pos + len(child.key)])
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            if values is not None:
                values.append(child.value)
            node = child
            pos += k
            # After a split the next token differs from node's only child, so the loop ends.
        return node, pos

    def prefix_len(self, token_ids: list[int]) -> int:
        """How many leading tokens of ``token_ids`` (plain ints) are cached: ``match_prefix``'s length
        without its side effects (no split, no LRU refresh), for ordering requests that may not run
        yet. The list is read in place: only the matched span is copied, never the whole prompt."""
        if self.disable or not token_ids:
            return 0
        node, pos, n = self.root, 0, len(token_ids)
        while pos < n:
            child = node.children.get(token_ids[pos])
            if child is None:
                break
            k = common_prefix_len(child.key, tuple(token_ids[pos : pos + len(child.key)]))
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    def insert(self, token_ids: Sequence[int], kv_indices: torch.Tensor) -> int:
        """Insert the whole sequence ``token_ids`` whose KV lives in slots ``kv_indices``.

        Returns how many leading tokens were ALREADY in the tree. For those positions the tree keeps
        its own slots and ignores ``kv_indices[:returned]``; the tree takes ownership of
        ``kv_indices[returned:]`` (stored as a copy). Any slot in ``kv_indices[:returned]`` that the
        caller allocated itself is a duplicate the caller must free; slots it got from
        ``match_prefix`` ARE the tree's slots and must not be freed (SGLang frees
        ``kv_indices[len(prefix_indices):returned]``).

        When the cache is disabled nothing is stored and 0 is returned: the caller still owns, and
        must free, every slot in ``kv_indices``.
        """
        if len(kv_indices) != len(token_ids):
            raise ValueError(f"insert: {len(token_ids)} tokens but {len(kv_indices)} kv indices")
        if self.disable or len(token_ids) == 0:
            return 0
        key = _as_key(token_ids)
        now = self._tick()
        node, pos = self._descend(key, now)
        if pos < len(key):
            # Clone so later writes into the caller's buffer (e.g. a req_to_token row) cannot alter
            # slots the tree owns.
            value = kv_indices[pos:].to(device=self.device, dtype=torch.int64).clone()
            leaf = TreeNode(key[pos:], value, node, now)
            node.children[key[pos]] = leaf
            # A new leaf starts unlocked even under a locked parent: nobody is using it yet.
            self._evictable_size += len(leaf)
        return pos

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split ``child`` after its first ``k`` tokens; returns the new upper node.

        Sizes do not change (same slots, different grouping). The upper node inherits the child's
        lock_ref because every lock counted on the child also covers all of its ancestors.
        """
        assert 0 < k < len(child.key)
        parent = child.parent
        assert parent is not None
        upper = TreeNode(child.key[:k], child.value[:k], parent, child.last_access)
        upper.lock_ref = child.lock_ref
        upper.children[child.key[k]] = child
        parent.children[child.key[0]] = upper
        child.key = child.key[k:]
        child.value = child.value[k:]
        child.parent = upper
        return upper

    # ------------------------------------------------------------------ locking

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Lock ``node`` and all its ancestors so none of them can be evicted."""
        if self.disable:
            return
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable_size -= len(node)
                self._protected_size += len(node)
            node.lock_ref += 1
            assert node.parent is not None, "locking a node that is no longer in the tree"
            node = node.parent

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one ``inc_lock_ref(node)``."""
        if self.disable:
            return
        while node is not self.root:
            if node.lock_ref <= 0:
                raise RuntimeError(f"dec_lock_ref on unlocked node {node!r}")
            if node.lock_ref == 1:
                self._evictable_size += len(node)
                self._protected_size -= len(node)
            node.lock_ref -= 1
            assert node.parent is not None, "unlocking a node that is no longer in the tree"
            node = node.parent

    # ------------------------------------------------------------------ eviction

    def evict(self, num_tokens: int) -> int:
        """Free unlocked leaves, least recently used first, until ``num_tokens`` slots are freed.

        Whole nodes are evicted, so more than ``num_tokens`` may be freed. A parent that becomes an
        unlocked leaf joins the candidates. Returns the number of slots freed (less than requested
        only when nothing evictable is left).
        """
        if self.disable or num_tokens <= 0:
            return 0
        # (last_access, id) gives a total, deterministic order.
        heap = [(n.last_access, n.id, n) for n in self._leaves() if n.lock_ref == 0]
        heapq.heapify(heap)
        freed: list[torch.Tensor] = []
        num_freed = 0
        while num_freed < num_tokens and heap:
            _, _, node = heapq.heappop(heap)
            freed.append(node.value)
            num_freed += len(node)
            self._evictable_size -= len(node)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key[0]]
            node.parent = None
            if parent is not self.root and parent.is_leaf and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.id, parent))
        if freed:
            # One free call per evict: allocators typically concatenate into a free list.
            self.allocator.free(torch.cat(freed))
        return num_freed

    def _leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if n.is_leaf and n is not self.root]

    def _nodes(self) -> Iterator[TreeNode]:
        stack = [self.root]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # ------------------------------------------------------------------ sizes

    def evictable_size(self) -> int:
        """Slots held by unlocked nodes."""
        return self._evictable_size

    def protected_size(self) -> int:
        """Slots held by locked nodes."""
        return self._protected_size

    def total_size(self) -> int:
        """Slots held by the tree, counted by walking it (O(nodes); for checks and debugging).

        Always equals ``evictable_size() + protected_size()``, which is the O(1) way to get it.
        """
        return sum(len(n) for n in self._nodes())

    # ------------------------------------------------------------------ reset / debug

    def reset(self) -> None:
        """Drop the whole tree, freeing every slot it holds. Raises if any node is locked."""
        # Check before freeing anything so a failed reset leaves the cache intact.
        locked = [n for n in self._nodes() if n is not self.root and n.lock_ref > 0]
        if locked:
            raise RuntimeError(f"reset with {len(locked)} locked node(s), e.g. {locked[0]!r}")
        values = [n.value for n in self._nodes() if n is not self.root and len(n) > 0]
        if values:
            self.allocator.free(torch.cat(values))
        self.reset_state()

    def pretty_print(self) -> str:
        """Indented dump of the tree: tokens (truncated), slots, lock_ref and access time."""
        lines = [
            f"RadixCache(enabled={self.enabled}, evictable={self._evictable_size}, "
            f"protected={self._protected_size})"
        ]
        # Iterative DFS (children in token order) so deep chains cannot hit the recursion limit.
        stack = [(self.root.children[t], 1) for t in sorted(self.root.children, reverse=True)]
        while stack:
            node, depth = stack.pop()
            toks = list(node.key[:8])
            more = "..." if len(node.key) > 8 else ""
            slots = node.value[:8].tolist()
            lines.append(
                f"{'  ' * depth}- #{node.id} len={len(node)} tokens={toks}{more} "
                f"slots={slots}{more} lock={node.lock_ref} t={node.last_access}"
            )
            stack.extend((node.children[t], depth + 1) for t in sorted(node.children, reverse=True))
        return "\n".join(lines)
