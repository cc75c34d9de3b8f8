"""The KV side of one scheduler: request-pool rows, KV slots and the radix prefix cache.

``KVCacheManager`` owns the bookkeeping of who holds which slot: admission takes a row and locks the
matched prefix (``admit``), a step reserves and maps slots (``alloc`` / ``map`` / ``free``), and
``release`` hands a request's KV to the prefix cache (or frees it) and returns its row. Invariant:
every slot is either free in the allocator, mapped by a live request's row, or held by the radix
cache; ``tokens_in_use`` counts the slots live requests hold (0 when idle).
"""

from __future__ import annotations

import torch

from plait.mem.pools import ReqToTokenPool, TokenToKVPoolAllocator
from plait.mem.radix_cache import MatchResult, RadixCache
from plait.scheduler.req import Req


class KVCacheManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 total_tokens: int, disable_radix_cache: bool, device: str) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = RadixCache(allocator, disable=disable_radix_cache, device=device)
        self.total_tokens = total_tokens
        self.device = device

    def available_tokens(self) -> int:
        """KV slots free now or after evicting the prefix cache."""
        return self.allocator.available_size() + self.tree_cache.evictable_size()

    def tokens_in_use(self) -> int:
        """Slots neither free nor evictable: held by live requests."""
        return self.total_tokens - self.available_tokens()

    def alloc(self, n: int) -> torch.Tensor | None:
        """``n`` slots (int64 [n]), evicting the prefix cache when short; None when the pool cannot."""
        if n == 0:
            return torch.empty(0, dtype=torch.int64, device=self.device)
        if self.allocator.available_size() < n:
            self.tree_cache.evict(n - self.allocator.available_size())
        return self.allocator.alloc(n)

    def free(self, slots: torch.Tensor) -> None:
        self.allocator.free(slots)

    def map(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.req_to_token_pool.scatter(rows, positions, slots)

    def match_prefix(self, ids: list[int]) -> MatchResult:
        return self.tree_cache.match_prefix(ids)

    def cached_prefix_len(self, ids: list[int]) -> int:
        return self.tree_cache.prefix_len(ids)

    def admit(self, req: Req, match: MatchResult) -> bool:
        """Give ``req`` a request-pool row holding the matched prefix, and lock that prefix in the
        cache. False (nothing changed) when no row is free."""
        row = self.req_to_token_pool.alloc()
        if row is None:
            return False
        prefix_len = int(match.kv_indices.numel())
        self.tree_cache.inc_lock_ref(match.last_node)
        req.req_pool_idx = row
        req.last_node = match.last_node
        req.prefix_len = prefix_len
        req.kv_len = prefix_len
        if prefix_len:
            self.req_to_token_pool.write(row, 0, match.kv_indices)
        return True

    def reset(self) -> None:
        """Back to the state of a new manager: an empty prefix cache, every slot and row free in
        their initial order. Only when no request holds anything (``tokens_in_use() == 0``)."""
        if self.tokens_in_use() or self.req_to_token_pool.available_size() != self.req_to_token_pool.size:
            raise RuntimeError(f"KV reset with {self.tokens_in_use()} slots held by live requests")
        self.tree_cache.reset_state()
        self.allocator.clear()
        self.req_to_token_pool.clear()

    def release(self, req: Req) -> None:
        """Hand the request's KV to the prefix cache (or free it) and return its pool row."""
        if req.req_pool_idx is None:
            return
        slots = req.kv_slots(self.req_to_token_pool.req_to_token)
        # A token computed after the request finished (overlap) has KV but no place in fill_ids.
        cached = min(req.kv_len, req.fill_len)
        if self.tree_cache.enabled:
            already = self.tree_cache.insert(req.fill_ids[:cached], slots[:cached])
            # [0, prefix_len) belongs to the tree already (our locked match); [prefix_len, already)
            # duplicates what another request cached meanwhile; the tree took the rest.
            self.allocator.free(slots[req.prefix_len : already])
            self.allocator.free(slots[cached:])
            self.tree_cache.dec_lock_ref(req.last_node)
        else:
            self.allocator.free(slots)
        self.req_to_token_pool.free(req.req_pool_idx)
        req.req_pool_idx = None
        req.last_node = None
