"""Sort the (token, k) pairs of a routing by expert and pad each expert's run to a block.

The grouped GEMMs of ``fused_moe_triton`` work on blocks of ``block_m`` rows that all belong to one
expert. ``moe_align_block_size`` lays the flattened pairs (pair ``p = t * K + k``) out so that:

- ``sorted_token_ids`` [max_padded] int32: expert 0's pairs, padded with the sentinel ``T * K`` up to a
  multiple of ``block_m``, then expert 1's, ...; after the last expert's run (at
  ``num_tokens_post_padded``) the sentinel fills the rest. The order of the pairs inside one expert's
  run is unspecified (atomics place them); every GEMM row is computed independently of its
  neighbours, so the results do not depend on it.
- ``expert_ids`` [max_padded // block_m] int32: the expert of each block; ``num_experts`` for the blocks
  past ``num_tokens_post_padded``.
- ``num_tokens_post_padded`` [1] int32: the padded total, a tensor, so nothing is read on the host.

Pairs whose expert id is outside [0, E) (experts another expert-parallel rank holds) are dropped: they
appear in no block. All sizes depend only on T, K, E and ``block_m`` (never on the routing), and
nothing is read back on the host, so the function runs inside CUDA graph capture. Two launches: one
program counts the pairs per expert (register histograms), scans the padded counts and writes the
block table and the sentinel fill; then a grid places each pair with an atomic cursor per expert.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.layers.pdl import pdl_prologue, use_pdl

_COUNT_BLOCK = 1024  # pairs per histogram step
_FILL_BLOCK = 1024
_SCATTER_BLOCK = 256  # pairs per scatter program


def max_padded_size(num_pairs: int, num_experts: int, block_m: int) -> int:
    """The most rows the aligned layout can need: every pair, plus up to ``block_m - 1`` padding rows
    for each expert that receives a pair (at most ``min(E, T*K)`` of them), rounded to a block."""
    padded = num_pairs + min(num_experts, num_pairs) * (block_m - 1)
    return (padded + block_m - 1) // block_m * block_m


@triton.jit
def expert_histogram(topk_ids, num_pairs, num_experts, BLOCK_E: tl.constexpr, COUNT_BLOCK: tl.constexpr):
    """[BLOCK_E] int32: how many of the ``num_pairs`` ids at ``topk_ids`` name each expert (ids
    outside [0, num_experts) are not counted), accumulated in registers COUNT_BLOCK ids a step."""
    counts = tl.zeros((BLOCK_E,), dtype=tl.int32)
    for start in range(0, num_pairs, COUNT_BLOCK):
        offs = start + tl.arange(0, COUNT_BLOCK)
        ids = tl.load(topk_ids + offs, mask=offs < num_pairs, other=-1)
        valid = (ids >= 0) & (ids < num_experts)
        counts += tl.histogram(tl.where(valid, ids, 0).to(tl.int32), BLOCK_E, mask=valid)
    return counts


@triton.jit(do_not_specialize=["num_pairs", "max_padded", "max_blocks"])
def _align_scan_kernel(topk_ids, sorted_token_ids, expert_ids, num_tokens_post_padded, cursor,
                       num_pairs, num_experts, max_padded, max_blocks,
                       BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, COUNT_BLOCK: tl.constexpr,
                       FILL_BLOCK: tl.constexpr, BLOCK_B: tl.constexpr, USE_PDL: tl.constexpr = False):
    """One program: per-expert counts, padded offsets (into ``cursor``, the scatter's start positions),
    the padded total, the sentinel fill of ``sorted_token_ids`` and the block -> expert table."""
    pdl_prologue(USE_PDL)
    e_range = tl.arange(0, BLOCK_E)
    e_valid = e_range < num_experts
    counts = expert_histogram(topk_ids, num_pairs, num_experts, BLOCK_E, COUNT_BLOCK)
    padded = tl.where(e_valid, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    end = tl.cumsum(padded, 0)
    tl.store(cursor + e_range, end - padded, mask=e_valid)
    tl.store(num_tokens_post_padded, tl.sum(padded, 0))
    for start in range(0, max_padded, FILL_BLOCK):
        offs = start + tl.arange(0, FILL_BLOCK)
        tl.store(sorted_token_ids + offs, tl.full((FILL_BLOCK,), 0, tl.int32) + num_pairs, mask=offs < max_padded)
    # Block b belongs to the number of experts whose padded run ends at or before row b * BLOCK_M.
    for start in range(0, max_blocks, BLOCK_B):
        blocks = start + tl.arange(0, BLOCK_B)
        ends_before = (end[None, :] <= blocks[:, None] * BLOCK_M) & e_valid[None, :]
        tl.store(expert_ids + blocks, tl.sum(ends_before.to(tl.int32), axis=1), mask=blocks < max_blocks)


@triton.jit(do_not_specialize=["num_pairs"])
def _align_scatter_kernel(topk_ids, sorted_token_ids, cursor, num_pairs, num_experts, BLOCK: tl.constexpr,
                          USE_PDL: tl.constexpr = False):
    """Each valid pair takes the next free row of its expert's run."""
    pdl_prologue(USE_PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    in_range = offs < num_pairs
    ids = tl.load(topk_ids + offs, mask=in_range, other=-1)
    valid = in_range & (ids >= 0) & (ids < num_experts)
    rows = tl.atomic_add(cursor + tl.where(valid, ids, 0), 1, mask=valid)
    tl.store(sorted_token_ids + rows, offs.to(tl.int32), mask=valid)


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int,
                         num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[T, K] expert ids (int32/int64) -> (sorted_token_ids, expert_ids, num_tokens_post_padded);
    see the module doc."""
    if block_m <= 0:
        raise ValueError(f"block_m must be positive, got {block_m}")
    if num_experts <= 0:
        raise ValueError(f"num_experts must be positive, got {num_experts}")
    device = topk_ids.device
    ids = topk_ids.reshape(-1)
    if not ids.is_contiguous():
        ids = ids.contiguous()
    num_pairs = ids.numel()
    max_padded = max_padded_size(num_pairs, num_experts, block_m)
    max_blocks = max_padded // block_m
    sorted_ids = torch.empty(max_padded, dtype=torch.int32, device=device)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=device)
    num_post_padded = torch.empty(1, dtype=torch.int32, device=device)
    cursor = torch.empty(num_experts, dtype=torch.int32, device=device)
    block_e = triton.next_power_of_2(num_experts)
    pdl = use_pdl(ids)
    _align_scan_kernel[(1,)](ids, sorted_ids, expert_ids, num_post_padded, cursor, num_pairs, num_experts,
                             max_padded, max_blocks, BLOCK_M=block_m, BLOCK_E=block_e, COUNT_BLOCK=_COUNT_BLOCK,
                             FILL_BLOCK=_FILL_BLOCK, BLOCK_B=max(16, 4096 // block_e), USE_PDL=pdl, num_warps=8,
                             launch_pdl=pdl)
    if num_pairs:
        _align_scatter_kernel[(triton.cdiv(num_pairs, _SCATTER_BLOCK),)](
            ids, sorted_ids, cursor, num_pairs, num_experts, BLOCK=_SCATTER_BLOCK, USE_PDL=pdl, launch_pdl=pdl)
    return sorted_ids, expert_ids, num_post_padded
