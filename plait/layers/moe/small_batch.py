"""The fused MoE expert computation for small batches (decode at a few tokens): two Triton launches.

At T * K (token, expert) pairs far fewer than the experts, the sorted/aligned pipeline of
``fused_moe_triton`` spends more on its launches (align scan + scatter, the top-k sum) and on
padding every pair to a ``block_m``-row tile than on its bytes. Here each pair reads its expert's
weights directly from ``topk_ids``, with no alignment (as small-batch MoE kernels elsewhere index
the experts by the top-k ids directly):

1. ``_small_gate_up_kernel``, grid (P, cdiv(I, block_n)): program (p, j) computes columns
   j * block_n.. of pair p's gate and up halves as GEMVs (x[p // K] against w13[expert] rows),
   adds ``b13``, applies the activation in its epilogue and writes ``act`` [P, I];
2. ``_small_down_sum_kernel``, grid (T, cdiv(H, block_h)): program (t, j) loads all K of token t's
   pairs at once (a [K, block_h, block_k] tile of the K experts' w2 rows), so the down projection,
   ``b2``, the routing weights and the top-k sum all happen in one program, in fp32, in a fixed
   order (deterministic: no atomics).

Pairs whose expert id is outside [0, E) (experts another expert-parallel rank holds) are skipped,
as in the reference. An expert that two pairs of the step share is read twice (from L2 at best),
so the path pays off only while the pairs rarely share experts and the experts are small: a tuned
table says per token bucket which path measured faster (``small_batch_plan``), ``use_small_batch``
is the rule without one.
Buffer sizes depend only on T, K and the shapes, and nothing is read on the host: graph capturable.
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import asdict, dataclass

import torch
import triton
import triton.language as tl

from plait.layers.moe.activation_triton import activate
from plait.layers.moe.kernel_config import config_dirs, dtype_suffix
from plait.layers.moe.reference import ACTIVATIONS, EXPERT_FP8_BLOCK, SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT
from plait.layers.pdl import pdl_prologue, use_pdl
from plait.layers.tuned_configs import device_file_tag, first_existing, nearest_bucket

# The untuned rule (``use_small_batch``) takes the small path while pairs * SPARSITY_FACTOR <= experts:
# then the pairs of a step share few experts (with P pairs over E experts, about P / (2E) of the pairs
# repeat one), so reading each pair's expert on its own costs little over reading each distinct
# expert once.
SPARSITY_FACTOR = 4
# ... and only for experts of at most this many parameters (gate, up and down: 3 * H * I). What the
# small path saves is launches (the alignment's two and the top-k sum: a few microseconds) and the
# padding of each pair to a block_m-row tile; what it costs is bandwidth, since its GEMV tiles stream
# a large expert below the aligned GEMM's rate. With large experts (gpt-oss-20b: 25M parameters, a
# bs-1 layer reads 200 MB) the bytes' time dwarfs the saved launches and the aligned pipeline wins
# (measured on an H200 with the default tiles: 62 us aligned, 79 us small at one token); with small
# ones (qwen3-30b-a3b: 4.7M, 75 MB) the two tie at one token and the small path wins at two.
SMALL_EXPERT_MAX_PARAMS = 8 << 20

# Enough programs for every SM of a large GPU to hold a few, so the weight reads keep enough bytes
# in flight; a program's tile is the unit each SM streams.
_TARGET_PROGRAMS = 512

PATHS = ("small", "aligned")


def use_small_batch(num_pairs: int, num_experts: int, hidden: int, inter: int) -> bool:
    """The untuned rule (no table for the shape and device): whether ``fused_experts_triton`` takes
    this module's path for T * K = ``num_pairs`` pairs over experts of ``hidden`` x ``inter``."""
    return (0 < num_pairs and num_pairs * SPARSITY_FACTOR <= num_experts
            and 3 * hidden * inter <= SMALL_EXPERT_MAX_PARAMS)


@dataclass(frozen=True)
class SmallBatchConfig:
    """Tiles of the two launches: ``block_n`` columns of I per gate/up program, ``block_h`` rows of H
    per down program, ``block_k`` of the reduction dimension per step, and the launches' ``num_warps``
    and ``num_stages`` (software pipelining of the weight loads). The ``down_*`` fields, where set,
    give the down kernel its own reduction step, warps and stages (its [K, block_h, block_k] tile reads
    K experts' rows at once, the gate/up tile one expert's); None: the gate/up kernel's."""

    block_n: int
    block_h: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 3
    down_block_k: int | None = None
    down_num_warps: int | None = None
    down_num_stages: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_n", "block_h", "block_k", "down_block_k"):
            value = getattr(self, name)
            if value is not None and (value < 1 or value & (value - 1)):
                raise ValueError(f"SmallBatchConfig.{name} must be a power of two, got {value}")
        for name in ("num_warps", "num_stages", "down_num_warps", "down_num_stages"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"SmallBatchConfig.{name} must be >= 1, got {value}")

    @property
    def down(self) -> tuple[int, int, int]:
        """The down kernel's (block_k, num_warps, num_stages)."""
        return (self.down_block_k or self.block_k, self.down_num_warps or self.num_warps,
                self.down_num_stages or self.num_stages)

    def to_json(self) -> dict[str, int]:
        return {k: v for k, v in asdict(self).items() if v is not None}


@dataclass(frozen=True)
class SmallBatchBucket:
    """One measured token bucket of a small-batch table: the path that won there (``path``, one of
    ``PATHS``: this module's or the aligned pipeline at its own tuned config), and the small path's
    fastest tiles (used where it wins, or where a caller forces the small path)."""

    path: str
    config: SmallBatchConfig

    def __post_init__(self) -> None:
        if self.path not in PATHS:
            raise ValueError(f"SmallBatchBucket.path must be one of {PATHS}, got {self.path!r}")

    @classmethod
    def from_json(cls, data: dict) -> SmallBatchBucket:
        return cls(path=data["path"], config=SmallBatchConfig(**data["config"]))


def small_config_file_name(num_experts: int, intermediate: int, device_name: str, dtype: str | None = None) -> str:
    """The tuned table of this path, beside the aligned pipeline's (``kernel_config.config_dirs``):
    ``small_E{E}_N{I}_{device}.json``, token bucket M -> {"path": "small" | "aligned", "config":
    ``SmallBatchConfig`` fields, "us": {path: measured microseconds}} (``benchmarks/tune_fused_moe.py
    --small-batch`` writes it; "us" is for reading, not read here). ``dtype``: the block-FP8
    experts' key (``kernel_config.FP8_DTYPE_KEY``), their own table."""
    return f"small_E{num_experts}_N{intermediate}_{device_file_tag(device_name)}{dtype_suffix(dtype)}.json"


def load_small_batch_table(num_experts: int, intermediate: int, device_name: str,
                           dtype: str | None = None) -> dict[int, SmallBatchBucket] | None:
    """Bucket M -> ``SmallBatchBucket`` from the first of ``config_dirs`` holding the shape's table,
    or None (parsed once per shape, device, dtype and directory list)."""
    return _load_table(num_experts, intermediate, device_name, config_dirs(), dtype)


@functools.cache
def _load_table(num_experts: int, intermediate: int, device_name: str,
                dirs: tuple[pathlib.Path, ...], dtype: str | None = None) -> dict[int, SmallBatchBucket] | None:
    raw = first_existing(small_config_file_name(num_experts, intermediate, device_name, dtype), dirs)
    if raw is None:
        return None
    return {int(m): SmallBatchBucket.from_json(bucket) for m, bucket in raw.items()}


def get_small_batch_config(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                           device_name: str, dtype: str | None = None) -> SmallBatchConfig:
    """The small path's tiles for ``num_tokens``: the tuned ones of the nearest bucket for this shape,
    device and dtype key, else ``small_batch_config``'s choice."""
    table = load_small_batch_table(num_experts, inter, device_name, dtype)
    if not table:
        return small_batch_config(num_tokens, top_k, hidden, inter)
    return table[nearest_bucket(table, num_tokens)].config


def small_batch_plan(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int,
                     device_name: str, dtype: str | None = None) -> SmallBatchConfig | None:
    """The dispatcher's choice for ``num_tokens`` tokens: the small path's tiles where it should run,
    None where the aligned pipeline should. With a table for the shape and device: the path measured
    fastest at the nearest bucket, and the aligned pipeline above the largest bucket (the tuner
    measures every bucket where the small path could win). Without one: ``use_small_batch``.
    Resolved once per call shape, dtype key and table source (every MoE layer call asks)."""
    return _plan(num_tokens, num_experts, top_k, hidden, inter, device_name, config_dirs(), dtype)


@functools.lru_cache(maxsize=4096)
def _plan(num_tokens: int, num_experts: int, top_k: int, hidden: int, inter: int, device_name: str,
          dirs: tuple[pathlib.Path, ...], dtype: str | None = None) -> SmallBatchConfig | None:
    table = _load_table(num_experts, inter, device_name, dirs, dtype)
    if not table:
        if not use_small_batch(num_tokens * top_k, num_experts, hidden, inter):
            return None
        return small_batch_config(num_tokens, top_k, hidden, inter)
    if num_tokens < 1 or num_tokens > max(table):
        return None
    bucket = table[nearest_bucket(table, num_tokens)]
    return bucket.config if bucket.path == "small" else None


def _largest_block(count: int, width: int, smallest: int, largest: int) -> int:
    """The widest power-of-two block in [smallest, largest] that still gives ``count`` rows of
    programs over ``width`` at least ``_TARGET_PROGRAMS`` programs in all."""
    block = largest
    while block > smallest and count * triton.cdiv(width, block) < _TARGET_PROGRAMS:
        block //= 2
    return block


def small_batch_config(num_tokens: int, top_k: int, hidden: int, inter: int) -> SmallBatchConfig:
    """Tiles for T tokens of K experts each: the gate/up tile is 2 x [block_n, block_k], the down tile
    [K, block_h, block_k]; each at most 16 KB of bf16 per step, narrowed until the grid has
    ``_TARGET_PROGRAMS`` programs (or the narrowest block)."""
    block_k = 128
    block_n = _largest_block(num_tokens * top_k, inter, 8, 32)
    top_k_pad = triton.next_power_of_2(top_k)
    block_h = _largest_block(num_tokens, hidden, 4, max(4, 64 // top_k_pad))
    return SmallBatchConfig(block_n=block_n, block_h=block_h, block_k=block_k)


@triton.jit
def _small_gate_up_kernel(X, W13, B13, S13, topk_ids, Act, H, INTER, num_experts,
                          stride_xm, stride_we, stride_wn, stride_be, stride_am, stride_se, stride_sn,
                          TOP_K: tl.constexpr, HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr,
                          ALPHA: tl.constexpr, LIMIT: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, USE_FP8: tl.constexpr = False,
                          SCALE_BLOCK: tl.constexpr = 128, USE_PDL: tl.constexpr = False):
    """Act[p, n] = act(gate, up) with gate = x[p // TOP_K] . W13[e, n] (+ B13[e, n]) and up the same
    at row INTER + n, for the block of columns n of program 1, e = topk_ids[p]; rows of skipped pairs
    stay unwritten. W13 [E, 2 * INTER, H] with H contiguous. USE_FP8: W13 float8_e4m3fn, each weight
    times its block's multiplier S13[e, row // SCALE_BLOCK, k // SCALE_BLOCK] in registers (BLOCK_K
    divides SCALE_BLOCK: one scale column per step); x as it is (weight-only)."""
    pdl_prologue(USE_PDL)
    pair = tl.program_id(0).to(tl.int64)
    expert = tl.load(topk_ids + pair).to(tl.int64)
    if (expert < 0) | (expert >= num_experts):
        return
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    # Columns wrap modulo INTER so the weight loads need no mask; the store masks the wrapped ones.
    rows = (offs_n % INTER).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + (pair // TOP_K) * stride_xm + offs_k
    gate_ptrs = W13 + expert * stride_we + rows[:, None] * stride_wn + offs_k[None, :]
    up_ptrs = gate_ptrs + INTER * stride_wn
    gs_ptrs = S13 + expert * stride_se + (rows // SCALE_BLOCK) * stride_sn
    us_ptrs = S13 + expert * stride_se + ((rows + INTER) // SCALE_BLOCK) * stride_sn
    # Elementwise partial products, reduced over K once after the loop (no shuffles per step).
    acc_gate = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    acc_up = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, tl.cdiv(H, BLOCK_K)):
        if EVEN_K:
            x = tl.load(x_ptrs).to(tl.float32)
            gate = tl.load(gate_ptrs)
            up = tl.load(up_ptrs)
        else:
            k_mask = offs_k < H - k * BLOCK_K
            x = tl.load(x_ptrs, mask=k_mask, other=0.0).to(tl.float32)
            gate = tl.load(gate_ptrs, mask=k_mask[None, :], other=0.0)
            up = tl.load(up_ptrs, mask=k_mask[None, :], other=0.0)
        if USE_FP8:
            group = (k * BLOCK_K) // SCALE_BLOCK
            acc_gate += gate.to(tl.float32) * tl.load(gs_ptrs + group)[:, None] * x[None, :]
            acc_up += up.to(tl.float32) * tl.load(us_ptrs + group)[:, None] * x[None, :]
        else:
            acc_gate += gate.to(tl.float32) * x[None, :]
            acc_up += up.to(tl.float32) * x[None, :]
        x_ptrs += BLOCK_K
        gate_ptrs += BLOCK_K
        up_ptrs += BLOCK_K
    gate_out = tl.sum(acc_gate, axis=1)
    up_out = tl.sum(acc_up, axis=1)
    if HAS_BIAS:
        bias_ptrs = B13 + expert * stride_be + rows
        gate_out += tl.load(bias_ptrs).to(tl.float32)
        up_out += tl.load(bias_ptrs + INTER).to(tl.float32)
    y = activate(gate_out, up_out, ACTIVATION, ALPHA, LIMIT)
    tl.store(Act + pair * stride_am + offs_n, y.to(Act.dtype.element_ty), mask=offs_n < INTER)


@triton.jit
def _small_down_sum_kernel(Act, W2, B2, S2, topk_ids, topk_weights, Out, H, INTER, num_experts,
                           stride_am, stride_we, stride_wh, stride_be, stride_om, stride_se, stride_sh,
                           TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr, HAS_BIAS: tl.constexpr,
                           BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                           USE_FP8: tl.constexpr = False, SCALE_BLOCK: tl.constexpr = 128,
                           USE_PDL: tl.constexpr = False):
    """Out[t, h] = sum over t's valid pairs p of weight[p] * (Act[p] . W2[e_p, h] (+ B2[e_p, h])), in
    fp32, for the block of rows h of program 1. W2 [E, H, INTER] with INTER contiguous. USE_FP8: W2
    float8_e4m3fn times S2[e, h // SCALE_BLOCK, k // SCALE_BLOCK] in registers, as the gate/up kernel."""
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs_h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    rows = (offs_h % H).to(tl.int64)  # wrapped like the gate/up columns; the store masks them
    slot = tl.arange(0, TOP_K_PAD)
    pairs = token * TOP_K + slot
    in_k = slot < TOP_K
    experts = tl.load(topk_ids + pairs, mask=in_k, other=-1)
    valid = in_k & (experts >= 0) & (experts < num_experts)
    experts = tl.where(valid, experts, 0).to(tl.int64)
    weights = tl.load(topk_weights + pairs, mask=valid, other=0.0).to(tl.float32)
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = Act + pairs[:, None] * stride_am + offs_k[None, :]
    w_ptrs = (W2 + experts[:, None, None] * stride_we + rows[None, :, None] * stride_wh
              + offs_k[None, None, :])
    s_ptrs = S2 + experts[:, None] * stride_se + (rows // SCALE_BLOCK)[None, :] * stride_sh  # [TOP_K_PAD, BLOCK_H]
    acc = tl.zeros((TOP_K_PAD, BLOCK_H, BLOCK_K), dtype=tl.float32)  # reduced over K after the loop
    for k in range(0, tl.cdiv(INTER, BLOCK_K)):
        if EVEN_K:
            a_mask = valid[:, None]
        else:
            a_mask = valid[:, None] & (offs_k < INTER - k * BLOCK_K)[None, :]
        a = tl.load(a_ptrs, mask=a_mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptrs, mask=a_mask[:, None, :], other=0.0).to(tl.float32)
        if USE_FP8:
            group = (k * BLOCK_K) // SCALE_BLOCK
            w = w * tl.load(s_ptrs + group, mask=valid[:, None], other=0.0)[:, :, None]
        acc += w * a[:, None, :]
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    pair_out = tl.sum(acc, axis=2)  # [TOP_K_PAD, BLOCK_H]
    if HAS_BIAS:
        bias = tl.load(B2 + experts[:, None] * stride_be + rows[None, :], mask=valid[:, None], other=0.0)
        pair_out += bias.to(tl.float32)
    out = tl.sum(pair_out * weights[:, None], axis=0)
    tl.store(Out + token * stride_om + offs_h, out.to(Out.dtype.element_ty), mask=offs_h < H)


def _contiguous_last(t: torch.Tensor, name: str) -> torch.Tensor:
    if t.stride(-1) != 1:
        raise ValueError(f"fused_experts_small_batch: {name} must be contiguous in its last dimension")
    return t


def fused_experts_small_batch(
    hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
    topk_ids: torch.Tensor, activation: str, b13: torch.Tensor | None, b2: torch.Tensor | None,
    config: SmallBatchConfig | None = None, w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """[T, H] -> [T, H], ``fused_experts_reference``'s semantics, in two launches (module doc).
    The caller has checked the inputs (``fused_moe_triton.check_expert_inputs``). ``w13_scale`` /
    ``w2_scale``: block-FP8 experts, weight-only (the block_k must divide the 128-column block)."""
    num_tokens, hidden = hidden_states.shape
    num_experts, two_i, _ = w13.shape
    inter = two_i // 2
    top_k = topk_ids.shape[1]
    cfg = config or small_batch_config(num_tokens, top_k, hidden, inter)
    fp8 = w13_scale is not None and w2_scale is not None
    if fp8 and (EXPERT_FP8_BLOCK % cfg.block_k or EXPERT_FP8_BLOCK % cfg.down[0]):
        raise ValueError(f"FP8 experts on the small-batch path need a block_k (and down_block_k) dividing "
                         f"{EXPERT_FP8_BLOCK}, got {cfg.block_k} / {cfg.down[0]}")
    out = torch.empty(num_tokens, hidden, dtype=hidden_states.dtype, device=hidden_states.device)
    if num_tokens == 0:
        return out
    x = _contiguous_last(hidden_states, "hidden_states")
    w13, w2 = _contiguous_last(w13, "w13"), _contiguous_last(w2, "w2")
    ids = topk_ids.contiguous()
    # The routers return float32 weights: then no cast (not even a no-op ``to``) is issued.
    weights = (topk_weights if topk_weights.dtype == torch.float32 else topk_weights.float()).contiguous()
    act = torch.empty(num_tokens * top_k, inter, dtype=x.dtype, device=x.device)
    pdl = use_pdl(x)
    _small_gate_up_kernel[(num_tokens * top_k, triton.cdiv(inter, cfg.block_n))](
        x, w13, b13 if b13 is not None else w13, w13_scale if fp8 else act, ids, act, hidden, inter, num_experts,
        x.stride(0), w13.stride(0), w13.stride(1), b13.stride(0) if b13 is not None else 0, act.stride(0),
        w13_scale.stride(0) if fp8 else 0, w13_scale.stride(1) if fp8 else 0,
        TOP_K=top_k, HAS_BIAS=b13 is not None, ACTIVATION=ACTIVATIONS.index(activation),
        ALPHA=SWIGLU_OAI_ALPHA, LIMIT=SWIGLU_OAI_LIMIT, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        EVEN_K=hidden % cfg.block_k == 0, USE_FP8=fp8, SCALE_BLOCK=EXPERT_FP8_BLOCK, USE_PDL=pdl,
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, launch_pdl=pdl)
    down_block_k, down_warps, down_stages = cfg.down
    _small_down_sum_kernel[(num_tokens, triton.cdiv(hidden, cfg.block_h))](
        act, w2, b2 if b2 is not None else w2, w2_scale if fp8 else act, ids, weights, out, hidden, inter,
        num_experts, act.stride(0), w2.stride(0), w2.stride(1), b2.stride(0) if b2 is not None else 0,
        out.stride(0), w2_scale.stride(0) if fp8 else 0, w2_scale.stride(1) if fp8 else 0,
        TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k), HAS_BIAS=b2 is not None,
        BLOCK_H=cfg.block_h, BLOCK_K=down_block_k, EVEN_K=inter % down_block_k == 0, USE_FP8=fp8,
        SCALE_BLOCK=EXPERT_FP8_BLOCK, USE_PDL=pdl,
        num_warps=down_warps, num_stages=down_stages, launch_pdl=pdl)
    return out
