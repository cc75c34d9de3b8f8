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
    H: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_DV: tl.constexpr,
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
) -> None:
    """``k_buffer[loc] = k; v_buffer[loc] = v`` in one launch (one program per token).

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
        H=num_heads,
        BLOCK_H=next_pow2(num_heads),
        D=head_dim,
        BLOCK_D=next_pow2(head_dim),
        DV=head_dim_v,
        BLOCK_DV=next_pow2(head_dim_v),
        num_warps=4 if elems >= 1024 else 1,
    )
