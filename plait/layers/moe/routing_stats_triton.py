"""``RoutedExpertCounter.record`` on CUDA in one Triton launch (see ``routing_stats``).

One program: a register histogram of the call's expert ids (ids outside [0, E) skipped), the number
of experts it hit, and the writes of (tokens, distinct) at ``cursor % capacity`` of the two rings,
then ``cursor + 1``. Device work only, so it records inside CUDA graph replays.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.layers.moe.align import expert_histogram

_COUNT_BLOCK = 1024  # ids per histogram step


@triton.jit(do_not_specialize=["num_ids", "num_tokens"])
def _record_routing_kernel(Ids, Tokens, Distinct, Cursor, num_ids, num_tokens, num_experts, capacity,
                           BLOCK_E: tl.constexpr, COUNT_BLOCK: tl.constexpr):
    counts = expert_histogram(Ids, num_ids, num_experts, BLOCK_E, COUNT_BLOCK)
    distinct = tl.sum((counts > 0).to(tl.int64), axis=0)
    cursor = tl.load(Cursor)
    slot = cursor % capacity
    tl.store(Tokens + slot, num_tokens.to(tl.int64))
    tl.store(Distinct + slot, distinct)
    tl.store(Cursor, cursor + 1)


def record_routing(topk_ids: torch.Tensor, num_experts: int, tokens: torch.Tensor, distinct: torch.Tensor,
                   cursor: torch.Tensor) -> None:
    """Append (T, distinct experts of ``topk_ids`` [T, K]) to the int64 rings ``tokens`` / ``distinct``
    at ``cursor`` (int64 [1]) and advance it."""
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    _record_routing_kernel[(1,)](ids, tokens, distinct, cursor, ids.numel(), topk_ids.shape[0], num_experts,
                                 tokens.numel(), BLOCK_E=triton.next_power_of_2(num_experts),
                                 COUNT_BLOCK=_COUNT_BLOCK, num_warps=4)
