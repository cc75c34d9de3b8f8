"""Qwen3's per-head RMSNorm of q and k in one launch (``Qwen3Attention.qk_transform`` on the GPU).

Two ``RMSNorm`` calls are two launches per layer, at decode batch sizes each costing more than its
few kilobytes. ``qk_rmsnorm`` normalises every head of q with ``q_weight`` and every head of k with
``k_weight``: one program per token reads its q and k heads straight from their rows (the slices of
the fused QKV projection's output: any row stride, heads contiguous inside a row) and writes two
contiguous outputs. The arithmetic is ``triton_ops.rmsnorm``'s: the mean of squares in fp32, the
normalised value rounded to the input dtype, then multiplied by the weight.

The engine now runs this norm inside the rotary kernel (``triton_ops.rotary_`` with a
``rotary.QKNorm``: one launch normalises, rotates and stores K/V); this standalone launch is the
two-kernel form that fused one is checked against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.layers.pdl import pdl_prologue, use_pdl


@triton.jit
def _head_rmsnorm(src, dst, w_ptr, n_heads, eps, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """Normalise ``n_heads`` heads of HEAD_DIM values at ``src`` (contiguous) into ``dst``."""
    d = tl.arange(0, BLOCK_D)
    heads = tl.arange(0, BLOCK_H)
    mask = (heads[:, None] < n_heads) & (d[None, :] < HEAD_DIM)
    offs = heads[:, None] * HEAD_DIM + d[None, :]
    x = tl.load(src + offs, mask=mask, other=0.0)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=1) / HEAD_DIM
    normed = (xf * tl.rsqrt(var + eps)[:, None]).to(x.dtype)
    w = tl.load(w_ptr + d, mask=d < HEAD_DIM, other=0.0)
    tl.store(dst + offs, w[None, :] * normed, mask=mask)


@triton.jit
def _qk_rmsnorm_kernel(Q, K, WQ, WK, QO, KO, stride_q, stride_k, n_q_heads, n_k_heads, eps,
                       HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HQ: tl.constexpr,
                       BLOCK_HK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    _head_rmsnorm(Q + t * stride_q, QO + t * n_q_heads * HEAD_DIM, WQ, n_q_heads, eps, HEAD_DIM, BLOCK_D, BLOCK_HQ)
    _head_rmsnorm(K + t * stride_k, KO + t * n_k_heads * HEAD_DIM, WK, n_k_heads, eps, HEAD_DIM, BLOCK_D, BLOCK_HK)


def qk_rmsnorm(q: torch.Tensor, k: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor,
               eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq * D], k [T, Hk * D] (rows may be strided, each row contiguous) -> the per-head
    normalised q and k, contiguous, same shapes and dtype; D = ``q_weight.numel()``."""
    head_dim = q_weight.numel()
    if k_weight.numel() != head_dim or q.dim() != 2 or k.dim() != 2 or q.shape[0] != k.shape[0]:
        raise ValueError(f"qk_rmsnorm: want q [T, Hq*D], k [T, Hk*D] and two [D] weights; got q "
                         f"{tuple(q.shape)}, k {tuple(k.shape)}, weights {q_weight.numel()} and {k_weight.numel()}")
    if q.shape[1] % head_dim or k.shape[1] % head_dim:
        raise ValueError(f"qk_rmsnorm: q width {q.shape[1]} and k width {k.shape[1]} must be multiples of the "
                         f"head dim {head_dim}")
    if q.stride(1) != 1 or k.stride(1) != 1:
        raise ValueError("qk_rmsnorm: q and k rows must be contiguous")
    n_tokens = q.shape[0]
    n_q_heads, n_k_heads = q.shape[1] // head_dim, k.shape[1] // head_dim
    q_out = torch.empty(n_tokens, q.shape[1], dtype=q.dtype, device=q.device)
    k_out = torch.empty(n_tokens, k.shape[1], dtype=k.dtype, device=k.device)
    if n_tokens:
        block_hq = triton.next_power_of_2(n_q_heads)
        pdl = use_pdl(q)
        _qk_rmsnorm_kernel[(n_tokens,)](
            q, k, q_weight, k_weight, q_out, k_out, q.stride(0), k.stride(0), n_q_heads, n_k_heads, eps,
            HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_HQ=block_hq,
            BLOCK_HK=triton.next_power_of_2(n_k_heads), USE_PDL=pdl,
            num_warps=8 if block_hq * head_dim >= 4096 else 4, launch_pdl=pdl)
    return q_out, k_out
