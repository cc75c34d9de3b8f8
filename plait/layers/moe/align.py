"""Sort the (token, k) pairs of a routing by expert and pad each expert's run to a block.

The grouped GEMMs of ``fused_moe_triton`` work on blocks of ``block_m`` rows that all belong to one
expert. ``moe_align_block_size`` lays the flattened pairs (pair ``p = t * K + k``) out so that:

- ``sorted_token_ids`` [max_padded] int32: expert 0's pairs, padded with the sentinel ``T * K`` up to a
  multiple of ``block_m``, then expert 1's, ...; after the last expert's run (at
  ``num_tokens_post_padded``) the sentinel fills the rest. Within an expert, pairs keep their order.
- ``expert_ids`` [max_padded // block_m] int32: the expert of each block; ``num_experts`` for the blocks
  past ``num_tokens_post_padded``.
- ``num_tokens_post_padded`` [1] int32: the padded total, a tensor, so nothing is read on the host.

Pairs whose expert id is outside [0, E) (experts another expert-parallel rank holds) are dropped: they
appear in no block. All sizes depend only on T, K, E and ``block_m`` (never on the routing), and the
work is torch ops with no host synchronisation, so the function runs inside CUDA graph capture.
"""

from __future__ import annotations

import torch


def max_padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the aligned layout can need: every pair, plus up to ``block_m - 1`` padding rows
    for each expert that receives a pair (at most ``min(E, T*K)`` of them), rounded to a block."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (padded + block_m - 1) // block_m * block_m


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, K] expert ids -> (sorted_token_ids, expert_ids, num_tokens_post_padded); see the module doc."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    device = topk_ids.device
    flat = topk_ids.reshape(-1).to(torch.int64)
    num_pairs = flat.numel()
    max_padded = max_padded_size(num_pairs, num_experts, block_m)
    # Out-of-range ids go to an extra bucket E that is counted but never laid out.
    key = torch.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    counts = torch.zeros(num_experts + 1, dtype=torch.int64, device=device)
    counts.scatter_add_(0, key, torch.ones_like(key))
    padded_counts = (counts[:num_experts] + block_m - 1) // block_m * block_m
    padded_end = padded_counts.cumsum(0)  # [E]: where each expert's padded run ends
    padded_start = padded_end - padded_counts
    # A stable sort by expert keeps each expert's pairs in token order; a pair's rank inside its
    # expert is its sorted position minus the number of pairs of lower experts.
    sorted_key, order = torch.sort(key, stable=True)
    lower = counts.cumsum(0) - counts
    rank = torch.arange(num_pairs, device=device) - lower[sorted_key]
    # Dropped pairs all land on one scratch row past the end.
    start_or_scratch = torch.cat([padded_start, torch.full((1,), max_padded, dtype=torch.int64, device=device)])
    dest = torch.where(sorted_key < num_experts, start_or_scratch[sorted_key] + rank, max_padded)
    sorted_ids = torch.full((max_padded + 1,), num_pairs, dtype=torch.int32, device=device)
    sorted_ids.scatter_(0, dest, order.to(torch.int32))
    block_starts = torch.arange(0, max_padded, block_m, device=device)
    expert_ids = torch.searchsorted(padded_end, block_starts, right=True).to(torch.int32)
    num_post_padded = padded_end[-1:].to(torch.int32)
    return sorted_ids[:max_padded], expert_ids, num_post_padded
