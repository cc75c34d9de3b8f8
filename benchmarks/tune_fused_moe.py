"""Tune the fused MoE kernels' launch configs per expert shape and batch bucket (CUDA only).

For each shape and each M (tokens) it times the whole ``fused_experts_with_config`` call (alignment,
both grouped GEMMs, the activation, the top-k sum) for every candidate config, as CUDA graph replays
over rotating random routings (so neither host launch cost nor an L2-resident expert set flatters a
config), checks the fastest against the fp32 reference, and writes it per M to
``E{E}_N{I}_{GPU}.json``, the file
``plait.layers.moe.kernel_config`` reads at run time. The file is rewritten after every M, so a run
stopped by ``--budget-s`` keeps what it measured (the run time picks the nearest measured bucket).

``--small-batch`` tunes the two-launch small-batch path instead (``plait.layers.moe.small_batch``)
at the buckets where it could win (pairs <= experts), times the aligned pipeline at the same buckets
(at the config the run time gives it), and writes both the small path's best tiles and the faster
path per bucket into ``small_E{E}_N{I}_{GPU}.json``: the dispatcher takes the small path only where
it measured faster. Point ``PLAIT_MOE_CONFIG_DIR`` at ``--out-dir`` to serve a fresh tune.

Compiling the candidates dominates a cold run; ``--jobs`` worker processes compile them first into
Triton's on-disk cache (the kernels do not specialise on the token count, so one compile per
config and shape serves every M).

  python benchmarks/tune_fused_moe.py --shape qwen3-30b-a3b --shape gpt-oss-20b \\
      [--batch-sizes 1,2,4,...] [--out-dir plait/layers/moe/configs] [--budget-s 300] [--jobs 12] [--tp 2] [--ep 2]
  python benchmarks/tune_fused_moe.py --small-batch [--shape ...] [--budget-s 120] [--out-dir DIR]

``--fp8`` tunes block-FP8 experts (float8_e4m3fn weights with 128 x 128 block scales: the aligned
pipeline W8A8, the small path weight-only) into their own tables, ``..._dtype=fp8_w8a8.json``
(``kernel_config.FP8_DTYPE_KEY``); candidates whose K tile crosses a 128-column scale group are left
out, and winners are checked against the reference loop on the dequantized weights.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from plait.layers.moe.fp8 import quantize_expert_blocks  # noqa: E402
from plait.layers.moe.fused_moe_triton import fp8_block_k_ok, fused_experts_with_config  # noqa: E402
from plait.layers.moe.kernel_config import (  # noqa: E402
    CONFIG_DIR,
    FP8_DTYPE_KEY,
    MoeKernelConfig,
    config_file_name,
    get_config,
)
from plait.layers.moe.reference import (
    EXPERT_FP8_BLOCK,  # noqa: E402
    fused_experts_reference,  # noqa: E402
)
from plait.layers.moe.small_batch import (  # noqa: E402
    SmallBatchConfig,
    fused_experts_small_batch,
    get_small_batch_config,
    load_small_batch_table,
    small_config_file_name,
)


@dataclass(frozen=True)
class MoeShape:
    """One MoE layer's experts: E experts, top-k, hidden H, intermediate I (per rank); under expert
    parallelism (``ep`` > 1) this rank holds the first E / ep experts and the rest route to -1."""

    num_experts: int
    top_k: int
    hidden: int
    inter: int
    activation: str
    bias: bool
    ep: int = 1
    fp8: bool = False  # block-FP8 experts (``--fp8``)

    @property
    def local_experts(self) -> int:
        return self.num_experts // self.ep

    @property
    def dtype_key(self) -> str | None:
        """The tables' dtype key (``kernel_config.config_file_name``)."""
        return FP8_DTYPE_KEY if self.fp8 else None


MOE_KERNEL_SHAPES: dict[str, MoeShape] = {
    "qwen3-30b-a3b": MoeShape(num_experts=128, top_k=8, hidden=2048, inter=768, activation="silu", bias=False),
    "gpt-oss-20b": MoeShape(num_experts=32, top_k=4, hidden=2880, inter=2880, activation="swiglu_oai", bias=True),
}
DEFAULT_BATCH_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096)
DTYPE = torch.bfloat16

# (block_n, block_k, num_warps, num_stages) per block_m; group_m is 1 for 16-row blocks (an expert
# rarely has two) and 16 above.
_TILES: dict[int, tuple[tuple[int, int, int, int], ...]] = {
    16: ((32, 64, 4, 6), (32, 128, 4, 4), (32, 256, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (64, 64, 4, 5),
         (64, 256, 4, 3), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 8, 4), (256, 64, 8, 3)),
    32: ((64, 128, 4, 4), (64, 64, 4, 5), (128, 64, 4, 4), (128, 128, 8, 3)),
    64: ((64, 64, 4, 4), (64, 128, 4, 3), (128, 64, 4, 3), (128, 64, 8, 4), (256, 64, 8, 3), (256, 64, 8, 4)),
    128: ((128, 64, 8, 3), (128, 64, 8, 4), (128, 128, 8, 3), (256, 64, 8, 3), (256, 64, 8, 4)),
}


def candidate_configs(block_ms: tuple[int, ...] = (16, 32, 64, 128), fp8: bool = False) -> list[MoeKernelConfig]:
    """Every tile of ``_TILES`` with the activation separate, and fused where the two fp32
    accumulators (gate and up) still fit the registers; ``fp8``: only K tiles inside one scale group."""
    out = []
    for bm in block_ms:
        for bn, bk, warps, stages in _TILES[bm]:
            if fp8 and not fp8_block_k_ok(bk):
                continue
            for fuse in (False, True):
                if fuse and bm * bn > 64 * 128:
                    continue
                out.append(MoeKernelConfig(block_m=bm, block_n=bn, block_k=bk, group_m=1 if bm == 16 else 16,
                                           num_warps=warps, num_stages=stages, fuse_activation=fuse))
    return out


def block_ms_for(num_tokens: int, shape: MoeShape) -> tuple[int, ...]:
    """Row-block sizes worth trying: a block much taller than an expert's average run is mostly padding."""
    per_expert = num_tokens * shape.top_k / shape.num_experts
    return tuple(bm for bm in (16, 32, 64, 128) if bm == 16 or per_expert >= 0.5 * bm)


def make_weights(shape: MoeShape, num_experts: int | None = None, seed: int = 0):
    """(w13, w2, b13, b2, scales): bf16 experts, or block-FP8 ones with ``scales`` the kernels'
    ``w13_scale`` / ``w2_scale`` keyword arguments (empty for bf16)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = num_experts or shape.local_experts
    h, i = shape.hidden, shape.inter
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).to(DTYPE)
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).to(DTYPE)
    b13 = (0.1 * torch.randn(e, 2 * i, device="cuda", generator=g)).to(DTYPE) if shape.bias else None
    b2 = (0.1 * torch.randn(e, h, device="cuda", generator=g)).to(DTYPE) if shape.bias else None
    if not shape.fp8:
        return w13, w2, b13, b2, {}
    (w13, s13), (w2, s2) = quantize_expert_blocks(w13), quantize_expert_blocks(w2)
    return w13, w2, b13, b2, {"w13_scale": s13, "w2_scale": s2}


def reference_of(shape: MoeShape, experts: tuple, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor,
                 quantize_activations: bool) -> torch.Tensor:
    """The reference loop on fp32 copies of the same values (FP8 experts dequantized; the aligned FP8
    pipeline's activations quantized as it quantizes them)."""
    w13, w2, b13, b2, scales = experts
    f32 = [t.float() if t is not None and t.dtype == DTYPE else t for t in (w13, w2, b13, b2)]
    return fused_experts_reference(x.float(), f32[0], f32[1], weights, ids, shape.activation, f32[2], f32[3],
                                   scales.get("w13_scale"), scales.get("w2_scale"),
                                   quantize_activations=quantize_activations and shape.fp8)


def make_inputs(shape: MoeShape, num_tokens: int, seed: int, num_experts: int | None = None):
    """Random hidden states and a random top-k routing over all experts (softmax of random logits,
    normalised over k); ids of experts this rank does not hold (``ep`` > 1) become -1."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    e = num_experts or shape.num_experts
    x = torch.randn(num_tokens, shape.hidden, device="cuda", generator=g).to(DTYPE)
    logits = torch.randn(num_tokens, e, device="cuda", generator=g)
    weights, ids = torch.topk(logits.softmax(-1), shape.top_k, dim=-1)
    ids = torch.where(ids < e // shape.ep, ids, -1)
    return x, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def rel_error_vs_reference(shape: MoeShape, experts: tuple, x: torch.Tensor, weights: torch.Tensor,
                           ids: torch.Tensor, config: MoeKernelConfig) -> float:
    """||fused - reference|| / ||reference||, the reference loop on fp32 copies of the same bf16 values."""
    w13, w2, b13, b2, scales = experts
    out = fused_experts_with_config(x, w13, w2, weights, ids, shape.activation, b13, b2, config, **scales).float()
    ref = reference_of(shape, experts, x, weights, ids, quantize_activations=True)
    return float((out - ref).norm() / ref.norm())


def graph_time_us(fns: list[Callable[[], object]], replays: int = 5) -> float:
    """Median microseconds of one call, from CUDA graph replays of all of ``fns`` (one capture each
    in order; each typically works on its own inputs so the expert set rotates)."""
    for fn in fns:  # compile and warm up outside the capture
        fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in fns:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(fns))
    del graph
    return statistics.median(times)


def _precompile(args: tuple[MoeShape, bool, list[dict]]) -> int:
    """Worker: run each config once on a small expert set so Triton writes it to the disk cache
    (E = 16 keeps the same integer specialisation as the real E, a multiple of 16); ``small``: the
    configs are the small-batch path's."""
    shape, small, configs = args
    w13, w2, b13, b2, scales = make_weights(shape, num_experts=16)
    x, weights, ids = make_inputs(shape, 1 if small else 4, seed=0, num_experts=16)
    done = 0
    for raw in configs:
        try:
            if small:
                fused_experts_small_batch(x, w13, w2, weights, ids, shape.activation, b13, b2, SmallBatchConfig(**raw),
                                          **scales)
            else:
                fused_experts_with_config(x, w13, w2, weights, ids, shape.activation, b13, b2,
                                          MoeKernelConfig.from_json(raw), **scales)
            done += 1
        except Exception:  # out of shared memory / registers: the main process skips it
            pass
    torch.cuda.synchronize()
    return done


def precompile(names: list[str], jobs: int, small: bool = False) -> None:
    """Compile every candidate of ``names`` (the aligned pipeline's, or with ``small`` the small-batch
    path's) in ``jobs`` worker processes."""
    work = {name: [cfg.to_json() for cfg in (
        small_batch_candidates(MOE_KERNEL_SHAPES[name].top_k, MOE_KERNEL_SHAPES[name].fp8) if small
        else candidate_configs(fp8=MOE_KERNEL_SHAPES[name].fp8))] for name in names}
    total = sum(len(cfgs) for cfgs in work.values())
    if jobs <= 1 or not total:
        return
    chunks: list[tuple[MoeShape, bool, list[dict]]] = []
    for name, cfgs in work.items():
        per = max(1, -(-len(cfgs) * len(names) // jobs))
        chunks += [(MOE_KERNEL_SHAPES[name], small, cfgs[i:i + per]) for i in range(0, len(cfgs), per)]
    t0 = time.perf_counter()
    try:
        with mp.get_context("spawn").Pool(min(jobs, len(chunks))) as pool:
            done = sum(pool.map(_precompile, chunks))
    except Exception as exc:  # the timing loop then compiles each config itself
        print(f"precompile failed ({type(exc).__name__}: {exc}); compiling lazily", flush=True)
        return
    print(f"precompiled {done}/{total} configs in {time.perf_counter() - t0:.1f}s", flush=True)


def tune_shape(name: str, batch_sizes: list[int], out_dir: str, deadline: float, rotations: int) -> dict:
    shape = MOE_KERNEL_SHAPES[name]
    experts = make_weights(shape)
    w13, w2, b13, b2, scales = experts
    device = torch.cuda.get_device_name()
    path = os.path.join(out_dir, config_file_name(shape.local_experts, shape.inter, device, shape.dtype_key))
    best: dict[str, dict] = {}
    report: dict[str, dict] = {}
    for m in batch_sizes:
        if time.monotonic() > deadline:
            print(f"{name}: budget spent before M={m}", flush=True)
            break
        inputs = [make_inputs(shape, m, seed=s) for s in range(rotations)]
        timings: list[tuple[float, MoeKernelConfig]] = []
        time_configs(fused_experts_with_config, shape, experts, inputs, deadline, timings,
                     candidate_configs(block_ms_for(m, shape), shape.fp8))
        if not timings:
            continue
        us, cfg = timings[0]
        x, w, i = inputs[0]
        err = rel_error_vs_reference(shape, experts, x, w, i, cfg)
        if not err < 2e-2:
            raise SystemExit(f"{name} M={m}: {cfg} is off the fp32 reference by {err:.3g} (relative)")
        best[str(m)] = cfg.to_json()
        report[str(m)] = {"us": us, "config": cfg.to_json(), "tried": len(timings),
                          "worst_us": timings[-1][0]}
        print(f"{name} M={m}: {us:.1f} us  {cfg}  (of {len(timings)}; worst {timings[-1][0]:.1f} us)", flush=True)
        with open(path, "w") as f:
            json.dump(best, f, indent=2, sort_keys=False)
            f.write("\n")
    return {"file": path, "buckets": report}


# (block_n, block_h, block_k, num_warps, num_stages) of the small-batch path: narrow row tiles (many
# programs, each streaming few rows) to wide ones, reduction steps of 64..1024, and deeper pipelines.
# At one token a grid of few programs per SM has little in flight unless each step is wide: the
# last rows are one or two rows per program with a whole (or half) reduction dimension per step.
_SMALL_TILES = (
    (2, 1, 1024, 4, 3), (4, 1, 1024, 4, 3), (4, 2, 1024, 8, 3), (8, 1, 512, 4, 3), (8, 2, 1024, 8, 2),
    (4, 2, 256, 4, 3), (4, 4, 256, 4, 3), (4, 4, 512, 8, 3), (8, 2, 256, 4, 3), (8, 2, 512, 8, 4),
    (8, 4, 64, 4, 3), (8, 4, 128, 4, 3), (8, 4, 128, 4, 5), (8, 4, 256, 4, 3), (8, 4, 256, 4, 4),
    (8, 4, 256, 8, 3), (8, 4, 512, 8, 3), (8, 8, 64, 4, 3), (8, 8, 128, 4, 3), (8, 8, 128, 4, 4),
    (16, 2, 256, 4, 3), (16, 4, 128, 4, 3), (16, 4, 128, 4, 5), (16, 4, 256, 8, 3), (16, 4, 256, 8, 4),
    (16, 8, 128, 4, 3), (16, 8, 128, 8, 4), (16, 8, 256, 8, 3), (16, 16, 64, 4, 3), (32, 4, 128, 4, 3),
    (32, 8, 128, 4, 3), (32, 8, 128, 8, 4), (32, 4, 256, 8, 3),
)
# fp32 accumulator elements one thread may hold (gate + up tiles, or the [K, block_h, block_k] down
# tile, over 32 * num_warps threads) before the tile spills registers.
_ACC_PER_THREAD = 64


def small_batch_candidates(top_k: int = 8, fp8: bool = False) -> list[SmallBatchConfig]:
    """The small path's tiles worth timing for ``top_k`` experts per token: ``_SMALL_TILES`` whose
    accumulators fit the registers (``fp8``: and whose K step stays in one 128-column scale group)."""
    top_k_pad = 1 << (top_k - 1).bit_length()
    out = []
    for bn, bh, bk, warps, stages in _SMALL_TILES:
        if fp8 and EXPERT_FP8_BLOCK % bk:
            continue
        limit = _ACC_PER_THREAD * 32 * warps
        if 2 * bn * bk <= limit and top_k_pad * bh * bk <= limit:
            out.append(SmallBatchConfig(bn, bh, bk, warps, stages))
    return out


# (block_h, down_block_k, down_num_warps, down_num_stages) of the down kernel alone, swept over a bucket's
# best joint tiles (``--down-sweep``): its [K, block_h, block_k] tile reads the K experts' rows at once, so
# its best step and warps need not be the gate/up kernel's; from one row per program (H programs per
# token) to 16.
_DOWN_TILES = (
    (1, 1024, 4, 3), (1, 512, 2, 3), (1, 256, 2, 4), (2, 1024, 8, 2), (2, 512, 4, 3), (2, 512, 8, 3),
    (2, 256, 2, 3), (2, 256, 4, 4), (4, 512, 8, 3), (4, 256, 4, 3), (4, 256, 4, 4), (4, 256, 8, 2),
    (4, 128, 2, 4), (4, 128, 4, 4), (8, 256, 8, 3), (8, 256, 8, 4), (8, 128, 4, 4), (8, 128, 8, 4),
    (8, 64, 4, 4), (16, 128, 8, 3), (16, 64, 4, 3), (16, 64, 8, 4),
)


def down_candidates(base: SmallBatchConfig, top_k: int = 8, fp8: bool = False) -> list[SmallBatchConfig]:
    """``base`` with each ``_DOWN_TILES`` entry as its down kernel's tiles (gate/up unchanged) whose
    accumulator fits the registers (``fp8``: and whose K step stays in one 128-column scale group)."""
    top_k_pad = 1 << (top_k - 1).bit_length()
    return [dataclasses.replace(base, block_h=bh, down_block_k=bk, down_num_warps=warps, down_num_stages=stages)
            for bh, bk, warps, stages in _DOWN_TILES
            if top_k_pad * bh * bk <= _ACC_PER_THREAD * 32 * warps and not (fp8 and EXPERT_FP8_BLOCK % bk)]


def small_batch_buckets(shape: MoeShape, batch_sizes: list[int]) -> list[int]:
    """The buckets where the small path could win: at most as many pairs as experts (beyond that
    the pairs share experts and the aligned pipeline reads each once; the run time takes the aligned
    pipeline above the table's largest bucket)."""
    return [m for m in batch_sizes if 0 < m * shape.top_k <= shape.num_experts]


def time_configs(run: Callable, shape: MoeShape, experts: tuple, inputs: list, deadline: float,
                 timings: list, configs: list) -> None:
    """Time ``run(x, w13, w2, weights, ids, activation, b13, b2, cfg, **scales)`` (the aligned pipeline's
    or the small path's entry point) at each of ``configs`` until ``deadline``, over the ``inputs``
    rotation, into ``timings`` as (us, cfg), kept sorted fastest first; a tile that does not fit this
    GPU's shared memory or registers is skipped."""
    w13, w2, b13, b2, scales = experts
    for cfg in configs:
        if time.monotonic() > deadline:
            break
        fns = [lambda x=x, w=w, i=i, cfg=cfg: run(x, w13, w2, w, i, shape.activation, b13, b2, cfg, **scales)
               for x, w, i in inputs]
        try:
            timings.append((graph_time_us(fns), cfg))
        except Exception as exc:
            print(f"  skip {cfg}: {type(exc).__name__}", flush=True)
    timings.sort(key=lambda t: t[0])


def tune_small_batch(name: str, batch_sizes: list[int], out_dir: str, deadline: float, rotations: int,
                     down_sweep: bool = False, from_table: bool = False) -> dict:
    """Per bucket: the fastest ``SmallBatchConfig``, and the aligned pipeline at the config the run
    time would give it (``kernel_config.get_config``), timed the same way; the table records the
    faster path per bucket (``small_batch.SmallBatchBucket``), which the dispatcher follows.
    ``down_sweep``: then the down kernel's own tiles over the winner (``down_candidates``).
    ``from_table``: the joint tiles are the table's the run time reads now (the shipped one, or the
    one in ``out_dir``), not swept again; the buckets not tuned keep their entries."""
    shape = MOE_KERNEL_SHAPES[name]
    experts = make_weights(shape)
    w13, w2, b13, b2, scales = experts
    device = torch.cuda.get_device_name()
    path = os.path.join(out_dir, small_config_file_name(shape.local_experts, shape.inter, device, shape.dtype_key))
    best: dict[str, dict] = {}
    if from_table:
        table = load_small_batch_table(shape.local_experts, shape.inter, device, shape.dtype_key) or {}
        best = {str(m): {"path": b.path, "config": b.config.to_json()} for m, b in table.items()}
    report: dict[str, dict] = {}
    for m in small_batch_buckets(shape, batch_sizes):
        if time.monotonic() > deadline:
            print(f"{name}: budget spent before small-batch M={m}", flush=True)
            break
        inputs = [make_inputs(shape, m, seed=s) for s in range(rotations)]
        aligned_cfg = get_config(m, shape.local_experts, shape.inter, shape.top_k, device, shape.dtype_key)
        aligned_us = graph_time_us([lambda x=x, w=w, i=i, cfg=aligned_cfg: fused_experts_with_config(
            x, w13, w2, w, i, shape.activation, b13, b2, cfg, **scales) for x, w, i in inputs])
        timings: list[tuple[float, SmallBatchConfig]] = []
        time_all = functools.partial(time_configs, fused_experts_small_batch, shape, experts, inputs, deadline,
                                     timings)
        if from_table:
            time_all([get_small_batch_config(m, shape.local_experts, shape.top_k, shape.hidden, shape.inter,
                                             device, shape.dtype_key)])
        else:
            time_all(small_batch_candidates(shape.top_k, shape.fp8))
        if not timings:
            break
        joint_us = timings[0][0]
        if down_sweep:
            time_all(down_candidates(timings[0][1], shape.top_k, shape.fp8))
        us, cfg = timings[0]
        x, w, i = inputs[0]
        out = fused_experts_small_batch(x, w13, w2, w, i, shape.activation, b13, b2, cfg, **scales).float()
        ref = reference_of(shape, experts, x, w, i, quantize_activations=False)  # the small path is weight-only
        err = float((out - ref).norm() / ref.norm())
        if not err < 2e-2:
            raise SystemExit(f"{name} M={m}: {cfg} is off the fp32 reference by {err:.3g} (relative)")
        winner = "small" if us < aligned_us else "aligned"
        best[str(m)] = {"path": winner, "config": cfg.to_json(), "us": {"small": us, "aligned": aligned_us}}
        report[str(m)] = {"path": winner, "small_us": us, "joint_us": joint_us, "aligned_us": aligned_us,
                          "config": cfg.to_json(),
                          "aligned_config": aligned_cfg.to_json(), "tried": len(timings),
                          "worst_us": timings[-1][0]}
        print(f"{name} small-batch M={m}: small {us:.1f} us (joint tiles {joint_us:.1f})  {cfg}  "
              f"(of {len(timings)}; worst "
              f"{timings[-1][0]:.1f} us); aligned {aligned_us:.1f} us -> {winner}", flush=True)
        with open(path, "w") as f:
            json.dump(best, f, indent=2)
            f.write("\n")
    return {"file": path, "buckets": report}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(MOE_KERNEL_SHAPES), help="repeatable")
    ap.add_argument("--batch-sizes", default=",".join(map(str, DEFAULT_BATCH_SIZES)))
    ap.add_argument("--out-dir", default=str(CONFIG_DIR))
    ap.add_argument("--budget-s", type=float, default=600.0, help="stop timing new configs after this long")
    ap.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                    help="processes that precompile the candidates (1: compile lazily)")
    ap.add_argument("--rotations", type=int, default=4, help="random routings each timing rotates through")
    ap.add_argument("--report", help="also write the per-bucket timings here (JSON)")
    ap.add_argument("--small-batch", action="store_true",
                    help="tune the small-batch path's tiles (its buckets of --batch-sizes) instead")
    ap.add_argument("--down-sweep", action="store_true",
                    help="with --small-batch: then sweep the down kernel's own tiles over each bucket's winner")
    ap.add_argument("--from-table", action="store_true",
                    help="with --small-batch: start from the table's tiles instead of sweeping the joint ones")
    ap.add_argument("--tp", type=int, default=1,
                    help="tensor-parallel size: tune each rank's shard (intermediate / tp), the shape it runs")
    ap.add_argument("--ep", type=int, default=1,
                    help="expert-parallel size: tune one rank's E / ep experts, the other pairs routed away")
    ap.add_argument("--fp8", action="store_true",
                    help="block-FP8 experts (128 x 128 scales) into the ..._dtype=fp8_w8a8.json tables")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_fused_moe.py needs a CUDA GPU")
    names = args.shape or sorted(MOE_KERNEL_SHAPES)
    for name in names:
        shape = MOE_KERNEL_SHAPES[name]
        if shape.inter % args.tp or shape.num_experts % args.ep:
            raise SystemExit(f"--tp {args.tp} must divide {name}'s intermediate size {shape.inter} and --ep "
                             f"{args.ep} its {shape.num_experts} experts")
        MOE_KERNEL_SHAPES[name] = dataclasses.replace(shape, inter=shape.inter // args.tp, ep=args.ep, fp8=args.fp8)
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    os.makedirs(args.out_dir, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    if not args.from_table:
        precompile(names, args.jobs, small=args.small_batch)
    tune = (functools.partial(tune_small_batch, down_sweep=args.down_sweep, from_table=args.from_table)
            if args.small_batch else tune_shape)
    report = {}
    for i, name in enumerate(names):
        # Split what is left of the budget evenly over the shapes still to tune.
        share = (deadline - time.monotonic()) / (len(names) - i)
        report[name] = tune(name, batch_sizes, args.out_dir, time.monotonic() + share, args.rotations)
    if args.report:
        with open(args.report, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "shapes": report}, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
