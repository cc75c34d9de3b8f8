"""The small-M GEMV: ``y [M, N] = x [M, K] @ W.T`` for decode batches (M <= 16), one kernel launch.

At these sizes the weights are the bytes: the kernel is built to read ``W [N, K]`` (row-major, as
checkpoints store it) once at HBM speed, whatever its dtype:

  fp8 e4m3  with channel scales ``[N]`` fp32 or block scales ``[ceil(N / bn), ceil(K / bk)]`` fp32
            (``W = q * s``), in one of two forms:
              W8A8 (where the tuned table marks it faster; ``fp8_w8a8_default`` may force a form):
                each step's activations are quantized to e4m3 per token and ``W8A8_GROUP``-column
                group (scale = max |x| / 448, at least MIN_SCALE) and multiplied e4m3 x e4m3 on the
                tensor cores, the weight tile unconverted
              weight-only: the weights converted in registers, the activations multiply as they are
                (bf16 / fp16 / fp32)
  bf16/fp16 with no scale

Grid: ``(ceil(N / BLOCK_N), split_k)``. A program owns ``BLOCK_N`` rows and one K slice (the whole row
when ``split_k`` is 1) and walks it ``BLOCK_K`` columns per step (16-byte loads per thread, the steps
software-pipelined by ``num_stages``).

  M == 1   elementwise: the products accumulate in a ``[BLOCK_N, BLOCK_K]`` fp32 tile, reduced over K
           once at the end (no cross-thread reduction per step)
  M >= 2   tensor cores: ``tl.dot`` of the activations (padded to 16 rows by masks, which read
           nothing) with the converted weight tile
  W8A8     every M: ``BLOCK_K`` is one 128-column group; ``tl.dot(W [BLOCK_N, 128], x_q^T [128, 16])``
           with the weight rows as the MMA's M (>= 16 per warp: on sm_90 a warpgroup MMA reading the
           e4m3 weight tile straight from the shared memory its async copy filled), times each token's
           group scale. At M == 1 the one row is quantized (its padding rows take its codes and are
           never stored), the next step's row loaded one step ahead. What decode computes is then
           ``reference_w8a8_gemv`` (fp8_kernels): activations quantized per token and 128 columns,
           finer than the prefill GEMM's per-token scales for channel weights, the block GEMM's
           grouping for block weights.

Channel scales multiply the result once; block scales multiply each step's products (a step lies in
one scale block: ``BLOCK_K`` divides the block width, the wrapper narrows it if needed). A bias ``[N]``
is added before the store.

Three fusions for a decoder layer's decode steps (plait.layers.norm_linear, linear.RowParallelLinear), each a
constexpr path:

  norm prologue  ``gemv_rmsnorm``: X is the input of an add + RMSNorm (with its residual R). Every
                 program computes its rows' scale over the whole row (read from L2), then normalises each
                 activation tile it loads with the RMSNorm kernel's cast points; program (0, 0) writes
                 the new residual (and the normed rows, for the MoE experts)
  act prologue   ``gemv_silu_mul``: X is a gate_up output ``[M, 2K]``; each activation tile is
                 ``silu(gate) * up`` computed as it is loaded (``triton_ops.silu_mul``)
  route epilogue ``route=``: the output is router logits; the last program to store its tile (a
                 grid-wide counter, the split-K protocol below) reads them back and writes every row's
                 top-k routing with the top-k kernel's arithmetic (``fused_router.topk_of_logits``)

Split-K (``split_k`` > 1, for shapes whose row tiles alone would leave SMs idle) stays one launch: each
program stores its fp32 partial, and the last program of a row tile to finish (an atomic counter per
tile) adds the partials in slice order (deterministic) and writes the output, then zeroes its counter
again. The counters are a per-device workspace that every launch leaves zero; launches that use it must
be ordered on one stream (plait runs its decode on one stream per device).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from plait import envs
from plait.layers.moe.fused_router import Routing, topk_of_logits
from plait.layers.pdl import pdl_prologue, use_pdl
from plait.layers.quantization.gemv_config import GEMV_MAX_TOKENS, GemvConfig, gemv_kind, get_config
from plait.layers.triton_ops import add_rounded, mul_rounded, silu_mul, use_triton

# Row tiles one split-K launch may count (int32 each): gate_up of a 70b model at BLOCK_N 4 needs 14k.
MAX_COUNTERS = 1 << 16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Smallest scale a quantizer hands out: an all-zero row quantizes to zeros, not NaN.
MIN_SCALE = 1e-12
# Most experts the router epilogue routes over (one program holds a row's logits).
MAX_ROUTED_EXPERTS = 1024
# Widest tile of the norm prologue (gemv_rmsnorm): wider rows are summed tile by tile, so the whole-row
# tile does not take the registers the GEMV's pipeline needs.
NORM_TILE = 4096
# Columns per activation scale of the W8A8 form (one K step each): the block path's group width.
W8A8_GROUP = 128


def fp8_w8a8_default() -> bool | None:
    """The FP8 form when a call does not say, the one switch (``PLAIT_FP8_GEMV_W8A8``): True W8A8, False
    weight-only, None (unset) the launch config's ``prefer_w8a8`` (the tuned table's measured choice per
    shape and token bucket; weight-only where it has none)."""
    return envs.FP8_GEMV_W8A8.get()


@triton.jit
def _norm_rows(X, R, NW, RES_OUT, NORMED, M, K, eps, writer, BLOCK_M: tl.constexpr, HAS_RES: tl.constexpr,
               WRITE_NORMED: tl.constexpr, NORM_BLOCK: tl.constexpr):
    """The RMSNorm prologue: each of the M rows' ``1 / sqrt(mean((x + r)^2) + eps)`` (fp32 ``[BLOCK_M]``,
    0 past M) over the whole row, the expression of plait.layers.triton_ops' RMSNorm kernel (the sum
    rounded to the activation dtype, the squares summed in fp32; for K <= NORM_BLOCK over one tile, as
    that kernel does, wider rows tile by tile). The ``writer`` program also stores the new residual
    ``x + r`` and, with WRITE_NORMED, the normed row. Rows are contiguous: row m starts at m * K."""
    offs_m = tl.arange(0, BLOCK_M)
    rstd = tl.zeros([BLOCK_M], dtype=tl.float32)
    # One row (BLOCK_M 1 means M 1): a loop of one trip, so no row count lives across the GEMV's loop.
    for m in range(0, 1 if BLOCK_M == 1 else M):
        ss = 0.0
        for c0 in range(0, K, NORM_BLOCK):
            cols = c0 + tl.arange(0, NORM_BLOCK)
            cmask = cols < K
            x = tl.load(X + m * K + cols, mask=cmask, other=0.0)
            if HAS_RES:
                x = add_rounded(x, tl.load(R + m * K + cols, mask=cmask, other=0.0))
                tl.store(RES_OUT + m * K + cols, x, mask=cmask & writer)
            xf = x.to(tl.float32)
            ss += tl.sum(xf * xf, axis=0)
        r = tl.rsqrt(ss / K + eps)
        if WRITE_NORMED:
            for c0 in range(0, K, NORM_BLOCK):
                cols = c0 + tl.arange(0, NORM_BLOCK)
                wmask = (cols < K) & writer
                x = tl.load(X + m * K + cols, mask=wmask, other=0.0)
                if HAS_RES:
                    x = add_rounded(x, tl.load(R + m * K + cols, mask=wmask, other=0.0))
                w = tl.load(NW + cols, mask=wmask, other=0.0)
                tl.store(NORMED + m * K + cols, mul_rounded(w, (x.to(tl.float32) * r).to(x.dtype)), mask=wmask)
        rstd = tl.where(offs_m == m, r, rstd)
    return rstd


@triton.jit
def _normed(x, r_ptrs, nw_ptrs, mask, k_mask, rstd, HAS_RES: tl.constexpr, MASKED: tl.constexpr = True,
            K_MASKED: tl.constexpr = True):
    """One loaded activation tile made what the unfused norm would have stored there: ``nw * ((x + r) *
    rstd)`` with the unfused kernel's cast points (the sum in x's dtype, the scaling in fp32, rounded to
    x's dtype before the weight multiplies it). Masked-off elements stay 0. ``mask`` (the tile's) is unused
    without MASKED, ``k_mask`` (the columns', for the weight) without K_MASKED."""
    if HAS_RES:
        if MASKED:
            x = add_rounded(x, tl.load(r_ptrs, mask=mask, other=0.0))
        else:
            x = add_rounded(x, tl.load(r_ptrs))
    if K_MASKED:
        w = tl.load(nw_ptrs, mask=k_mask, other=0.0)
    else:
        w = tl.load(nw_ptrs)
    return mul_rounded(w, (x.to(tl.float32) * rstd).to(x.dtype))


@triton.jit
def _route_if_last(Out, TopkW, TopkIds, RouteCounter, M, N, stride_om, n_tiles, offs_m, GPU_FENCE: tl.constexpr,
                   TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, SOFTMAX_FIRST: tl.constexpr,
                   RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr):
    """The router epilogue, run by each of the ``n_tiles`` programs that stored an output tile: the last
    to finish (the split-K publication protocol on one grid-wide counter, left zero again) reads every
    row's N logits back through L2 and writes its top-k routing, ``fused_router.topk_of_logits`` on the
    stored values, so the same weights and ids as the top-k kernel reading them."""
    if GPU_FENCE:
        tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [offs_m],
                                  dtype=tl.int32, is_pure=False, pack=1)
    tl.debug_barrier()
    if tl.atomic_add(RouteCounter, 1, sem="acq_rel", scope="gpu") == n_tiles - 1:
        tl.atomic_xchg(RouteCounter, 0, sem="relaxed", scope="gpu")
        offs_e = tl.arange(0, BLOCK_E)
        slot = tl.arange(0, TOP_K_PAD)
        for m in range(0, M):
            logits = tl.load(Out + m * stride_om + offs_e, mask=offs_e < N, other=-float("inf"), cache_modifier=".cg")
            weights, ids = topk_of_logits(logits, N, TOP_K, TOP_K_PAD, SOFTMAX_FIRST, RENORMALIZE, BLOCK_E)
            tl.store(TopkW + m * TOP_K + slot, weights, mask=slot < TOP_K)
            tl.store(TopkIds + m * TOP_K + slot, ids, mask=slot < TOP_K)


# M and split_k are not specialised (divisibility by 16, == 1): the token counts 2..16 and every split
# share one compiled kernel per config.
@triton.jit(do_not_specialize=["M", "split_k"])
def _gemv_kernel(
    X,  # [M, K] activations
    W,  # [N, K] weights (fp8 e4m3 / bf16 / fp16)
    S,  # channel: [N] fp32; block: [ceil(N / BN_SCALE), ceil(K / BK_SCALE)] fp32; none: unused
    Out,  # [M, N] in X's dtype
    Bias,  # [N] (HAS_BIAS); else unused
    Partials,  # split-K: [split_k, M, N] fp32; else unused
    Counters,  # split-K: int32 [>= ceil(N / BLOCK_N)], zero on entry and on exit; else unused
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_sn,
    stride_om,
    k_per_split,  # a multiple of BLOCK_K
    split_k,
    R,  # NORM with HAS_RES: [M, K] residual (contiguous, as X then is); else unused
    NW,  # NORM: [K] RMSNorm weight; else unused
    ResOut,  # NORM with HAS_RES: [M, K] x + residual, written by program (0, 0); else unused
    Normed,  # WRITE_NORMED: [M, K] the normed activations, written by program (0, 0); else unused
    eps,
    TopkW,  # ROUTE: [M, TOP_K] fp32, written by the last program; else unused
    TopkIds,  # ROUTE: [M, TOP_K] int32; else unused
    RouteCounter,  # ROUTE: int32 [1], zero on entry and on exit; else unused
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SCALE: tl.constexpr,  # 0 none, 1 channel, 2 block
    BN_SCALE: tl.constexpr,
    BK_SCALE: tl.constexpr,
    EVEN_K: tl.constexpr,  # every K slice is whole BLOCK_K steps inside K: no column masks
    SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    GPU_FENCE: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    W8A8: tl.constexpr,  # quantize each step's activations to e4m3 per row (BLOCK_K == W8A8_GROUP)
    ONE_ROW: tl.constexpr,  # W8A8 with M == 1
    HAS_BIAS: tl.constexpr,
    FP8_MAX_V: tl.constexpr,
    MIN_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
    PREFETCH_ROW_BYTES: tl.constexpr = 0,  # > 0 (with USE_PDL): L2-prefetch this much of each row first
    NORM: tl.constexpr = False,  # X is the RMSNorm's input (+ R): the kernel normalises it on load
    HAS_RES: tl.constexpr = False,
    WRITE_NORMED: tl.constexpr = False,
    NORM_BLOCK: tl.constexpr = 1,  # the prologue's tile: the next power of two >= K, at most NORM_TILE
    ROUTE: tl.constexpr = False,  # Out holds router logits: the last program routes every row (_route_if_last)
    TOP_K: tl.constexpr = 1,
    TOP_K_PAD: tl.constexpr = 1,
    SOFTMAX_FIRST: tl.constexpr = True,
    RENORMALIZE: tl.constexpr = False,
    BLOCK_E: tl.constexpr = 1,  # next power of two >= N
    ACT_IN: tl.constexpr = False,  # X is [M, 2K] gate | up: the GEMV multiplies silu(gate) * up (silu_mul)
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    # Rows past N read row N - 1 (never stored): the loads need no row mask and stay 16-byte vectors.
    rows = tl.minimum(offs_n, N - 1)
    offs_m = tl.arange(0, BLOCK_M)
    mask_m = offs_m < M
    k_lo = pid_k * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    if PREFETCH_ROW_BYTES > 0:
        # Launched early (PDL), the program asks L2 for the start of its weight rows before it waits for
        # the previous kernel, so those HBM reads overlap the predecessor's tail. A prefetch into L2 loads
        # nothing into the program and changes no value a later load sees (L2 is where every SM's writes
        # land); every load and store still comes after the prologue, as the PDL contract says.
        LINES: tl.constexpr = PREFETCH_ROW_BYTES // 128
        line = tl.arange(0, BLOCK_N * LINES)
        col = k_lo + (line % LINES) * (1024 // W.dtype.element_ty.primitive_bitwidth)  # elements a line
        ptr = W + tl.minimum(pid_n * BLOCK_N + line // LINES, N - 1).to(tl.int64) * stride_wn + tl.minimum(col, K - 1)
        tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptr.to(tl.int64)],
                                  dtype=tl.int32, is_pure=False, pack=1)
    pdl_prologue(USE_PDL)
    if NORM:
        rstd = _norm_rows(X, R, NW, ResOut, Normed, M, K, eps, (pid_n == 0) & (pid_k == 0), BLOCK_M, HAS_RES,
                          WRITE_NORMED, NORM_BLOCK)
        rstd_1 = tl.sum(rstd, axis=0)  # M == 1: the one row's (the other entries are 0)
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
    if SCALE == 2:
        s_rows = S + (rows // BN_SCALE) * stride_sn
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif W8A8:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if ONE_ROW:
            offs_k0 = k_lo + tl.arange(0, BLOCK_K)
            x_next = tl.load(X + offs_k0, mask=offs_k0 < k_hi, other=0.0)
            if ACT_IN:
                x_next = silu_mul(x_next, tl.load(X + K + offs_k0, mask=offs_k0 < k_hi, other=0.0))
            if NORM:
                x_next = _normed(x_next, R + offs_k0, NW + offs_k0, offs_k0 < k_hi, offs_k0 < k_hi, rstd_1, HAS_RES)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        # The weights are read once: evict them first, so the activations stay in the caches.
        if EVEN_K:
            w = tl.load(w_rows + offs_k[None, :], eviction_policy="evict_first")
        else:
            w = tl.load(w_rows + offs_k[None, :], mask=(offs_k < k_hi)[None, :], other=0.0,
                        eviction_policy="evict_first")
        if SCALE == 2:
            s = tl.load(s_rows + k0 // BK_SCALE)
        if BLOCK_M > 1 and not ONE_ROW:
            x_mask = mask_m[:, None] if EVEN_K else mask_m[:, None] & (offs_k < k_hi)[None, :]
            x = tl.load(X + offs_m[:, None] * stride_xm + offs_k[None, :], mask=x_mask, other=0.0)
            if ACT_IN:
                x = silu_mul(x, tl.load(X + offs_m[:, None] * stride_xm + K + offs_k[None, :], mask=x_mask, other=0.0))
            if NORM:
                x = _normed(x, R + offs_m[:, None] * K + offs_k[None, :], NW + offs_k[None, :], x_mask,
                            (offs_k < k_hi)[None, :], rstd[:, None], HAS_RES, True, not EVEN_K)
        if BLOCK_M == 1:
            if EVEN_K:
                x = tl.load(X + offs_k)
                if ACT_IN:
                    x = silu_mul(x, tl.load(X + K + offs_k))
            else:
                x = tl.load(X + offs_k, mask=offs_k < k_hi, other=0.0)
                if ACT_IN:
                    x = silu_mul(x, tl.load(X + K + offs_k, mask=offs_k < k_hi, other=0.0))
            if NORM:
                if EVEN_K:
                    x = _normed(x, R + offs_k, NW + offs_k, None, None, rstd_1, HAS_RES, False, False)
                else:
                    x = _normed(x, R + offs_k, NW + offs_k, offs_k < k_hi, offs_k < k_hi, rstd_1, HAS_RES)
            prod = w.to(tl.float32) * x.to(tl.float32)[None, :]
            if SCALE == 2:
                prod = prod * s[:, None]
            acc2 += prod
        elif W8A8:
            # One step is one 128-column group: its per-row scale and e4m3 codes, then an e4m3 x e4m3
            # dot (the weight tile unconverted, as the async copy left it in shared memory). Rows past M
            # and columns past K loaded zeros: scale MIN_S, codes 0. x times the scale's reciprocal (one
            # division per row, not per element: the quantizer is most of the loop's instructions) is
            # within a few ulp of x / scale (the GPU's fp32 division is approximate too), so at most 448
            # plus rounding, which the conversion rounds to 448: no clamp.
            if ONE_ROW:  # M == 1: quantize the one row and give every padding row its codes (never stored)
                x1 = x_next.to(tl.float32)
                # The next step's row now (2 bytes a thread: too narrow for the pipelined async copies).
                x_next = tl.load(X + offs_k + BLOCK_K, mask=offs_k + BLOCK_K < k_hi, other=0.0)
                if ACT_IN:
                    x_next = silu_mul(x_next, tl.load(X + K + offs_k + BLOCK_K, mask=offs_k + BLOCK_K < k_hi,
                                                      other=0.0))
                if NORM:
                    x_next = _normed(x_next, R + offs_k + BLOCK_K, NW + offs_k + BLOCK_K, offs_k + BLOCK_K < k_hi,
                                     offs_k + BLOCK_K < k_hi, rstd_1, HAS_RES)
                s1 = tl.maximum(tl.max(tl.abs(x1), axis=0) / FP8_MAX_V, MIN_S)
                x_q = tl.broadcast_to((x1 * (1.0 / s1)).to(W.dtype.element_ty)[None, :], [BLOCK_M, BLOCK_K])
                x_s = tl.full([BLOCK_M], 1.0, tl.float32) * s1
            else:
                xf = x.to(tl.float32)
                x_s = tl.maximum(tl.max(tl.abs(xf), axis=1) / FP8_MAX_V, MIN_S)  # [BLOCK_M]
                x_q = (xf * (1.0 / x_s)[:, None]).to(W.dtype.element_ty)
            # Swapped operands, W [BLOCK_N, 128] @ x_q^T [128, BLOCK_M]: the weight rows are the dot's M
            # (16 per warp, 64 per warpgroup: a Hopper warpgroup MMA reading e4m3 from shared memory; an
            # M of 16 tokens would take mma.sync, which Triton runs on sm_90 by widening e4m3 to fp16 in
            # registers).
            if UPCAST_DOT:  # the interpreter has no fp8 dot; e4m3 products are exact in fp32
                part = tl.dot(w.to(tl.float32), tl.trans(x_q.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(w, tl.trans(x_q))
            # Each group's products leave the tensor core and are scaled and added in fp32 here: Hopper's
            # reduced-precision fp8 accumulation spans at most 128 products.
            part = part * x_s[None, :]
            if SCALE == 2:
                part = part * s[:, None]
            acc_t += part
        else:
            if UPCAST_DOT:  # triton 3.6's interpreter multiplies bf16 dot operands as integers
                part = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:  # e4m3 (and bf16 / fp16) converts exactly to the activations' dtype
                part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=INPUT_PRECISION)
            if SCALE == 2:
                part = part * s[None, :]
            acc += part
    if BLOCK_M == 1:
        acc = tl.sum(acc2, axis=1)[None, :]
    elif W8A8:
        acc = tl.trans(acc_t)
    out_mask = mask_m[:, None] & mask_n[None, :]
    out_ptrs = Out + offs_m[:, None] * stride_om + offs_n[None, :]
    if SPLIT:
        # Publication protocol (CUDA's threadfence reduction, as the Triton decode kernel's split
        # merge): every thread fences its partial stores at GPU scope, the CTA synchronises, one
        # acq_rel atomic counts the slice; the program that sees split_k - 1 reads the partials
        # through L2 (.cg) in slice order.
        part_ptrs = Partials + offs_m[:, None] * N + offs_n[None, :]
        tl.store(part_ptrs + pid_k.to(tl.int64) * M * N, acc, mask=out_mask)
        if GPU_FENCE:
            tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [offs_m],
                                      dtype=tl.int32, is_pure=False, pack=1)
        tl.debug_barrier()
        counter = Counters + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == split_k - 1:
            tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
            total = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for s_id in range(0, split_k):
                total += tl.load(part_ptrs + s_id * M * N, mask=out_mask, other=0.0, cache_modifier=".cg")
            if SCALE == 1:
                total = total * tl.load(S + rows)[None, :]
            if HAS_BIAS:
                total = total + tl.load(Bias + rows).to(tl.float32)[None, :]
            tl.store(out_ptrs, total.to(Out.dtype.element_ty), mask=out_mask)
            if ROUTE:
                _route_if_last(Out, TopkW, TopkIds, RouteCounter, M, N, stride_om, tl.num_programs(0), offs_m,
                               GPU_FENCE, TOP_K, TOP_K_PAD, SOFTMAX_FIRST, RENORMALIZE, BLOCK_E)
    else:
        if SCALE == 1:
            acc = acc * tl.load(S + rows)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(Bias + rows).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=out_mask)
        if ROUTE:
            _route_if_last(Out, TopkW, TopkIds, RouteCounter, M, N, stride_om, tl.num_programs(0), offs_m,
                           GPU_FENCE, TOP_K, TOP_K_PAD, SOFTMAX_FIRST, RENORMALIZE, BLOCK_E)


@functools.lru_cache(maxsize=8)
def _cuda_device(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def device_info(t: torch.Tensor) -> tuple[str, int]:
    """(device name as config files key it, SM count) of a tensor's device; the interpreter's stand-in
    on the CPU (no tuned file, any positive SM count)."""
    if t.device.type != "cuda":
        return "cpu", 8
    return _cuda_device(t.device.index if t.device.index is not None else torch.cuda.current_device())


@dataclass(frozen=True)
class GemvLaunch:
    """What one call launches (``plan_launch``): the tile sizes after the kernel's constraints, the K
    slices, whether every slice is whole steps (no column masks), and the FP8 form (``w8a8``)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    k_per_split: int
    even_k: bool
    num_warps: int
    num_stages: int
    w8a8: bool = False
    one_row: bool = False  # W8A8 at M == 1: one row quantized, its codes broadcast to the padding rows

    def compile_key(self) -> tuple[bool, int, int, bool, bool, int, int, bool, bool]:
        """What the compiled kernel depends on besides the dtypes and the scale layout."""
        return (self.block_m == 1, self.block_n, self.block_k, self.even_k, self.split_k > 1, self.num_warps,
                self.num_stages, self.w8a8, self.one_row)


@functools.lru_cache(maxsize=4096)
def plan_launch(m: int, n: int, k: int, block: tuple[int, int] | None, config: GemvConfig,
                w8a8: bool = False) -> GemvLaunch:
    """``config`` made launchable for an (M, N, K) call: 16+ rows and columns for the tensor-core form
    (M >= 2, and every M with ``w8a8``), a step inside one scale block (block scales), with ``w8a8`` a
    step of exactly one ``W8A8_GROUP``-column activation group and 16+ weight rows per warp, and K
    slices of whole steps. Cached: eager decode steps plan every layer's call."""
    block_m = 1 if m == 1 and not w8a8 else max(16, triton.next_power_of_2(m))
    block_n = config.block_n if block_m == 1 else max(16, config.block_n)
    if w8a8:  # the weight rows are the dot's M: 16 per warp, so the warps form whole warpgroup MMAs
        block_n = max(block_n, 16 * config.num_warps)
    block_k = W8A8_GROUP if w8a8 else config.block_k
    if block is not None:
        while block[1] % block_k:
            block_k //= 2
            if block_k < 16:
                raise ValueError(f"gemv: the scale block width {block[1]} has no power-of-two divisor >= 16")
    k_steps = triton.cdiv(k, block_k)
    k_per_split = triton.cdiv(k_steps, config.split_k) * block_k
    split_k = triton.cdiv(k, k_per_split)
    if triton.cdiv(n, block_n) > MAX_COUNTERS:
        split_k, k_per_split = 1, k_steps * block_k
    return GemvLaunch(block_m, block_n, block_k, split_k, k_per_split, k % k_per_split == 0, config.num_warps,
                      config.num_stages, w8a8, w8a8 and m == 1)


def prefetch_row_bytes(plan: GemvLaunch, element_size: int) -> int:
    """Bytes of each weight row a PDL-launched program prefetches into L2 before it waits for its
    predecessor: the slice's first pipeline's worth (``num_stages`` steps) in whole 128-byte lines, a
    power of two of at most 4 KiB."""
    row_bytes = min(plan.k_per_split, plan.num_stages * plan.block_k) * element_size
    return min(4096, max(128, triton.next_power_of_2(row_bytes)))


_COUNTERS: dict[torch.device, torch.Tensor] = {}
_ROUTE_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K counters (module docstring): allocated zero once, kept zero by the kernel.
    The first split-K launch on a device happens eagerly (the engine's warm-up runs before capture)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters


@dataclass(frozen=True)
class RouteOutputs:
    """Where a router GEMV's last program writes each row's top-k routing (``route=`` of ``gemv`` /
    ``gemv_rmsnorm``): ``weights`` float32 ``[M, top_k]``, ``ids`` int32 ``[M, top_k]``, as
    ``fused_router.fused_topk`` of the GEMV's output returns them."""

    routing: Routing
    weights: torch.Tensor
    ids: torch.Tensor

    @staticmethod
    def empty(rows: int, routing: Routing, device: torch.device) -> RouteOutputs:
        return RouteOutputs(routing, torch.empty(rows, routing.top_k, dtype=torch.float32, device=device),
                            torch.empty(rows, routing.top_k, dtype=torch.int32, device=device))


@dataclass(frozen=True)
class _NormArgs:
    """What the RMSNorm prologue reads and writes (``gemv_rmsnorm``): every tensor ``[M, K]`` contiguous
    but the weight ``[K]``."""

    weight: torch.Tensor
    eps: float
    residual: torch.Tensor | None
    residual_out: torch.Tensor | None
    normed: torch.Tensor | None


def route_counter(device: torch.device) -> torch.Tensor:
    """The device's grid-wide counter of the router epilogue (``_route_if_last``): one int32, zero
    between launches, apart from the split-K tile counters (a routed launch may also split K)."""
    counter = _ROUTE_COUNTERS.get(device)
    if counter is None:
        counter = _ROUTE_COUNTERS[device] = torch.zeros(1, dtype=torch.int32, device=device)
    return counter


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
         config: GemvConfig | None = None, bias: torch.Tensor | None = None, w8a8: bool | None = None,
         route: RouteOutputs | None = None) -> torch.Tensor:
    """``x [M, K] @ (W * scale).T (+ bias) -> [M, N]`` in x's dtype for ``1 <= M <= 16``.

    ``w`` fp8 e4m3 with ``scale`` ``[N]`` (channel, ``block`` None) or ``[ceil(N / bn), ceil(K / bk)]``
    (``block`` (bn, bk)); or bf16 / fp16 with ``scale`` None. ``bias [N]`` is added in the epilogue.
    ``w8a8`` (FP8 weights only): True quantizes the activations per row and 128-column group and
    multiplies e4m3 x e4m3 on the tensor cores; False: weight-only dequantization; None:
    ``fp8_w8a8_default()``, and where that is unset too, the weight-only table entry's ``prefer_w8a8``
    (the form measured faster for this case; an explicit ``config``'s own flag, launched as given).
    Block scales narrower than, or not a multiple of, 128 columns take the weight-only form. ``config``
    overrides the tuned / default launch config (the tuner, tests). ``route``: the output is router
    logits (N experts); the last program to finish also writes each row's top-k routing there."""
    return _gemv(x, w, scale, block, config, bias, w8a8, None, route)


def gemv_rmsnorm(x: torch.Tensor, norm_weight: torch.Tensor, eps: float, w: torch.Tensor,
                 scale: torch.Tensor | None = None, block: tuple[int, int] | None = None, *,
                 residual: torch.Tensor | None = None, want_normed: bool = False, bias: torch.Tensor | None = None,
                 config: GemvConfig | None = None, w8a8: bool | None = None, route: RouteOutputs | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``RMSNorm`` then ``gemv`` in one launch: ``(gemv(norm(h)), h, norm(h) if want_normed)`` with ``h =
    x + residual`` (``x`` where ``residual`` is None), each ``[M, K]`` row normalised as RMSNorm.forward
    does (``norm_weight [K]``, ``eps``). Every program computes its rows' scale over the whole row (K
    elements from L2) and normalises the K slice it multiplies; program (0, 0) writes ``h`` and the normed
    rows. The other arguments are ``gemv``'s."""
    m, k = x.shape
    if norm_weight.shape != (k,):
        raise ValueError(f"gemv_rmsnorm: the norm weight must have shape ({k},), got {tuple(norm_weight.shape)}")
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        raise ValueError(f"gemv_rmsnorm: the residual must be {x.dtype} of shape {tuple(x.shape)}, got "
                         f"{residual.dtype} {tuple(residual.shape)}")
    x = x.contiguous()
    residual = residual.contiguous() if residual is not None else None
    residual_out = torch.empty_like(x) if residual is not None else None
    normed = torch.empty_like(x) if want_normed else None
    out = _gemv(x, w, scale, block, config, bias, w8a8,
                _NormArgs(norm_weight.contiguous(), eps, residual, residual_out, normed), route)
    return out, residual_out if residual_out is not None else x, normed


def gemv_silu_mul(gate_up: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None,
                  block: tuple[int, int] | None = None, *, bias: torch.Tensor | None = None,
                  config: GemvConfig | None = None, w8a8: bool | None = None) -> torch.Tensor:
    """SiLU-and-mul then ``gemv`` in one launch: ``gate_up [M, 2K]`` (gate columns, then up) ->
    ``gemv(silu(gate) * up)`` ``[M, N]``, each activation tile computed as it is loaded, with the
    SiLU-and-mul kernel's arithmetic. The other arguments are ``gemv``'s (``w [N, K]``)."""
    if gate_up.dim() != 2 or gate_up.shape[1] != 2 * w.shape[1]:
        raise ValueError(f"gemv_silu_mul: gate_up must be [M, 2K] = [M, {2 * w.shape[1]}] for a weight of "
                         f"K={w.shape[1]} columns, got {tuple(gate_up.shape)}")
    return _gemv(gate_up, w, scale, block, config, bias, w8a8, None, None, act_in=True)


def _gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
          config: GemvConfig | None, bias: torch.Tensor | None, w8a8: bool | None, norm: _NormArgs | None,
          route: RouteOutputs | None, act_in: bool = False) -> torch.Tensor:
    """``act_in``: x is ``[M, 2K]`` gate | up (``gemv_silu_mul``)."""
    m, k = x.shape
    if act_in:
        k //= 2
    n = w.shape[0]
    if not 1 <= m <= GEMV_MAX_TOKENS:
        raise ValueError(f"gemv: M must be in 1..{GEMV_MAX_TOKENS}, got {m}")
    if w.shape[1] != k:
        raise ValueError(f"gemv: x has K={k} columns, the weight {w.shape[1]}")
    fp8 = w.dtype == torch.float8_e4m3fn
    if block is not None and not fp8:
        raise ValueError(f"gemv: block scales are for fp8 weights, not {w.dtype}")
    if w8a8 and not fp8:
        raise ValueError(f"gemv: w8a8 is for fp8 weights, not {w.dtype}")
    if not fp8 and x.dtype not in (w.dtype, torch.float32):
        raise ValueError(f"gemv: {w.dtype} weights multiply {w.dtype} or float32 activations, not {x.dtype}")
    if fp8 != (scale is not None):
        raise ValueError(f"gemv: {gemv_kind(w.dtype, block)} weights {'need' if fp8 else 'take no'} scale")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias must have shape ({n},), got {tuple(bias.shape)}")
    if route is not None:
        if not 1 <= route.routing.top_k <= n or n > MAX_ROUTED_EXPERTS:
            raise ValueError(f"gemv: routing {route.routing.top_k} of N={n} experts needs 1 <= top_k <= N <= "
                             f"{MAX_ROUTED_EXPERTS}")
        want = (m, route.routing.top_k)
        if (route.weights.shape != want or route.ids.shape != want or route.weights.dtype != torch.float32
                or route.ids.dtype != torch.int32 or not route.weights.is_contiguous()
                or not route.ids.is_contiguous()):
            raise ValueError(f"gemv: the routing outputs must be contiguous float32 and int32 of shape {want}")
    if x.stride(1) != 1:
        x = x.contiguous()
    if w.stride(1) != 1:
        raise ValueError("gemv: the weight's rows must be contiguous")
    device_name, num_sms = device_info(x)
    if w8a8 is None:
        w8a8 = fp8_w8a8_default()
    if fp8 and w8a8 is None:  # the weight-only entry says which form measured faster here
        if config is None:
            weight_only = get_config(gemv_kind(w.dtype, block), m, n, k, device_name, num_sms)
            w8a8 = weight_only.prefer_w8a8
            config = None if w8a8 else weight_only  # W8A8: its own table's entry
        else:
            w8a8 = config.prefer_w8a8
    w8a8 = fp8 and bool(w8a8) and (block is None or block[1] % W8A8_GROUP == 0)
    if config is None:
        config = get_config(gemv_kind(w.dtype, block, w8a8), m, n, k, device_name, num_sms)
    plan = plan_launch(m, n, k, block, config, w8a8)
    block_m, block_n, block_k, split_k, k_per_split = (plan.block_m, plan.block_n, plan.block_k, plan.split_k,
                                                        plan.k_per_split)
    bn_s, bk_s = block if block is not None else (1, 1)
    n_tiles = triton.cdiv(n, block_n)
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if split_k > 1:
        partials = torch.empty(split_k, m, n, dtype=torch.float32, device=x.device)
        counters = split_counters(x.device)
    else:
        partials = counters = out  # unused
    scale_arg = scale if scale is not None else out  # unused without scales
    bias_arg = bias.contiguous() if bias is not None else out  # unused without a bias
    pdl = use_pdl(x)
    prefetch = prefetch_row_bytes(plan, w.element_size()) if pdl and envs.GEMV_PREFETCH.get() else 0
    if norm is not None:
        norm_ptrs = (norm.residual if norm.residual is not None else out, norm.weight,
                     norm.residual_out if norm.residual_out is not None else out,
                     norm.normed if norm.normed is not None else out)  # ``out`` stands in for the unused ones
    else:
        norm_ptrs = (out, out, out, out)
    route_ptrs = ((route.weights, route.ids, route_counter(x.device)) if route is not None else (out, out, out))
    _gemv_kernel[(n_tiles, split_k)](
        x, w, scale_arg, out, bias_arg, partials, counters, m, n, k, x.stride(0), w.stride(0),
        scale.stride(0) if block is not None else 0, out.stride(0), k_per_split, split_k,
        *norm_ptrs, norm.eps if norm is not None else 0.0, *route_ptrs,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE=0 if scale is None else (2 if block is not None else 1), BN_SCALE=bn_s, BK_SCALE=bk_s,
        EVEN_K=plan.even_k, SPLIT=split_k > 1,
        NUM_STAGES=config.num_stages, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        GPU_FENCE=x.is_cuda, UPCAST_DOT=not x.is_cuda and (w8a8 or x.dtype == torch.bfloat16),
        W8A8=w8a8, ONE_ROW=plan.one_row, HAS_BIAS=bias is not None, FP8_MAX_V=FP8_MAX, MIN_S=MIN_SCALE,
        USE_PDL=pdl, PREFETCH_ROW_BYTES=prefetch, NORM=norm is not None,
        HAS_RES=norm is not None and norm.residual is not None,
        WRITE_NORMED=norm is not None and norm.normed is not None,
        NORM_BLOCK=min(triton.next_power_of_2(k), NORM_TILE) if norm is not None else 1,
        ROUTE=route is not None, TOP_K=route.routing.top_k if route is not None else 1,
        TOP_K_PAD=triton.next_power_of_2(route.routing.top_k) if route is not None else 1,
        SOFTMAX_FIRST=route is None or route.routing.softmax_first,
        RENORMALIZE=route is not None and route.routing.renormalize,
        BLOCK_E=triton.next_power_of_2(n) if route is not None else 1, ACT_IN=act_in,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    return out


@dataclass(frozen=True)
class GemvOperands:
    """A linear layer's weight as ``gemv`` / ``gemv_rmsnorm`` take it (``scale`` / ``block``: FP8 only)."""

    weight: torch.Tensor
    scale: torch.Tensor | None
    block: tuple[int, int] | None
    bias: torch.Tensor | None


def dense_gemv_applies(x: torch.Tensor, weight: torch.Tensor, use_gemv: bool) -> bool:
    """Whether ``dense_linear`` takes the GEMV for x's device and dtype (row count aside)."""
    return use_gemv and x.is_cuda and x.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16)


def dense_gemv_operands(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_gemv: bool
                        ) -> GemvOperands | None:
    """An unquantized layer's operands for a GEMV with a prologue (plait.layers.norm_linear): where
    ``dense_linear`` takes the GEMV, and off CUDA where tests run Triton ops in the interpreter
    (``use_triton``) on weights in x's dtype; else None."""
    if dense_gemv_applies(x, weight, use_gemv) or not x.is_cuda and use_triton(x) and x.dtype == weight.dtype:
        return GemvOperands(weight, None, None, bias)
    return None


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_gemv: bool) -> torch.Tensor:
    """``F.linear`` of an unquantized layer, or, with ``use_gemv`` (``PLAIT_BF16_GEMV=1``), the GEMV for
    decode-sized batches (1..16 tokens) of bf16 / fp16 weights on CUDA in the weights' dtype (the bias
    added in its epilogue)."""
    if dense_gemv_applies(x, weight, use_gemv):
        x2 = x.reshape(-1, x.shape[-1])
        if 1 <= x2.shape[0] <= GEMV_MAX_TOKENS:
            return gemv(x2, weight, bias=bias).view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)
