"""FP8 matmul kernels and their references.

Weights are ``float8_e4m3fn [N, K]`` (row-major, as checkpoints store them) with one of two scale
layouts (``W = q * s``):
  channel  ``scale [N]`` fp32: one scale per output row
  block    ``scale [ceil(N / bn), ceil(K / bk)]`` fp32: one scale per ``bn x bk`` tile (128 x 128)

Paths (``fp8_linear`` picks one):
  GEMV    few tokens (decode): ``plait.layers.quantization.gemv.gemv``, one launch that reads the FP8
          weight once, with configs tuned per shape, in the form its table marks faster for the case
          (``PLAIT_FP8_GEMV_W8A8`` forces one): W8A8 quantizes the activations to e4m3 per token and
          128-column group inside the kernel and multiplies e4m3 x e4m3 on the tensor cores
          (``reference_w8a8_gemv`` is what it computes); weight-only converts the weight in registers
          and multiplies the activations as they are. The layer's bias is added in its epilogue.
  GEMM    many tokens (prefill): activations are quantized to FP8 (per token for channel weights,
          per token and 128-column group for block weights, or a checkpoint's static per-tensor
          scale), then ``torch._scaled_mm`` with rowwise scales (channel) or ``w8a8_block_matmul``,
          a Triton kernel applying both block scales per K tile (block).
  CPU     the dequantizing reference: the fp32 dequantized weight times the activations as they are
          (the weight-only GEMV's arithmetic, exact in fp32). Activations are not quantized there: a dynamic
          quantizer is discontinuous, and two fp32 computations of one model that differ in the last
          bit before it (a different summation order) drift apart layer over layer once rounding
          steps flip, so a simulation could not be compared with it token for token.
          ``reference_fp8_linear`` (activations quantized as the GEMM path does) is the kernels'
          reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.layers.quantization.gemv import FP8_DTYPE, FP8_MAX, MIN_SCALE, W8A8_GROUP, gemv
from plait.layers.quantization.gemv_config import GEMV_MAX_TOKENS

__all__ = ["FP8_DTYPE", "FP8_MAX", "MIN_SCALE"]  # defined beside the GEMV, which quantizes too


# --- quantizers (torch; shared by the GPU GEMM path and the reference) ----------------------------
@triton.jit
def _quantize_groups_kernel(X, Q, S, K, stride_xm, stride_qm, stride_sm, FP8_MAX_V: tl.constexpr,
                            GROUP: tl.constexpr, BLOCK: tl.constexpr, MIN_S: tl.constexpr):
    """Program (row, group): scale = max|x| / FP8_MAX over columns [g * GROUP, (g + 1) * GROUP) of the
    row, then q = x / scale saturated. Two passes over the group (max, then quantize), BLOCK at a time."""
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1)
    lo = g * GROUP
    hi = tl.minimum(lo + GROUP, K)
    amax = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(lo, hi, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_xm + offs, mask=offs < hi, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX_V, MIN_S)
    for k0 in range(lo, hi, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(X + row * stride_xm + offs, mask=offs < hi, other=0.0).to(tl.float32)
        q = tl.clamp(x / scale, -FP8_MAX_V, FP8_MAX_V)
        tl.store(Q + row * stride_qm + offs, q.to(Q.dtype.element_ty), mask=offs < hi)
    tl.store(S + row * stride_sm + g, scale)


def quantize_rows_triton(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``quantize_rows`` in one launch: a program per (row, group)."""
    m, k = x.shape
    if x.stride(1) != 1:
        x = x.contiguous()
    g = k if group is None else group
    groups = -(-k // g)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    if m:
        _quantize_groups_kernel[(m, groups)](x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0),
                                             FP8_MAX_V=FP8_MAX, GROUP=g, BLOCK=min(1024, triton.next_power_of_2(g)),
                                             MIN_S=MIN_SCALE, num_warps=4)
    return q, scale


def quantize_rows(x: torch.Tensor, group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic symmetric FP8 quantization of ``x [M, K]``: per row (``group`` None: scale ``[M, 1]``)
    or per row and ``group``-column group (scale ``[M, ceil(K / group)]``). ``x ~= q * scale``.
    One Triton launch on a GPU (``quantize_rows_triton``); torch ops on the CPU."""
    if x.device.type == "cuda":
        return quantize_rows_triton(x, group)
    m, k = x.shape
    xf = x.float()
    if group is None:
        scale = (xf.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=MIN_SCALE)
        return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE), scale
    groups = -(-k // group)
    padded = torch.nn.functional.pad(xf, (0, groups * group - k)).view(m, groups, group)
    scale = (padded.abs().amax(dim=2) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (padded / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, groups * group)[:, :k]
    return q.contiguous(), scale


def quantize_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 with a fixed per-tensor ``scale`` (a checkpoint's ``input_scale``)."""
    return (x.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_weight_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Online quantization of a bf16/fp16/fp32 weight ``[N, K]``: FP8 rows and their scales ``[N]``."""
    q, scale = quantize_rows(w)
    return q, scale.view(-1)


def dequantize_weight(q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None) -> torch.Tensor:
    """fp32 ``W = q * s`` of a channel (``scale [N]``) or block (``scale [nb, kb]``) FP8 weight."""
    wf = q.float()
    if block is None:
        return wf * scale.view(-1, 1).float()
    bn, bk = block
    n, k = wf.shape
    full = scale.float().repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return wf * full


def quantize_dequantize_rows(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """fp32 ``x`` after ``quantize_rows`` (per row, or per row and ``group`` columns) and back."""
    xq, xs = quantize_rows(x, group)
    if group is None:
        return xq.float() * xs
    return xq.float() * xs.repeat_interleave(group, dim=1)[:, : x.shape[1]]


def reference_fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
                         input_scale: torch.Tensor | None) -> torch.Tensor:
    """The CPU path and the kernels' reference, ``x [M, K] -> [M, N]`` in fp32: activations
    quantized and dequantized exactly as the GPU GEMM quantizes them, times the dequantized weight."""
    if input_scale is not None:
        xd = quantize_static(x, input_scale).float() * input_scale.float()
    else:
        xd = quantize_dequantize_rows(x, None if block is None else block[1])
    return xd @ dequantize_weight(q, scale, block).t()


def reference_w8a8_gemv(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                        block: tuple[int, int] | None) -> torch.Tensor:
    """What the GEMV's W8A8 form computes, in fp32: activations quantized per row and ``W8A8_GROUP``
    columns (for channel and block weights alike), times the dequantized weight."""
    return quantize_dequantize_rows(x, W8A8_GROUP) @ dequantize_weight(q, scale, block).t()


# --- block-scaled W8A8 GEMM ------------------------------------------------------------------------
@triton.jit
def _w8a8_block_matmul_kernel(
    A,  # [M, K] fp8
    B,  # [N, K] fp8
    C,  # [M, N]
    As,  # [M, ceil(K / BK_SCALE)] fp32
    Bs,  # [ceil(N / BN_SCALE), ceil(K / BK_SCALE)] fp32
    M,
    N,
    K,
    stride_am,
    stride_bn,
    stride_cm,
    stride_asm,
    stride_bsn,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # == BK_SCALE: one scale pair per K tile
    BN_SCALE: tl.constexpr,
    GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row tiles share each column tile while it is in L2.
    group = GROUP_M * num_n
    first_m = (pid // group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group) % size_m
    pid_n = (pid % group) // size_m
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = A + offs_m.to(tl.int64)[:, None] * stride_am
    b_ptrs = B + offs_n.to(tl.int64)[:, None] * stride_bn
    as_ptrs = As + offs_m * stride_asm
    bs_ptrs = Bs + (offs_n // BN_SCALE) * stride_bsn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(a_ptrs + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(b_ptrs + offs_k[None, :], mask=mask_n[:, None] & mask_k[None, :], other=0.0)
        a_s = tl.load(as_ptrs + kb, mask=mask_m, other=0.0)
        b_s = tl.load(bs_ptrs + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, tl.trans(b)) * a_s[:, None] * b_s[None, :]
    c = C + offs_m.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(C.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def w8a8_block_matmul(a: torch.Tensor, a_scale: torch.Tensor, b: torch.Tensor, b_scale: torch.Tensor,
                      block: tuple[int, int], out_dtype: torch.dtype,
                      config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """``(a * a_scale) @ (b * b_scale).T``: a ``[M, K]`` fp8 with per-token-group scales ``[M, K/bk]``,
    b ``[N, K]`` fp8 with block scales ``[N/bn, K/bk]``; -> ``[M, N]`` in ``out_dtype``."""
    m, k = a.shape
    n = b.shape[0]
    bn, bk = block
    if config is None:
        block_m = 64 if m <= 64 else 128
        config = (block_m, 128, 4 if block_m == 64 else 8, 3)
    block_m, block_n, warps, stages = config
    if bn % block_n and block_n % bn:
        raise ValueError(f"w8a8_block_matmul: BLOCK_N {block_n} and the scale block {bn} must nest")
    c = torch.empty(m, n, dtype=out_dtype, device=a.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    _w8a8_block_matmul_kernel[grid](
        a, b, c, a_scale, b_scale, m, n, k, a.stride(0), b.stride(0), c.stride(0), a_scale.stride(0),
        b_scale.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk, BN_SCALE=bn, GROUP_M=8,
        num_warps=warps, num_stages=stages)
    return c


# --- dispatch ------------------------------------------------------------------------------------
def scaled_mm_rowwise(xq: torch.Tensor, x_scale: torch.Tensor, q: torch.Tensor, scale: torch.Tensor,
                      out_dtype: torch.dtype) -> torch.Tensor:
    """cuBLAS FP8 GEMM with a scale per token ``[M, 1]`` and per output channel ``[1, N]``."""
    return torch._scaled_mm(xq, q.t(), scale_a=x_scale.float().contiguous(),
                            scale_b=scale.float().view(1, -1), out_dtype=out_dtype)


def fp8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None,
               input_scale: torch.Tensor | None, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [..., K] -> [..., N]`` through the path for the device and the token count (module doc)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    m = x2.shape[0]
    if m == 0:
        out = x2.new_empty(0, q.shape[0])
    elif x.device.type != "cuda":
        out = (x2.float() @ dequantize_weight(q, scale, block).t()).to(x.dtype)
    elif m <= GEMV_MAX_TOKENS:
        out = gemv(x2, q, scale, block, bias=bias)
        bias = None  # added in the GEMV's epilogue
    elif block is not None:
        xq, xs = quantize_rows(x2, block[1])
        out = w8a8_block_matmul(xq, xs, q, scale, block, x.dtype)
    else:
        if input_scale is not None:
            xq, xs = quantize_static(x2, input_scale), input_scale.float().expand(m, 1)
        else:
            xq, xs = quantize_rows(x2)
        out = scaled_mm_rowwise(xq, xs, q, scale, x.dtype if x.dtype != torch.float32 else torch.bfloat16
                                ).to(x.dtype)
    if bias is not None:
        out = out + bias
    return out.view(*shape[:-1], q.shape[0])
