"""Fused elementwise kernels for the GPU path: residual-add + RMSNorm, SiLU-and-mul, rotary.

Each reads its inputs once and writes once (the unfused torch versions make several passes over
the activations). The torch implementations in norm.py / activation.py / rotary.py are the
reference and the CPU path; ``use_triton(x)`` decides per call.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from plait import envs
from plait.layers.pdl import pdl_prologue, use_pdl
from plait.layers.tuned_configs import device_info

# (v [T, Hkv*D], k_cache [slots, Hkv, D], v_cache [slots, Hkv, D], loc [T]): where rotary_ may also
# write the new tokens' K/V.
KVStore = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# (q_weight [D], k_weight [D], eps): the per-head q/k RMSNorm rotary_ may apply first (rotary.QKNorm).
QKNorm = tuple[torch.Tensor, torch.Tensor, float]


def use_triton(x: torch.Tensor) -> bool:
    """On CUDA tensors always; on the CPU only under the Triton interpreter (tests)."""
    return x.is_cuda or os.environ.get("TRITON_INTERPRET") == "1" and envs.TRITON_OPS.get()


@triton.jit
def add_rounded(a, b):
    """``a + b`` in a's dtype, computed in fp32 and rounded once: the same bits as a bf16 / fp16 add on the
    GPU (fp32 holds 24 bits, enough that rounding twice equals rounding once), and what the interpreter,
    whose bf16 arithmetic is wrong, computes right."""
    return (a.to(tl.float32) + b.to(tl.float32)).to(a.dtype)


@triton.jit
def mul_rounded(a, b):
    """``a * b`` in b's dtype, computed in fp32 and rounded once (as ``add_rounded``)."""
    return (a.to(tl.float32) * b.to(tl.float32)).to(b.dtype)


@triton.jit
def _rmsnorm_kernel(X, R, W, Y, RES_OUT, stride_x, stride_r, stride_y, n_cols, eps,
                    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False,
                    PRELOAD: tl.constexpr = False):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    if PRELOAD:  # the weight is no kernel's output (pdl.py): loaded while the previous kernel finishes
        w = tl.load(W + cols, mask=mask, other=0.0)
    pdl_prologue(USE_PDL)
    if not PRELOAD:
        w = tl.load(W + cols, mask=mask, other=0.0)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        # Sum rounded to the activation dtype (as the unfused x + residual does), then normalise in fp32.
        x = add_rounded(x, tl.load(R + row * stride_r + cols, mask=mask, other=0.0))
        tl.store(RES_OUT + row * stride_r + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    normed = (xf * tl.rsqrt(var + eps)).to(x.dtype)
    tl.store(Y + row * stride_y + cols, mul_rounded(w, normed), mask=mask)


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
            residual: torch.Tensor | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Same contract as RMSNorm.forward: norm(x) or (norm(x + residual), x + residual)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    n_rows, n_cols = x2.shape
    y = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else y
    r2 = residual.reshape(-1, n_cols) if residual is not None else x2
    if n_rows:
        pdl = use_pdl(x2)
        _rmsnorm_kernel[(n_rows,)](x2, r2, weight, y, res_out, x2.stride(0), r2.stride(0), y.stride(0), n_cols, eps,
                                   HAS_RESIDUAL=residual is not None, BLOCK=triton.next_power_of_2(n_cols),
                                   USE_PDL=pdl, PRELOAD=envs.PDL_PRELOAD.get(),
                                   num_warps=8 if n_cols >= 4096 else 4, launch_pdl=pdl)
    if residual is None:
        return y.view(shape)
    return y.view(shape), res_out.view(shape)


@triton.jit
def _silu_and_mul_kernel(X, Y, stride_x, stride_y, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0)
    # The SiLU in fp32, rounded to up's dtype before the product (rounded once: ``mul_rounded``).
    silu = (gate / (1.0 + tl.exp(-gate))).to(up.dtype)
    tl.store(Y + row * stride_y + cols, mul_rounded(silu, up), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n)
    y = torch.empty(x2.shape[0], n, dtype=x.dtype, device=x.device)
    block = 1024
    if x2.shape[0]:
        pdl = use_pdl(x2)
        _silu_and_mul_kernel[(x2.shape[0], triton.cdiv(n, block))](x2, y, x2.stride(0), y.stride(0), n, BLOCK=block,
                                                                   USE_PDL=pdl, launch_pdl=pdl)
    return y.view(*x.shape[:-1], n)


@triton.jit
def _rotary_inputs(POS, COS_SIN, LOC, WQ, WK, t, is_q, stride_cs, HALF: tl.constexpr, STORE: tl.constexpr,
                   QK_NORM: tl.constexpr):
    """What a rotary program reads besides q, k and v: its token's cos and sin, its cache slot (with
    ``STORE``) and the halves of its q or k norm weight (with ``QK_NORM``). None of it is written by a
    kernel of the step (pdl.py)."""
    pos = tl.load(POS + t).to(tl.int64)
    d = tl.arange(0, HALF)
    cos = tl.load(COS_SIN + pos * stride_cs + d)
    sin = tl.load(COS_SIN + pos * stride_cs + HALF + d)
    slot = tl.load(LOC + t).to(tl.int64) if STORE else pos
    if QK_NORM:
        w_norm = tl.where(is_q, WQ, WK)  # the program's heads are all q or all k
        w1 = tl.load(w_norm + d)
        w2 = tl.load(w_norm + HALF + d)
    else:
        w1 = cos
        w2 = sin
    return cos, sin, slot, w1, w2


@triton.jit
def _rotate_heads(base, heads, n_heads, w1, w2, cos, sin, eps, HALF: tl.constexpr, QK_NORM: tl.constexpr):
    """Rotate (after Qwen3's per-head RMSNorm with ``QK_NORM``, weight halves ``w1``, ``w2``) the rows
    ``heads`` of one token's [n_heads, 2 * HALF] block at ``base``, in place; returns the rotated halves
    and their offsets."""
    d = tl.arange(0, HALF)
    mask = heads[:, None] < n_heads
    offs = heads[:, None] * (2 * HALF) + d[None, :]
    x1 = tl.load(base + offs, mask=mask, other=0.0)
    x2 = tl.load(base + offs + HALF, mask=mask, other=0.0)
    if QK_NORM:
        # qk_norm.qk_rmsnorm's arithmetic (the mean of squares over the whole head in fp32, the normalised
        # value rounded to the input dtype, times the weight, rounded again), so the result equals the
        # two-kernel path's.
        dh = tl.arange(0, 2 * HALF)
        head = tl.load(base + heads[:, None] * (2 * HALF) + dh[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.rsqrt(tl.sum(head * head, axis=1) / (2 * HALF) + eps)[:, None]
        x1 = (w1[None, :] * (x1.to(tl.float32) * rstd).to(x1.dtype)).to(x1.dtype)
        x2 = (w2[None, :] * (x2.to(tl.float32) * rstd).to(x2.dtype)).to(x2.dtype)
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    r1, r2 = (x1f * cos - x2f * sin).to(x1.dtype), (x2f * cos + x1f * sin).to(x1.dtype)
    tl.store(base + offs, r1, mask=mask)
    tl.store(base + offs + HALF, r2, mask=mask)
    return r1, r2, offs, mask


@triton.jit
def _rotary_kernel(Q, K, COS_SIN, POS, stride_q, stride_k, stride_cs, n_q_heads, n_k_heads,
                   V, K_CACHE, V_CACHE, LOC, stride_v, stride_kc, stride_vc, WQ, WK, eps, n_q_blocks, n_blocks,
                   HALF: tl.constexpr, BLOCK_H: tl.constexpr, STORE: tl.constexpr, QK_NORM: tl.constexpr,
                   USE_PDL: tl.constexpr = False, PRELOAD: tl.constexpr = False):
    # Program pid: token pid // n_blocks, head block pid % n_blocks (the first n_q_blocks of q, then k's,
    # whose programs also store their heads' K and V).
    pid = tl.program_id(0)
    t = pid // n_blocks
    g = pid % n_blocks
    is_q = g < n_q_blocks
    if PRELOAD:  # while the previous kernel (the QKV projection) finishes
        cos, sin, slot, w1, w2 = _rotary_inputs(POS, COS_SIN, LOC, WQ, WK, t, is_q, stride_cs, HALF, STORE, QK_NORM)
    pdl_prologue(USE_PDL)
    if not PRELOAD:
        cos, sin, slot, w1, w2 = _rotary_inputs(POS, COS_SIN, LOC, WQ, WK, t, is_q, stride_cs, HALF, STORE, QK_NORM)
    if is_q:
        heads = g * BLOCK_H + tl.arange(0, BLOCK_H)
        _rotate_heads(Q + t * stride_q, heads, n_q_heads, w1, w2, cos, sin, eps, HALF, QK_NORM)
    else:
        heads = (g - n_q_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
        r1, r2, offs, mask = _rotate_heads(K + t * stride_k, heads, n_k_heads, w1, w2, cos, sin, eps, HALF, QK_NORM)
        if STORE:
            # The rotated keys and the values go to the paged cache (what the backend's KV store would
            # write).
            k_dst = K_CACHE + slot * stride_kc
            tl.store(k_dst + offs, r1.to(K_CACHE.dtype.element_ty), mask=mask)
            tl.store(k_dst + offs + HALF, r2.to(K_CACHE.dtype.element_ty), mask=mask)
            dv = tl.arange(0, 2 * HALF)
            offs_v = heads[:, None] * (2 * HALF) + dv[None, :]
            vals = tl.load(V + t * stride_v + offs_v, mask=mask, other=0.0)
            v_dst = V_CACHE + slot * stride_vc
            tl.store(v_dst + offs_v, vals.to(V_CACHE.dtype.element_ty), mask=mask)


# Heads per rotary program when a batch has few tokens (unless ``PLAIT_ROTARY_SPLIT_HEADS`` says):
# one program per token would leave a decode step's whole rotation to one SM (bs 1 at qwen3-30b-a3b:
# 36 heads in one program).
ROTARY_SPLIT_HEADS = 4


def rotary_heads_per_program(tokens: int, n_q: int, n_k: int, num_sms: int, head_dim: int) -> int:
    """Heads per program: ``ROTARY_SPLIT_HEADS`` (or ``PLAIT_ROTARY_SPLIT_HEADS``'s power of two; 0 turns
    the split off) while the split grid stays within 4 programs per SM, else every head of a token
    (prefill: one program per token is already a full grid). Unless the variable says, heads under 128
    wide keep one program per token: a token's rows are then short enough for one SM (the split did not
    pay at llama-3.2-1b's 64, docs/benchmarks.md)."""
    whole = triton.next_power_of_2(max(n_q, n_k))
    per = envs.ROTARY_SPLIT_HEADS.get()
    if per is None:
        per = ROTARY_SPLIT_HEADS if head_dim >= 128 else 0
    if per <= 0:
        return whole
    split = min(whole, triton.next_power_of_2(per))
    blocks = triton.cdiv(n_q, split) + triton.cdiv(n_k, split)
    return split if tokens * blocks <= 4 * num_sms else whole


def rotary_(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, cos_sin_cache: torch.Tensor,
            head_dim: int, kv_store: KVStore | None = None,
            qk_norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """In place on q [T, Hq*D] and k [T, Hkv*D] (each row contiguous); cos_sin_cache float32 [P, D].

    ``kv_store``: also write the rotated k and v into the paged cache at ``loc`` (the attention
    backend's KV store, in the same launch; the backend then runs with ``save_kv_cache=False``).
    ``qk_norm``: first normalise every head of q and k (Qwen3's q_norm / k_norm), in the same launch
    (what ``qk_norm.qk_rmsnorm`` followed by this kernel computes, one launch fewer per layer).
    Programs: one per token and block of ``rotary_heads_per_program`` heads."""
    t = q.shape[0]
    n_q, n_k = q.shape[1] // head_dim, k.shape[1] // head_dim
    if qk_norm is not None:
        q_weight, k_weight, eps = qk_norm
        if q_weight.numel() != head_dim or k_weight.numel() != head_dim:
            raise ValueError(f"qk_norm: want two [{head_dim}] weights (the head dim), got {q_weight.numel()} and "
                             f"{k_weight.numel()}")
        norm_args = (q_weight.contiguous(), k_weight.contiguous(), float(eps))
    else:
        norm_args = (q, k, 0.0)  # unused
    if not t:
        return q, k
    if kv_store is not None:
        v, k_cache, v_cache, loc = kv_store
        if k_cache.stride(1) != head_dim or v_cache.stride(1) != head_dim or v.stride(1) != 1:
            raise ValueError("kv_store: caches [slots, Hkv, D] with contiguous heads, v rows contiguous")
        store_args = (v, k_cache, v_cache, loc, v.stride(0), k_cache.stride(0), v_cache.stride(0))
    else:
        store_args = (k, k, k, positions, 0, 0, 0)  # unused
    block_h = rotary_heads_per_program(t, n_q, n_k, device_info(q)[1], head_dim)
    n_q_blocks = triton.cdiv(n_q, block_h)
    n_blocks = n_q_blocks + triton.cdiv(n_k, block_h)
    pdl = use_pdl(q)
    _rotary_kernel[(t * n_blocks,)](
        q, k, cos_sin_cache, positions, q.stride(0), k.stride(0), cos_sin_cache.stride(0), n_q, n_k,
        *store_args, *norm_args, n_q_blocks, n_blocks, HALF=head_dim // 2, BLOCK_H=block_h,
        STORE=kv_store is not None, QK_NORM=qk_norm is not None, USE_PDL=pdl,
        PRELOAD=envs.PDL_PRELOAD.get(), launch_pdl=pdl)
    return q, k


ARGMAX_BLOCK = 4096


@triton.jit
def _argmax_partial_kernel(X, VALS, IDX, stride_x, n, n_blocks, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    blk = tl.program_id(1)
    cols = blk * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + row * stride_x + cols, mask=cols < n, other=-float("inf"))
    # tie_break_left: the first maximum wins, as in torch.argmax.
    val, i = tl.max(x, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(VALS + row * n_blocks + blk, val)
    tl.store(IDX + row * n_blocks + blk, blk * BLOCK + i)


@triton.jit
def _argmax_final_kernel(VALS, IDX, OUT, n_blocks, NB: tl.constexpr):
    row = tl.program_id(0)
    b = tl.arange(0, NB)
    vals = tl.load(VALS + row * n_blocks + b, mask=b < n_blocks, other=-float("inf"))
    _, j = tl.max(vals, axis=0, return_indices=True, return_indices_tie_break_left=True)
    tl.store(OUT + row, tl.load(IDX + row * n_blocks + j))


def argmax(x: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of a 2-D float tensor, first maximum on ties (torch.argmax(x, -1)).

    Why: torch's reduction gives a whole vocabulary row to one block (the slowest kernel of a bs=1 step); two
    passes over vocabulary blocks spread the read over the whole GPU. NaN rows are not special-cased
    (logits are finite here)."""
    x = x.contiguous()
    bs, n = x.shape
    vals, idx = argmax_block_buffers(bs, n, x.device)
    if bs:
        _argmax_partial_kernel[(bs, vals.shape[1])](x, vals, idx, x.stride(0), n, vals.shape[1], BLOCK=ARGMAX_BLOCK,
                                                    num_warps=8)
    return argmax_of_blocks(vals, idx)


def argmax_block_buffers(bs: int, n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The first pass's outputs for rows of ``n`` columns: per ARGMAX_BLOCK-column block of each row its
    maximum (float32 [bs, n_blocks]) and that maximum's first column (int64 [bs, n_blocks])."""
    n_blocks = triton.cdiv(n, ARGMAX_BLOCK)
    return (torch.empty(bs, n_blocks, dtype=torch.float32, device=device),
            torch.empty(bs, n_blocks, dtype=torch.int64, device=device))


def argmax_of_blocks(vals: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """The second pass: each row's column (int64 [bs]) of its first maximal block maximum, i.e. the row's
    first maximum when each block holds its own first maximum."""
    bs, n_blocks = vals.shape
    out = torch.empty(bs, dtype=torch.int64, device=vals.device)
    if bs:
        _argmax_final_kernel[(bs,)](vals, idx, out, n_blocks, NB=triton.next_power_of_2(n_blocks))
    return out
