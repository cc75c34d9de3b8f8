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
           nothing) with the converted weight tile; with ``GemvConfig.swap_ab`` (where the tuner found
           it faster) the operands swapped, ``W [BLOCK_N, BLOCK_K] @ x^T``: the weight rows are the
           MMA's M (16 per warp, so on sm_90 one warpgroup MMA per 4 warps, its B the activations)
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
from plait.layers.pdl import pdl_prologue, use_pdl
from plait.layers.quantization.gemv_config import (
    GEMV_MAX_TOKENS,
    GemvConfig,
    gemv_kind,
    gemv_takes,
    get_config,
)
from plait.layers.tuned_configs import device_info

# Row tiles one split-K launch may count (int32 each): gate_up of a 70b model at BLOCK_N 4 needs 14k.
MAX_COUNTERS = 1 << 16
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Smallest scale a quantizer hands out: an all-zero row quantizes to zeros, not NaN.
MIN_SCALE = 1e-12
# Columns per activation scale of the W8A8 form (one K step each): the block path's group width.
W8A8_GROUP = 128


def fp8_w8a8_default() -> bool | None:
    """The FP8 form when a call does not say, the one switch (``PLAIT_FP8_GEMV_W8A8``): True W8A8, False
    weight-only, None (unset) the launch config's ``prefer_w8a8`` (the tuned table's measured choice per
    shape and token bucket; weight-only where it has none)."""
    return envs.FP8_GEMV_W8A8.get()


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
    SWAP_AB: tl.constexpr,  # the tensor-core form with the weight rows as the dot's M (module docstring)
    HAS_BIAS: tl.constexpr,
    FP8_MAX_V: tl.constexpr,
    MIN_S: tl.constexpr,
    USE_PDL: tl.constexpr = False,
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
    w_rows = W + rows.to(tl.int64)[:, None] * stride_wn
    if SCALE == 2:
        s_rows = S + (rows // BN_SCALE) * stride_sn
    pdl_prologue(USE_PDL)
    if BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif W8A8 or SWAP_AB:
        acc_t = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        if ONE_ROW:
            offs_k0 = k_lo + tl.arange(0, BLOCK_K)
            x_next = tl.load(X + offs_k0, mask=offs_k0 < k_hi, other=0.0)
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
        if BLOCK_M == 1:
            if EVEN_K:
                x = tl.load(X + offs_k)
            else:
                x = tl.load(X + offs_k, mask=offs_k < k_hi, other=0.0)
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
        elif SWAP_AB:
            if UPCAST_DOT:  # as below: the interpreter's bf16 dot
                part = tl.dot(w.to(tl.float32), tl.trans(x.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(w.to(x.dtype), tl.trans(x), input_precision=INPUT_PRECISION)
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
    elif W8A8 or SWAP_AB:
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
    else:
        if SCALE == 1:
            acc = acc * tl.load(S + rows)[None, :]
        if HAS_BIAS:
            acc = acc + tl.load(Bias + rows).to(tl.float32)[None, :]
        tl.store(out_ptrs, acc.to(Out.dtype.element_ty), mask=out_mask)


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
    swap_ab: bool = False  # the tensor-core form with the weight rows as the dot's M

    def compile_key(self) -> tuple[bool, int, int, bool, bool, int, int, bool, bool, bool]:
        """What the compiled kernel depends on besides the dtypes and the scale layout."""
        return (self.block_m == 1, self.block_n, self.block_k, self.even_k, self.split_k > 1, self.num_warps,
                self.num_stages, self.w8a8, self.one_row, self.swap_ab)


@functools.lru_cache(maxsize=4096)
def plan_launch(m: int, n: int, k: int, block: tuple[int, int] | None, config: GemvConfig,
                w8a8: bool = False) -> GemvLaunch:
    """``config`` made launchable for an (M, N, K) call: 16+ rows and columns for the tensor-core form
    (M >= 2, and every M with ``w8a8``), a step inside one scale block (block scales), with ``w8a8`` a
    step of exactly one ``W8A8_GROUP``-column activation group and 16+ weight rows per warp, and K
    slices of whole steps. ``config.swap_ab`` takes the swapped tensor-core form at M >= 2 (not with
    ``w8a8``, whose dot is swapped already), with 16+ weight rows per warp as W8A8. Cached: eager decode
    steps plan every layer's call."""
    block_m = 1 if m == 1 and not w8a8 else max(16, triton.next_power_of_2(m))
    block_n = config.block_n if block_m == 1 else max(16, config.block_n)
    swap_ab = config.swap_ab and block_m > 1 and not w8a8
    if w8a8 or swap_ab:  # the weight rows are the dot's M: 16 per warp, so the warps form whole warpgroup MMAs
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
                      config.num_stages, w8a8, w8a8 and m == 1, swap_ab)


_COUNTERS: dict[torch.device, torch.Tensor] = {}


def split_counters(device: torch.device) -> torch.Tensor:
    """The device's split-K counters (module docstring): allocated zero once, kept zero by the kernel.
    The first split-K launch on a device happens eagerly (the engine's warm-up runs before capture)."""
    counters = _COUNTERS.get(device)
    if counters is None:
        counters = _COUNTERS[device] = torch.zeros(MAX_COUNTERS, dtype=torch.int32, device=device)
    return counters


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None = None, block: tuple[int, int] | None = None,
         config: GemvConfig | None = None, bias: torch.Tensor | None = None, w8a8: bool | None = None
         ) -> torch.Tensor:
    """``x [M, K] @ (W * scale).T (+ bias) -> [M, N]`` in x's dtype for ``1 <= M <= 16``.

    ``w`` fp8 e4m3 with ``scale`` ``[N]`` (channel, ``block`` None) or ``[ceil(N / bn), ceil(K / bk)]``
    (``block`` (bn, bk)); or bf16 / fp16 with ``scale`` None. ``bias [N]`` is added in the epilogue.
    ``w8a8`` (FP8 weights only): True quantizes the activations per row and 128-column group and
    multiplies e4m3 x e4m3 on the tensor cores; False: weight-only dequantization; None:
    ``fp8_w8a8_default()``, and where that is unset too, the weight-only table entry's ``prefer_w8a8``
    (the form measured faster for this case; an explicit ``config``'s own flag, launched as given).
    Block scales narrower than, or not a multiple of, 128 columns take the weight-only form. ``config``
    overrides the tuned / default launch config (the tuner, tests)."""
    m, k = x.shape
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
    _gemv_kernel[(n_tiles, split_k)](
        x, w, scale_arg, out, bias_arg, partials, counters, m, n, k, x.stride(0), w.stride(0),
        scale.stride(0) if block is not None else 0, out.stride(0), k_per_split, split_k,
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        SCALE=0 if scale is None else (2 if block is not None else 1), BN_SCALE=bn_s, BK_SCALE=bk_s,
        EVEN_K=plan.even_k, SPLIT=split_k > 1,
        NUM_STAGES=config.num_stages, INPUT_PRECISION="ieee" if x.dtype == torch.float32 else None,
        GPU_FENCE=x.is_cuda, UPCAST_DOT=not x.is_cuda and (w8a8 or x.dtype == torch.bfloat16),
        W8A8=w8a8, ONE_ROW=plan.one_row, SWAP_AB=plan.swap_ab, HAS_BIAS=bias is not None, FP8_MAX_V=FP8_MAX,
        MIN_S=MIN_SCALE,
        USE_PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl)
    return out


def dense_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, use_gemv: bool) -> torch.Tensor:
    """``F.linear`` of an unquantized layer, or, with ``use_gemv`` (``PLAIT_BF16_GEMV=1``), the GEMV for
    decode-sized batches of bf16 / fp16 weights on CUDA in the weights' dtype (the bias added in its
    epilogue): one token always, 2..16 tokens where this device's table says the GEMV is faster there
    (``gemv_takes``). Untuned, the tensor-core form's default tiles read the weights slower than
    cuBLAS's small-N kernels (docs/benchmarks.md, "The GEMV against cuBLAS")."""
    if use_gemv and x.is_cuda and x.dtype == weight.dtype and weight.dtype in (torch.bfloat16, torch.float16):
        x2 = x.reshape(-1, x.shape[-1])
        if gemv_takes(gemv_kind(weight.dtype, None), x2.shape[0], weight.shape[0], weight.shape[1],
                      device_info(x)[0]):
            return gemv(x2, weight, bias=bias).view(*x.shape[:-1], weight.shape[0])
    return torch.nn.functional.linear(x, weight, bias)
