"""Shared helpers for the Triton attention kernels (page size 1 paged KV cache).

Conventions used by every kernel in this package:
- ``k_buffer`` / ``v_buffer``: one layer's cache, ``[num_slots, num_kv_heads, head_dim]``, last dim contiguous.
- ``req_to_token``: ``[max_reqs, max_context]`` int32, (request row, position) -> slot.
- ``kv_indptr`` ``[bs + 1]`` / ``kv_indices`` ``[>= kv_indptr[bs]]`` int32: CSR list of slots per request.
- Logits are handled in base 2 inside the kernels (``exp2``), with the softmax scale pre-multiplied by
  ``log2(e)``; every LSE that leaves a kernel is in natural-log units.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

LOG2E: float = math.log2(math.e)
LN2: float = math.log(2.0)


def next_pow2(x: int) -> int:
    """Smallest power of two >= x (x >= 1)."""
    return 1 << (max(int(x), 1) - 1).bit_length()


def is_pow2(x: int) -> bool:
    return x > 0 and (x & (x - 1)) == 0


@functools.lru_cache(maxsize=8)
def cuda_capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


@functools.lru_cache(maxsize=8)
def cuda_num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_num_sms(t: torch.Tensor) -> int:
    """Streaming multiprocessors of a CUDA tensor's device (1 on CPU)."""
    if t.device.type != "cuda":
        return 1
    return cuda_num_sms(t.device.index if t.device.index is not None else torch.cuda.current_device())


def device_capability(t: torch.Tensor) -> tuple[int, int] | None:
    """(major, minor) for a CUDA tensor, None on CPU (the Triton interpreter)."""
    if t.device.type != "cuda":
        return None
    return cuda_capability(t.device.index if t.device.index is not None else torch.cuda.current_device())


def dot_precision(dtype: torch.dtype) -> str | None:
    """fp32 inputs are multiplied in full fp32 ("ieee"), never silently in TF32; for half types the
    option does not apply (None: Triton's default)."""
    return "ieee" if dtype == torch.float32 else None


def check_head_dim(name: str, d: int) -> None:
    if not (is_pow2(d) and 16 <= d <= 256):
        raise ValueError(f"{name}={d}: Triton attention kernels need a power-of-two head dim in [16, 256]")


def check_last_dim_contiguous(**tensors: torch.Tensor) -> None:
    for name, t in tensors.items():
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous (stride {t.stride(-1)})")


@dataclass(frozen=True)
class LaunchConfig:
    """Tile sizes and launch options of one kernel.

    ``block_m`` (extend only): query rows per tile. ``pack_gqa`` (extend only): a tile's rows are the
    G query heads of one KV group x block_m // G tokens, so each K/V tile is loaded once per group.
    ``kv_pack`` (decode only): KV heads per program; their K/V rows are read side by side (one
    contiguous row per slot instead of one per head) and their G query heads each are one q tile."""

    block_n: int
    num_warps: int
    num_stages: int
    block_m: int = 0
    pack_gqa: bool = False
    kv_pack: int = 1


@triton.jit
def tanh(x):
    # tanh(x) = 2 * sigmoid(2x) - 1; tl has no tanh that also runs under TRITON_INTERPRET.
    return 2.0 * tl.sigmoid(2.0 * x) - 1.0


@triton.jit
def scale_logits(qk, sm_scale, logit_cap, USE_LOGIT_CAP: tl.constexpr):
    """Raw q.k (fp32) -> logits in base-2 units: ``cap * tanh(qk * scale / cap) * log2(e)`` or
    ``qk * scale * log2(e)``."""
    if USE_LOGIT_CAP:
        qk = logit_cap * tanh(qk * (sm_scale / logit_cap))
        qk = qk * 1.4426950408889634
    else:
        qk = qk * (sm_scale * 1.4426950408889634)
    return qk
