"""Writing new tokens' K/V into their cache slots."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2


@triton.jit
def _store_kv_kernel(
    K_Buffer,  # [num_slots, H, D]
    V_Buffer,  # [num_slots, H, DV]
    Loc,  # [T] slots
    K,  # [T, H, D]
    V,  # [T, H, DV]
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    inv_k_scale,
    inv_v_scale,
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    FP8_MAX: tl.constexpr,  # > 0: the buffers are FP8, values are divided by their scale and saturated
):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(Loc + t).to(tl.int64)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    mask_k = (offs_h[:, None] < H) & (offs_d[None, :] < D)
    mask_v = (offs_h[:, None] < H) & (offs_dv[None, :] < DV)
    k = tl.load(K + t * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask_k)
    v = tl.load(V + t * stride_vt + offs_h[:, None] * stride_vh + offs_dv[None, :], mask=mask_v)
    if FP8_MAX > 0:
        k = tl.clamp(k.to(tl.float32) * inv_k_scale, -FP8_MAX, FP8_MAX)
        v = tl.clamp(v.to(tl.float32) * inv_v_scale, -FP8_MAX, FP8_MAX)
    k_dst = K_Buffer + slot * stride_kbs + offs_h[:, None] * stride_kbh + offs_d[None, :]
    v_dst = V_Buffer + slot * stride_vbs + offs_h[:, None] * stride_vbh + offs_dv[None, :]
    tl.store(k_dst, k.to(K_Buffer.dtype.element_ty), mask=mask_k)
    tl.store(v_dst, v.to(V_Buffer.dtype.element_ty), mask=mask_v)


def store_kv(
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    loc: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """``k_buffer[loc] = k; v_buffer[loc] = v`` in one launch (one program per token).

    FP8 buffers (an FP8 KV cache) store ``k / k_scale`` and ``v / v_scale``, saturated to the format's
    largest finite value.

    k_buffer/v_buffer ``[num_slots, H, D/Dv]``; loc ``[T]`` int slots (distinct); k/v ``[T, H, D/Dv]``
    (any token/head strides, e.g. views into a fused qkv; last dim contiguous). Values are cast to
    the buffer dtype.
    """
    num_tokens = loc.shape[0]
    if num_tokens == 0:
        return
    num_heads, head_dim = k.shape[1], k.shape[2]
    head_dim_v = v.shape[2]
    for name, t in (("k", k), ("v", v), ("k_buffer", k_buffer), ("v_buffer", v_buffer)):
        if t.stride(-1) != 1:
            raise ValueError(f"{name}: last dim must be contiguous")
    if k.shape[0] != num_tokens or v.shape[0] != num_tokens:
        raise ValueError(f"loc has {num_tokens} tokens, k {k.shape[0]}, v {v.shape[0]}")
    elems = num_heads * max(head_dim, head_dim_v)
    _store_kv_kernel[(num_tokens,)](
        k_buffer,
        v_buffer,
        loc,
        k,
        v,
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        1.0 / k_scale,
        1.0 / v_scale,
        H=num_heads,
        BLOCK_H=next_pow2(num_heads),
        D=head_dim,
        BLOCK_D=next_pow2(head_dim),
        DV=head_dim_v,
        BLOCK_DV=next_pow2(head_dim_v),
        FP8_MAX=float(torch.finfo(k_buffer.dtype).max) if k_buffer.element_size() == 1 else 0.0,
        num_warps=4 if elems >= 1024 else 1,
    )
