"""The KV side of one scheduler: request-pool rows, KV slots and the radix prefix cache.

``KVCacheManager`` owns the bookkeeping of who holds which slot: admission takes a row and locks the
matched prefix (``admit``), a step reserves and maps slots (``alloc`` / ``map`` / ``free``), and
``release`` hands a request's KV to the prefix cache (or frees it) and returns its row. Invariant:
every slot is either free in the allocator, mapped by a live request's row, reserved in a live
request's decode run, or held by the radix cache; ``tokens_in_use`` counts the slots live requests
hold, reserved ones included (0 when idle).

Decode runs (``decode_run`` > 1): a decode step takes each request's slot from a run of
``decode_run`` consecutive slots reserved for that request (``alloc_decode``), so a request's
decode tokens lie side by side in the pool as its prompt's do, instead of one slot per request per
step interleaved across the batch. A run is refilled when used up and its unused slots are freed
with the request.
"""

from __future__ import annotations

import torch

from plait.mem.pools import ReqToTokenPool, TokenToKVPoolAllocator
from plait.mem.radix_cache import MatchResult, RadixCache
from plait.scheduler.req import Req
from plait.transfer import ints_to_device


class KVCacheManager:
    def __init__(self, req_to_token_pool: ReqToTokenPool, allocator: TokenToKVPoolAllocator,
                 total_tokens: int, disable_radix_cache: bool, device: str, decode_run: int = 1) -> None:
        if decode_run < 1:
            raise ValueError(f"decode_run must be >= 1 (1: no runs), got {decode_run}")
        self.req_to_token_pool = req_to_token_pool
        self.allocator = allocator
        self.tree_cache = RadixCache(allocator, disable=disable_radix_cache, device=device)
        self.total_tokens = total_tokens
        self.device = device
        self.decode_run = decode_run
        if decode_run > 1:
            # runs[row, i]: the i-th slot of the run reserved for the request in pool row ``row``;
            # run_next[row]: the first unused one (decode_run: none left). Owned here.
            self.runs = torch.zeros(req_to_token_pool.size + 1, decode_run, dtype=torch.int64, device=device)
            self.run_next = [decode_run] * (req_to_token_pool.size + 1)

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

    def alloc_decode(self, rows: list[int]) -> torch.Tensor | None:
        """One slot (int64 [len(rows)]) for the next decode token of each request-pool row, from the
        rows' decode runs; None when the pool cannot give one slot per row."""
        run = self.decode_run
        if run == 1:
            return self.alloc(len(rows))
        empty = [r for r in rows if self.run_next[r] == run]
        if empty:
            # Runs come from free slots only: reserving is no reason to evict cached prefixes.
            need = run * len(empty)
            block = self.allocator.alloc(need) if self.allocator.available_size() >= need else None
            empty_t = torch.tensor(empty, device=self.device)
            if block is not None:
                self.runs[empty_t] = block.view(len(empty), run)
                first = 0
            else:  # short of a run each: one slot each this step, as the last slot of a run
                block = self.alloc(len(empty))
                if block is None:
                    return None
                self.runs[empty_t, run - 1] = block
                first = run - 1
            for r in empty:
                self.run_next[r] = first
        cols = [self.run_next[r] for r in rows]
        for r in rows:
            self.run_next[r] += 1
        rows_t, cols_t = ints_to_device([rows, cols], self.device)
        return self.runs[rows_t, cols_t]

    def map(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.req_to_token_pool.scatter(rows, positions, slots)

    def match_prefix(self, ids: list[int]) -> MatchResult:
        return self.tree_cache.match_prefix(ids)

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
        if self.decode_run > 1:
            self.run_next = [self.decode_run] * len(self.run_next)

    def release(self, req: Req) -> None:
        """Hand the request's KV to the prefix cache (or free it) and return its pool row."""
        if req.req_pool_idx is None:
            return
        row = req.req_pool_idx
        if self.decode_run > 1 and self.run_next[row] < self.decode_run:
            # Reserved, never used. A copy: the allocator keeps what it is given until it merges its
            # free list, and this row of the table is refilled by the row's next request.
            self.allocator.free(self.runs[row, self.run_next[row] :].clone())
            self.run_next[row] = self.decode_run
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
