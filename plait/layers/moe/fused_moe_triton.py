"""The fused MoE expert computation on the GPU: a Triton pipeline in SGLang's / vLLM's style.

Same signature and semantics as ``reference.fused_experts_reference``. For T tokens with K experts
each (P = T * K (token, expert) pairs, pair ``p = t * K + k``):

1. ``moe_align_block_size``: the pairs sorted by expert, each expert's run padded to ``block_m``
   rows; pairs whose expert id is outside [0, E) are dropped there.
2. grouped gate/up GEMM (``fused_moe_kernel``): each program takes one block of one expert's rows
   and a ``block_n`` slice of its w13, so only the experts that received pairs are read; ``b13`` is
   added in the epilogue. Either writes gate|up [P, 2I] and
3. the activation runs as its own kernel ([P, 2I] -> [P, I]), or (``fuse_activation``) the program
   accumulates the matching gate and up columns side by side and applies the activation in the
   epilogue, writing [P, I] directly;
4. grouped down GEMM: [P, I] x w2 -> [P, H], ``b2`` added, then multiplied by the pair's routing
   weight (MUL_ROUTED_WEIGHT);
5. the top-k reduction: out[t] = sum over k of row t * K + k, skipping dropped pairs.

Every buffer's size depends only on T, K, E, the shapes and the launch config (never on the
routing), and no step reads a device value on the host, so the whole call is CUDA-graph capturable.
The launch config comes from ``kernel_config.get_config`` (tuned JSON per shape and device).
Small batches (few pairs against many experts, decode) skip the alignment instead: ``small_batch``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from plait.layers.moe.activation_triton import activate
from plait.layers.moe.align import max_padded_size, moe_align_block_size
from plait.layers.moe.kernel_config import FP8_DTYPE_KEY, MoeKernelConfig, get_config
from plait.layers.moe.reference import ACTIVATIONS, EXPERT_FP8_BLOCK, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from plait.layers.moe.small_batch import fused_experts_small_batch, get_small_batch_config, small_batch_plan
from plait.layers.pdl import pdl_prologue, use_pdl
from plait.layers.quantization.fp8_kernels import FP8_DTYPE, quantize_rows_triton

# Larger batches run in chunks of this many tokens so the [P, 2I] intermediates stay bounded.
CHUNK_TOKENS = 16384

_NO_ACTIVATION = -1
_ACTIVATION_CODE = {name: code for code, name in enumerate(ACTIVATIONS)}  # silu 0, swiglu_oai 1
_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz",
                                                "float8_e5m2fnuz") if hasattr(torch, n))
_SUPPORTED_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


@triton.jit(do_not_specialize=["EM", "num_valid_tokens"])
def fused_moe_kernel(
    A, B, C, Bias, topk_weights, sorted_token_ids, expert_ids, num_tokens_post_padded, A_scale, B_scale,
    N, K, EM, num_valid_tokens, num_experts, up_offset,
    stride_am, stride_ak, stride_be, stride_bn, stride_bk, stride_cm, stride_cn, stride_bias_e,
    stride_asm, stride_bse, stride_bsn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    A_ROW_DIV: tl.constexpr, MUL_ROUTED_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    ACTIVATION: tl.constexpr, EVEN_K: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr,
    USE_FP8: tl.constexpr = False, SCALE_BLOCK: tl.constexpr = 128, USE_PDL: tl.constexpr = False,
):
    """C[pair, n] = (A[pair // A_ROW_DIV] @ B[expert].T)[n] (+ Bias[expert, n]) (* weight[pair]).

    A [*, K]; B [E, rows, K] (row n of expert e is output column n); C [P, N]. Program (pid_m, pid_n)
    covers rows pid_m * BLOCK_M.. of the aligned layout (one expert) and columns pid_n * BLOCK_N...
    With ACTIVATION >= 0, N is the activation's width I: column n accumulates B rows n (gate) and
    up_offset + n (up) and stores act(gate) * up.

    USE_FP8 (W8A8, block scales): A and B are float8_e4m3fn, A_scale [*, ceil(K / SCALE_BLOCK)] one
    fp32 multiplier per A row and K group, B_scale [E, ceil(rows / SCALE_BLOCK), ceil(K / SCALE_BLOCK)]
    one per expert, row block and K group; BLOCK_K divides SCALE_BLOCK, so each K tile lies in one
    group and its fp32 product is scaled by a_scale[row] * b_scale[n block] before it accumulates.
    """
    pdl_prologue(USE_PDL)
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(EM, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    # Grouped ordering: GROUP_M row blocks sweep the columns together, so a B tile is reused from L2.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m
    if pid_m * BLOCK_M >= tl.load(num_tokens_post_padded):
        return
    expert = tl.load(expert_ids + pid_m).to(tl.int64)
    if expert >= num_experts:
        return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_token = tl.load(sorted_token_ids + offs_m).to(tl.int64)
    token_mask = offs_token < num_valid_tokens
    # Columns wrap modulo N so the B loads need no mask; the store masks the wrapped ones.
    offs_bn = ((pid_n * BLOCK_N + tl.arange(0, BLOCK_N)) % N).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = A + (offs_token[:, None] // A_ROW_DIV) * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = B + expert * stride_be + offs_k[:, None] * stride_bk + offs_bn[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    up_ptrs = b_ptrs + up_offset * stride_bn
    if USE_FP8:
        as_ptrs = A_scale + (offs_token // A_ROW_DIV) * stride_asm
        bs_ptrs = B_scale + expert * stride_bse + (offs_bn // SCALE_BLOCK) * stride_bsn
        bs_up_ptrs = B_scale + expert * stride_bse + ((offs_bn + up_offset) // SCALE_BLOCK) * stride_bsn
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=token_mask[:, None], other=0.0)
            b = tl.load(b_ptrs)
        else:
            k_mask = offs_k < K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=token_mask[:, None] & k_mask[None, :], other=0.0)
            b = tl.load(b_ptrs, mask=k_mask[:, None], other=0.0)
        if USE_FP8:
            group = (k * BLOCK_K) // SCALE_BLOCK
            a_s = tl.load(as_ptrs + group, mask=token_mask, other=0.0)
            b_s = tl.load(bs_ptrs + group)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        else:
            acc = tl.dot(a, b, acc)
        if ACTIVATION >= 0:
            if EVEN_K:
                b_up = tl.load(up_ptrs)
            else:
                b_up = tl.load(up_ptrs, mask=k_mask[:, None], other=0.0)
            if USE_FP8:
                acc_up += tl.dot(a, b_up) * a_s[:, None] * tl.load(bs_up_ptrs + group)[None, :]
            else:
                acc_up = tl.dot(a, b_up, acc_up)
            up_ptrs += BLOCK_K * stride_bk
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    if HAS_BIAS:
        bias_ptrs = Bias + expert * stride_bias_e + offs_bn
        acc += tl.load(bias_ptrs).to(tl.float32)[None, :]
        if ACTIVATION >= 0:
            acc_up += tl.load(bias_ptrs + up_offset).to(tl.float32)[None, :]
    if ACTIVATION >= 0:
        acc = activate(acc, acc_up, ACTIVATION, ALPHA, LIMIT)
    if MUL_ROUTED_WEIGHT:
        weight = tl.load(topk_weights + offs_token, mask=token_mask, other=0.0)
        acc = acc * weight.to(tl.float32)[:, None]
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    c_ptrs = C + offs_token[:, None] * stride_cm + offs_cn[None, :] * stride_cn
    tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=token_mask[:, None] & (offs_cn[None, :] < N))


@triton.jit(do_not_specialize=["n_rows"])
def _moe_activation_kernel(X, Y, topk_ids, n_rows, n, num_experts, stride_x, stride_y, ACTIVATION: tl.constexpr,
                           ALPHA: tl.constexpr, LIMIT: tl.constexpr, BLOCK: tl.constexpr,
                           USE_PDL: tl.constexpr = False):
    """Y[row, :n] = act(X[row, :n], X[row, n:2n]) for each pair row whose expert is in [0, E) (the
    GEMM wrote no other row)."""
    pdl_prologue(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    expert = tl.load(topk_ids + row)
    if (expert < 0) | (expert >= num_experts):
        return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    gate = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(X + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    y = activate(gate, up, ACTIVATION, ALPHA, LIMIT)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["n_tokens"])
def _moe_sum_kernel(X, topk_ids, Y, n_tokens, H, num_experts, stride_x, stride_y,
                    TOP_K: tl.constexpr, BLOCK_H: tl.constexpr, USE_PDL: tl.constexpr = False):
    """Y[t] = sum over k of X[t * TOP_K + k] in fp32, skipping pairs whose expert is outside [0, E)
    (their rows of X were never written)."""
    pdl_prologue(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros((BLOCK_H,), dtype=tl.float32)
    for k in tl.static_range(TOP_K):
        expert = tl.load(topk_ids + t * TOP_K + k)
        valid = (expert >= 0) & (expert < num_experts)
        x = tl.load(X + (t * TOP_K + k) * stride_x + cols, mask=mask & valid, other=0.0)
        acc += x.to(tl.float32)
    tl.store(Y + t * stride_y + cols, acc.to(Y.dtype.element_ty), mask=mask)


def invoke_fused_moe_kernel(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, bias: torch.Tensor | None,
                            topk_weights: torch.Tensor | None, sorted_token_ids: torch.Tensor,
                            expert_ids: torch.Tensor, num_tokens_post_padded: torch.Tensor,
                            a_row_div: int, activation: str | None, config: MoeKernelConfig,
                            a_scale: torch.Tensor | None = None, b_scale: torch.Tensor | None = None) -> None:
    """One grouped GEMM launch into ``c`` [P, N] (N = c.shape[1]); see ``fused_moe_kernel``.

    ``topk_weights`` [P] float32 multiplies each row when given; ``activation`` fuses the activation
    (then b holds 2N rows per expert: gate rows [0, N), up rows [N, 2N)). ``a_scale`` / ``b_scale``:
    FP8 ``a`` and ``b`` with their block scales (both or neither)."""
    num_experts, _, k = b.shape
    n = c.shape[1]
    em = sorted_token_ids.shape[0]
    num_pairs = c.shape[0]
    fp8 = b_scale is not None
    if fp8 and (a_scale is None or not fp8_block_k_ok(config.block_k)):
        raise ValueError(f"FP8 experts need the activations' scales and a block_k of 32, 64 or 128 (dividing the "
                         f"{EXPERT_FP8_BLOCK}-column scale group; got block_k {config.block_k})")
    grid = (triton.cdiv(em, config.block_m) * triton.cdiv(n, config.block_n),)
    pdl = use_pdl(a)
    fused_moe_kernel[grid](
        a, b, c, bias if bias is not None else b, topk_weights if topk_weights is not None else c,
        sorted_token_ids, expert_ids, num_tokens_post_padded,
        a_scale if fp8 else c, b_scale if fp8 else c,
        n, k, em, num_pairs, num_experts, n,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), b.stride(2), c.stride(0), c.stride(1),
        bias.stride(0) if bias is not None else 0,
        a_scale.stride(0) if fp8 else 0, b_scale.stride(0) if fp8 else 0, b_scale.stride(1) if fp8 else 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k, GROUP_M=config.group_m,
        A_ROW_DIV=a_row_div, MUL_ROUTED_WEIGHT=topk_weights is not None, HAS_BIAS=bias is not None,
        ACTIVATION=_NO_ACTIVATION if activation is None else _ACTIVATION_CODE[activation],
        EVEN_K=k % config.block_k == 0, ALPHA=SWIGLU_OAI_ALPHA, LIMIT=SWIGLU_OAI_LIMIT,
        USE_FP8=fp8, SCALE_BLOCK=EXPERT_FP8_BLOCK, USE_PDL=pdl,
        num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
    )


def moe_activation(gate_up: torch.Tensor, out: torch.Tensor, topk_ids: torch.Tensor, num_experts: int,
                   activation: str) -> None:
    """[P, 2I] gate|up -> ``out`` [P, I] for the pairs whose expert (``topk_ids`` [T, K], contiguous)
    is in [0, E); the other rows of ``out`` stay unwritten."""
    n_rows, n = out.shape
    block = min(1024, triton.next_power_of_2(n))
    if n_rows:
        pdl = use_pdl(gate_up)
        _moe_activation_kernel[(n_rows, triton.cdiv(n, block))](
            gate_up, out, topk_ids, n_rows, n, num_experts, gate_up.stride(0), out.stride(0),
            ACTIVATION=_ACTIVATION_CODE[activation],
            ALPHA=SWIGLU_OAI_ALPHA, LIMIT=SWIGLU_OAI_LIMIT, BLOCK=block, USE_PDL=pdl, launch_pdl=pdl)


def moe_sum(pair_out: torch.Tensor, topk_ids: torch.Tensor, out: torch.Tensor, num_experts: int) -> None:
    """[T * K, H] per-pair outputs -> ``out`` [T, H], summed over each token's valid pairs."""
    n_tokens, hidden = out.shape
    top_k = topk_ids.shape[1]
    block = min(1024, triton.next_power_of_2(hidden))
    if n_tokens:
        pdl = use_pdl(out)
        _moe_sum_kernel[(n_tokens, triton.cdiv(hidden, block))](
            pair_out, topk_ids, out, n_tokens, hidden, num_experts, pair_out.stride(0), out.stride(0),
            TOP_K=top_k, BLOCK_H=block, USE_PDL=pdl, launch_pdl=pdl)


def fp8_block_k_ok(block_k: int) -> bool:
    """Whether an FP8 GEMM's K tile fits the scale groups: one group per tile (divides 128) and at
    least the 32 an FP8 tensor-core MMA consumes per step."""
    return 32 <= block_k <= EXPERT_FP8_BLOCK and EXPERT_FP8_BLOCK % block_k == 0


def fp8_scale_shape(num_experts: int, rows: int, cols: int) -> tuple[int, int, int]:
    """The block scales of FP8 expert matrices [E, rows, cols]: one per 128 x 128 block."""
    b = EXPERT_FP8_BLOCK
    return num_experts, -(-rows // b), -(-cols // b)


def check_expert_inputs(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                        topk_weights: torch.Tensor, topk_ids: torch.Tensor, activation: str,
                        b13: torch.Tensor | None, b2: torch.Tensor | None,
                        w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> None:
    """Shape and dtype checks (host metadata only, so they cost nothing under graph capture)."""
    fp8 = w13_scale is not None or w2_scale is not None
    if fp8:
        if w13.dtype != FP8_DTYPE or w2.dtype != FP8_DTYPE or w13_scale is None or w2_scale is None:
            raise ValueError(f"block-FP8 experts need float8_e4m3fn w13 and w2 with both scales (got w13 "
                             f"{w13.dtype}, w2 {w2.dtype}, w13_scale {w13_scale is not None}, w2_scale "
                             f"{w2_scale is not None})")
        for name, w, sc in (("w13_scale", w13, w13_scale), ("w2_scale", w2, w2_scale)):
            want = fp8_scale_shape(*w.shape)
            if tuple(sc.shape) != want or sc.dtype != torch.float32:
                raise ValueError(f"{name} must be float32 {want} (one per 128 x 128 block of {tuple(w.shape)}), "
                                 f"got {sc.dtype} {tuple(sc.shape)}")
    elif w13.dtype in _FP8_DTYPES or w2.dtype in _FP8_DTYPES:
        raise ValueError(
            f"fused_experts_triton: FP8 expert weights (w13 {w13.dtype}, w2 {w2.dtype}) need their block "
            "scales (w13_scale, w2_scale: the 128 x 128 block-FP8 layout of checkpoints such as Qwen3-30B-A3B-FP8)")
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, got {activation!r}")
    if hidden_states.dtype not in _SUPPORTED_DTYPES:
        raise ValueError(f"hidden_states dtype must be one of {_SUPPORTED_DTYPES}, got {hidden_states.dtype}")
    if not fp8 and (w13.dtype != hidden_states.dtype or w2.dtype != hidden_states.dtype):
        raise ValueError(f"w13 ({w13.dtype}) and w2 ({w2.dtype}) must have hidden_states' dtype "
                         f"({hidden_states.dtype})")
    if hidden_states.dim() != 2 or w13.dim() != 3 or w2.dim() != 3:
        raise ValueError(f"want hidden_states [T, H], w13 [E, 2*I, H], w2 [E, H, I]; got "
                         f"{tuple(hidden_states.shape)}, {tuple(w13.shape)}, {tuple(w2.shape)}")
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    if (w13.shape[2] != hidden or tuple(w2.shape) != (num_experts, hidden, two_i // 2)
            or two_i % 2):
        raise ValueError(f"expert weights do not match: hidden {hidden}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w13 [E, 2*I, H] and w2 [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.dim() != 2 or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={num_tokens}, K]")
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"topk_ids must be int32 or int64, got {topk_ids.dtype}")
    if b13 is not None and tuple(b13.shape) != (num_experts, two_i):
        raise ValueError(f"b13 must be [E, 2*I] = {(num_experts, two_i)}, got {tuple(b13.shape)}")
    if b2 is not None and tuple(b2.shape) != (num_experts, hidden):
        raise ValueError(f"b2 must be [E, H] = {(num_experts, hidden)}, got {tuple(b2.shape)}")
    tensors = (hidden_states, w13, w2, topk_weights, topk_ids, b13, b2, w13_scale, w2_scale)
    if len({t.device for t in tensors if t is not None}) != 1:
        raise ValueError("fused_experts_triton: all tensors must be on one device")


@functools.cache
def device_name_of(device: torch.device) -> str:
    """The name tuned config files key a device by (``cpu`` off CUDA)."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


def fused_experts_with_config(
    hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, b13: torch.Tensor | None, b2: torch.Tensor | None,
    config: MoeKernelConfig, w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``fused_experts_triton`` with an explicit launch config (the tuner and the tests pick one).
    Block-FP8 experts (``w13_scale`` / ``w2_scale``) run W8A8: the hidden states and the activation
    output are quantized per token per 128 columns (one launch each) before their grouped GEMM."""
    check_expert_inputs(hidden_states, w13, w2, topk_weights, topk_ids, activation, b13, b2, w13_scale, w2_scale)
    fp8 = w13_scale is not None
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    out = torch.empty(num_tokens, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    weights = topk_weights.to(torch.float32).contiguous()
    ids = topk_ids.contiguous()
    for start in range(0, num_tokens, CHUNK_TOKENS):
        end = min(start + CHUNK_TOKENS, num_tokens)
        x, chunk_ids = hidden_states[start:end], ids[start:end]
        num_pairs = (end - start) * top_k
        sorted_ids, expert_ids, num_post_padded = moe_align_block_size(chunk_ids, config.block_m, num_experts)
        assert sorted_ids.shape[0] == max_padded_size(num_pairs, num_experts, config.block_m)
        a, a_scale = quantize_rows_triton(x, EXPERT_FP8_BLOCK) if fp8 else (x, None)
        act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
        if config.fuse_activation:
            invoke_fused_moe_kernel(a, w13, act, b13, None, sorted_ids, expert_ids, num_post_padded,
                                    a_row_div=top_k, activation=activation, config=config,
                                    a_scale=a_scale, b_scale=w13_scale)
        else:
            gate_up = torch.empty(num_pairs, two_i, dtype=x.dtype, device=x.device)
            invoke_fused_moe_kernel(a, w13, gate_up, b13, None, sorted_ids, expert_ids, num_post_padded,
                                    a_row_div=top_k, activation=None, config=config,
                                    a_scale=a_scale, b_scale=w13_scale)
            moe_activation(gate_up, act, chunk_ids, num_experts, activation)
        # Rows of pairs routed nowhere stay unwritten in ``act``; their quantized rows are never read.
        act_in, act_scale = quantize_rows_triton(act, EXPERT_FP8_BLOCK) if fp8 else (act, None)
        pair_out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
        invoke_fused_moe_kernel(act_in, w2, pair_out, b2, weights[start:end].reshape(-1), sorted_ids, expert_ids,
                                num_post_padded, a_row_div=1, activation=None, config=config,
                                a_scale=act_scale, b_scale=w2_scale)
        moe_sum(pair_out, chunk_ids, out[start:end], num_experts)
    return out


def fused_experts_triton(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    small_batch: bool | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H] -> [T, H]: sum_k w[t,k] * down_k(act(gate_up_k(x_t))). Where the small-batch path of
    ``small_batch`` should run (``small_batch.small_batch_plan``: the path measured faster for this
    shape, device and token bucket, or the untuned rule; ``small_batch`` forces either way) its two
    launches without alignment; else the aligned pipeline, its launch config tuned for this shape,
    device and batch bucket (``kernel_config.get_config``). Block-FP8 experts (``w13_scale`` /
    ``w2_scale``) read their own tables (``kernel_config.FP8_DTYPE_KEY``): the aligned pipeline runs
    W8A8, the small path weight-only (the FP8 weights times their block scale, in registers)."""
    num_tokens, hidden = hidden_states.shape[0], hidden_states.shape[-1]  # checked before either path runs
    num_experts, top_k, inter = w13.shape[0], topk_ids.shape[-1], w13.shape[1] // 2
    device_name = device_name_of(hidden_states.device)
    dtype_key = FP8_DTYPE_KEY if w13_scale is not None else None
    if small_batch is None:
        small_cfg = small_batch_plan(num_tokens, num_experts, top_k, hidden, inter, device_name, dtype_key)
    elif small_batch:
        small_cfg = get_small_batch_config(num_tokens, num_experts, top_k, hidden, inter, device_name, dtype_key)
    else:
        small_cfg = None
    if small_cfg is not None:
        check_expert_inputs(hidden_states, w13, w2, topk_weights, topk_ids, activation, b13, b2, w13_scale, w2_scale)
        return fused_experts_small_batch(hidden_states, w13, w2, topk_weights, topk_ids, activation, b13, b2,
                                         small_cfg, w13_scale, w2_scale)
    config = get_config(num_tokens, num_experts, inter, top_k, device_name, dtype_key)
    return fused_experts_with_config(hidden_states, w13, w2, topk_weights, topk_ids, activation, b13, b2, config,
                                     w13_scale, w2_scale)
