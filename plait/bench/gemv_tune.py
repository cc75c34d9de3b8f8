"""Tuning the small-M GEMV's launch configs on the GPU (``benchmarks/tune_gemv.py`` is the command).

For each (weight kind, N, K, M bucket) of the llama-3.1-8b and llama-3.2-1b projections (qkv, o,
gate_up, down), every candidate config is timed under CUDA-graph replay with the weights rotated past
the L2 (``plait.bench.hardware.graph_time``, the timer of ``plait bench quant --workload gemm``); the
fastest goes into the device's table (``plait.layers.quantization.gemv_config``'s layout).

The space is pruned to stay within about a minute on an H200, compiles included: a handful of tile
shapes per form (one token: elementwise tiles of 4-32 rows; more tokens: tensor-core tiles), each with
split-K off and at the balanced split, and the work ordered by what decode reads most (M 1 first, the
8b shapes before the 1b ones). ``budget_s`` stops the sweep when spent; untuned entries keep the
default.

The FP8 W8A8 kinds (``MMA_KINDS``: activations quantized in the kernel, e4m3 x e4m3 dots) are tuned
only when named; ``compare_forms`` times both FP8 forms per shape and M on the tables in force.
"""

from __future__ import annotations

import multiprocessing as mp
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, replace
from typing import Any

import torch

from plait.bench.hardware import graph_time
from plait.bench.shapes import linear_shapes
from plait.layers.quantization.gemv import device_info, gemv, plan_launch
from plait.layers.quantization.gemv_config import (
    M_BUCKETS,
    GemvConfig,
    balanced_split,
    default_config,
    gemv_takes,
    shape_key,
)

TUNED_SHAPES = ("llama-3.1-8b", "llama-3.2-1b")
TUNED_KINDS = ("fp8_channel", "bf16", "fp8_block")
ROTATE_BYTES = 256 << 20  # weight copies per case: >= 5x the H200's 50 MB L2
# The FP8 W8A8 (tensor-core) kinds: tuned on their own (``--kinds``), not in the default sweep.
MMA_KINDS = ("fp8_channel_mma", "fp8_block_mma")


def is_w8a8(kind: str) -> bool:
    """Whether a kind's calls take the W8A8 form (``gemv(..., w8a8=True)``)."""
    return kind.endswith("_mma")


def weight_kind(kind: str) -> str:
    """The weight a kind multiplies: its dtype and scale layout, without the form."""
    return kind.removesuffix("_mma")


def _tiles(kind: str, m: int, wide: bool = False) -> list[tuple[int, int, int, int]]:
    """(block_n, block_k in bytes, num_warps, num_stages) tried for a kind and token count."""
    if is_w8a8(kind):
        # A step is one 128-column group whatever M is; 16+ weight rows per warp (one warpgroup MMA per
        # 4 warps); what varies is the bytes in flight: rows per program and pipeline depth.
        return [(64, 128, 4, 4), (64, 128, 4, 6), (64, 128, 4, 8), (128, 128, 4, 3), (128, 128, 4, 4),
                (128, 128, 4, 6), (128, 128, 8, 4), (128, 128, 8, 6), (256, 128, 4, 4), (256, 128, 8, 3),
                (256, 128, 8, 4)]
    if m == 1:
        tiles = [(4, 1024, 4, 3), (4, 512, 4, 4), (8, 512, 4, 3), (8, 1024, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 3),
                 (8, 512, 4, 1)]
        if kind == "fp8_channel":  # twice the elements per byte: deeper pipelines and longer K steps too
            tiles += [(8, 1024, 4, 4), (8, 2048, 4, 3), (8, 2048, 8, 3), (4, 2048, 4, 3), (16, 2048, 8, 3),
                      (8, 1024, 8, 4), (4, 1024, 2, 4)]
        if kind == "fp8_block":  # a step lies in one 128-column scale block: taller tiles instead
            tiles = [(16, 128, 4, 4), (32, 128, 4, 3), (32, 128, 8, 3), (64, 128, 8, 3), (16, 128, 2, 4)]
    else:
        tiles = [(16, 256, 4, 4), (32, 256, 4, 4), (32, 512, 4, 3), (64, 256, 4, 3)]
        if kind == "fp8_block":
            tiles = [(16, 128, 4, 4), (32, 128, 4, 4), (64, 128, 4, 3), (64, 128, 8, 3)]
        elif wide:
            tiles += WIDE_DOT_TILES
    return tiles


# ``--wide`` (2..16 tokens, the tensor-core form, weights without block scales): rows per program, bytes
# per step, warps and pipeline depth around the four tiles above, for a search the default budget skips.
WIDE_DOT_TILES = [(16, 256, 2, 4), (16, 512, 4, 3), (16, 512, 4, 4), (16, 1024, 4, 3), (16, 128, 2, 6),
                  (32, 128, 4, 5), (32, 256, 4, 3), (32, 256, 4, 5), (32, 512, 8, 4), (32, 512, 8, 3),
                  (32, 1024, 8, 3), (32, 256, 8, 4), (64, 128, 4, 4), (64, 256, 4, 4), (64, 256, 8, 3),
                  (64, 512, 8, 3), (64, 128, 8, 6)]


# 2..16 tokens, the tensor-core form with swapped operands (``GemvConfig.swap_ab``: the weight rows are the
# dot's M, so a 64-row tile per 4 warps is one warpgroup MMA): rows, bytes per step, warps, pipeline depth.
SWAP_TILES = [(64, 256, 4, 3), (64, 256, 4, 4), (64, 512, 4, 3), (64, 128, 4, 6), (128, 256, 4, 3),
              (128, 256, 8, 4)]
SWAP_TILES_BLOCK = [(64, 128, 4, 4), (64, 128, 4, 6), (128, 128, 8, 4)]  # fp8 block scales: 128-column steps


def candidates(kind: str, m: int, n: int, k: int, num_sms: int, wide: bool = False) -> list[GemvConfig]:
    """The configs tried for one case: each tile with split-K off and at the balanced split (W8A8 tiles
    at half of it too; the split's value does not change the compiled kernel), at 2..16 tokens the
    SWAP_TILES with swapped operands too; ``wide`` adds WIDE_DOT_TILES at 2..16 tokens."""
    elem = 1 if kind.startswith("fp8") else 2
    out: list[GemvConfig] = []
    tiles = [(*tile, False) for tile in _tiles(kind, m, wide)]
    if m > 1 and not is_w8a8(kind):
        tiles += [(*tile, True) for tile in (SWAP_TILES_BLOCK if kind == "fp8_block" else SWAP_TILES)]
    for block_n, k_bytes, warps, stages, swap in tiles:
        block_k = k_bytes // elem
        base = GemvConfig(block_n=block_n, block_k=block_k, split_k=1, num_warps=warps, num_stages=stages,
                          swap_ab=swap)
        rows = max(block_n, 16 * warps) if is_w8a8(kind) or swap else max(block_n, 1 if m == 1 else 16)
        split = balanced_split(-(-n // rows), -(-k // block_k), num_sms)
        splits = [split] if split > 1 else []
        if is_w8a8(kind) and split >= 4:  # tall tiles carry more bytes in flight: fewer programs may do
            splits.append(split // 2)
        out += [base] + [replace(base, split_k=s) for s in splits]
    default = default_config(kind, m, n, k, num_sms)
    return out + ([default] if default not in out else [])


@dataclass
class Case:
    kind: str
    n: int
    k: int
    m: int
    layers: list[str]  # the projections of this (N, K), e.g. ["llama-3.1-8b/o_proj"]


def cases(shapes: tuple[str, ...], kinds: tuple[str, ...], ms: tuple[int, ...]) -> list[Case]:
    """Every (kind, N, K, M) once, in tuning order: M 1 first, then by kind, then shape."""
    shapes_nk: dict[tuple[int, int], list[str]] = {}
    for shape in shapes:
        for layer, nk in linear_shapes(shape).items():
            shapes_nk.setdefault(nk, []).append(f"{shape}/{layer}")
    order = sorted(ms, key=lambda m: (m != 1, m))
    return [Case(kind, n, k, m, layers) for m in order for kind in kinds for (n, k), layers in shapes_nk.items()]


def make_weights(kind: str, n: int, k: int, rotate: bool = True, device: str = "cuda"
             ) -> tuple[list[torch.Tensor], torch.Tensor | None, tuple[int, int] | None]:
    """Copies of one weight (>= ROTATE_BYTES in all; one copy without ``rotate``), its scale and block."""
    w = torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
    scale: torch.Tensor | None = None
    block: tuple[int, int] | None = None
    kind = weight_kind(kind)
    if kind == "fp8_channel":
        from plait.layers.quantization.fp8_kernels import quantize_weight_per_channel

        w, scale = quantize_weight_per_channel(w)
    elif kind == "fp8_block":
        w = w.to(torch.float8_e4m3fn)
        scale, block = torch.rand(-(-n // 128), -(-k // 128), device=device) * 1e-3 + 1e-4, (128, 128)
    elif kind == "fp16":
        w = w.half()
    copies = max(2, ROTATE_BYTES // (n * k * w.element_size())) if rotate else 1
    return [w.clone() for _ in range(copies)], scale, block


def time_config(x: torch.Tensor, ws: list[torch.Tensor], scale: torch.Tensor | None, block: tuple[int, int] | None,
                cfg: GemvConfig | None, reps: int = 2, w8a8: bool = False) -> float:
    """Seconds per call of ``gemv`` with ``cfg`` (None: the table's / default) over the rotated copies."""
    calls: list[Callable[[], Any]] = [lambda w=w: gemv(x, w, scale, block, cfg, w8a8=w8a8 and scale is not None)
                                      for w in ws]
    return graph_time(calls, reps=reps)


def time_cublas(x: torch.Tensor, ws: list[torch.Tensor], reps: int = 2) -> float:
    """Seconds per ``F.linear(x, w)`` (cuBLAS on CUDA) over the rotated copies, timed as ``time_config``."""
    return graph_time([lambda w=w: torch.nn.functional.linear(x, w) for w in ws], reps=reps)


W8A8_TOLERANCE = 5e-2  # rel_error a W8A8 config may show and still count as computing the product


def rel_error(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None, block: tuple[int, int] | None,
              cfg: GemvConfig, w8a8: bool = False) -> float:
    """Max error of ``gemv`` with ``cfg`` relative to the largest entry of its fp32 reference: the
    dequantized-weight product, with ``w8a8`` of the activations quantized as the W8A8 form does."""
    from plait.layers.quantization.fp8_kernels import dequantize_weight, reference_w8a8_gemv

    if scale is None:
        ref = x.float() @ w.float().t()
    elif w8a8:
        ref = reference_w8a8_gemv(x.float(), w, scale, block)
    else:
        ref = x.float() @ dequantize_weight(w, scale, block).t()
    return float((gemv(x, w, scale, block, cfg, w8a8=w8a8 and scale is not None).float() - ref).abs().max()
                 / ref.abs().max())


def tune_case(case: Case, ws: list[torch.Tensor], scale: torch.Tensor | None, block: tuple[int, int] | None,
              num_sms: int, wide: bool = False) -> dict[str, Any]:
    """Every candidate of one case timed; the result row (best config, its time and the default's)."""
    x = torch.randn(case.m, case.k, device=ws[0].device, dtype=torch.bfloat16)
    weight_bytes = case.n * case.k * ws[0].element_size()
    timed: list[tuple[float, GemvConfig]] = []
    w8a8 = is_w8a8(case.kind)
    for cfg in candidates(case.kind, case.m, case.n, case.k, num_sms, wide):
        try:
            timed.append((time_config(x, ws, scale, block, cfg, w8a8=w8a8), cfg))
        except Exception as e:  # a config the compiler or the device rejects (shared memory, registers)
            print(f"  {cfg}: {type(e).__name__}: {str(e)[:120]}")
    if not timed:
        raise RuntimeError(f"gemv tune: no config ran for {case}")
    timed.sort(key=lambda t: t[0])
    # The fastest config that computes the product: a broken one never lands in the table (its error is
    # of the order of the product). The W8A8 form rounds activations to fp8 (3 mantissa bits), and an
    # element the kernel rounds one step off the reference's moves a small-K output by up to a few
    # percent of the largest (2.4% at K = 256 over 4000 random draws), hence its looser bound.
    bound = W8A8_TOLERANCE if w8a8 else 1e-2
    correct = ((t, c) for t, c in timed if rel_error(x, ws[0], scale, block, c, w8a8=w8a8) < bound)
    best_s, best = next(correct, (None, None))
    if best is None or best_s is None:
        raise RuntimeError(f"gemv tune: no config of {case} matches the fp32 reference")
    default = default_config(case.kind, case.m, case.n, case.k, num_sms)
    default_s = next((t for t, c in timed if c == default), float("nan"))
    row = {"kind": case.kind, "N": case.n, "K": case.k, "M": case.m, "layers": case.layers}
    if case.m > 1 and case.kind in ("bf16", "fp16"):  # dense layers may call cuBLAS instead (gemv_takes)
        cublas_s = time_cublas(x.to(ws[0].dtype), ws)
        best = replace(best, prefer_cublas=cublas_s < best_s)
        row |= {"cublas_us": cublas_s * 1e6, "cublas_tb_s": weight_bytes / cublas_s / 1e12}
    return row | {"best": best.to_json(), "best_us": best_s * 1e6, "best_tb_s": weight_bytes / best_s / 1e12,
                  "default": default.to_json(), "default_us": default_s * 1e6,
                  "default_tb_s": weight_bytes / default_s / 1e12, "configs_timed": len(timed)}


def _compile_work(all_cases: list[Case], num_sms: int, wide: bool = False
                  ) -> list[tuple[str, int, int, int, dict[str, int]]]:
    """One (kind, N, K, M, config) per distinct compiled kernel among every case's candidates."""
    seen: set[tuple[Any, ...]] = set()
    work = []
    for c in all_cases:
        block = (128, 128) if weight_kind(c.kind) == "fp8_block" else None
        for cfg in candidates(c.kind, c.m, c.n, c.k, num_sms, wide):
            key = (c.kind, plan_launch(c.m, c.n, c.k, block, cfg, is_w8a8(c.kind)).compile_key())
            if key not in seen:
                seen.add(key)
                work.append((c.kind, c.n, c.k, c.m, cfg.to_json()))
    return work


def _precompile_chunk(items: list[tuple[str, int, int, int, dict[str, int]]]) -> int:
    """Worker process: run each config once so Triton writes its kernel to the on-disk cache."""
    done = 0
    loaded: tuple[tuple[str, int, int], Any] | None = None
    for kind, n, k, m, raw in items:
        if loaded is None or loaded[0] != (kind, n, k):
            loaded = ((kind, n, k), make_weights(kind, n, k, rotate=False))
        (w,), scale, block = loaded[1]
        try:
            gemv(torch.randn(m, k, device="cuda", dtype=torch.bfloat16), w, scale, block, GemvConfig.from_json(raw),
                 w8a8=is_w8a8(kind))
            done += 1
        except Exception:  # out of shared memory / registers: the timing loop reports it
            pass
    torch.cuda.synchronize()
    return done


def precompile(all_cases: list[Case], num_sms: int, jobs: int, timeout_s: float, wide: bool = False) -> None:
    """Compile every candidate in ``jobs`` spawned processes first (compiles dominate a cold sweep; the
    timing loop then loads them from Triton's cache). A failure, a crashed worker or ``timeout_s``
    leaves the remaining compiles to the timing loop."""
    work = sorted(_compile_work(all_cases, num_sms, wide), key=lambda w: w[:3])
    if jobs <= 1 or not work:
        return
    per = -(-len(work) // (2 * jobs))
    chunks = [work[i : i + per] for i in range(0, len(work), per)]
    t0 = time.perf_counter()
    pool = ProcessPoolExecutor(min(jobs, len(chunks)), mp_context=mp.get_context("spawn"))
    done = 0
    try:
        for future in as_completed([pool.submit(_precompile_chunk, c) for c in chunks], timeout=timeout_s):
            done += future.result()
    except Exception as e:  # BrokenProcessPool, TimeoutError, ...
        print(f"gemv tune: precompile stopped ({type(e).__name__}: {e}); compiling in the timing loop")
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    print(f"gemv tune: precompiled {done}/{len(work)} kernels in {time.perf_counter() - t0:.1f} s", flush=True)


def tune(shapes: tuple[str, ...] = TUNED_SHAPES, kinds: tuple[str, ...] = TUNED_KINDS,
         ms: tuple[int, ...] = M_BUCKETS, budget_s: float = 55.0, jobs: int = 1,
         save: Callable[[dict[str, Any], list[dict[str, Any]]], None] | None = None, device: str = "cuda",
         wide: bool = False) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """(table in the config file's layout, result rows). Stops starting cases once ``budget_s`` is spent
    (the precompile included). ``save(table, rows)`` runs after every weight's cases, so a run stopped
    from outside keeps what it measured. ``device`` "cpu": the Triton interpreter (tests)."""
    _, num_sms = device_info(torch.empty(0, device=device))
    start = time.perf_counter()
    all_cases = cases(shapes, kinds, ms)
    precompile(all_cases, num_sms, jobs, timeout_s=budget_s / 2, wide=wide)
    table: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    for (kind, n, k), group in _grouped(all_cases):
        if time.perf_counter() - start > budget_s:
            print(f"gemv tune: budget of {budget_s:.0f} s spent; the remaining cases keep the default")
            break
        ws, scale, block = make_weights(kind, n, k, rotate=device == "cuda", device=device)
        for case in group:
            if time.perf_counter() - start > budget_s:
                break
            row = tune_case(case, ws, scale, block, num_sms, wide)
            rows.append(row)
            table.setdefault(kind, {}).setdefault(shape_key(n, k), {})[str(case.m)] = row["best"]
            cublas = f", cuBLAS {row['cublas_us']:.2f} us" if "cublas_us" in row else ""
            print(f"{kind:12s} N={n:6d} K={k:6d} M={case.m:2d}: best {row['best_us']:7.2f} us "
                  f"{row['best_tb_s']:.2f} TB/s {row['best']}  (default {row['default_us']:.2f} us{cublas})")
        del ws
        if device == "cuda":
            torch.cuda.empty_cache()
        if save is not None:
            save(table, rows)
    print(f"gemv tune: {len(rows)} cases in {time.perf_counter() - start:.1f} s")
    return table, rows


def _grouped(all_cases: list[Case]) -> Iterator[tuple[tuple[str, int, int], list[Case]]]:
    """Consecutive cases of one (kind, N, K) share one set of weight copies. The order is M-major, so
    group by (M bucket class, kind, N, K): M 1 first for every shape, then the other buckets together."""
    groups: dict[tuple[bool, str, int, int], list[Case]] = {}
    for c in all_cases:
        groups.setdefault((c.m != 1, c.kind, c.n, c.k), []).append(c)
    for (_, kind, n, k), group in groups.items():
        yield (kind, n, k), group


def compare_forms(shapes: tuple[str, ...], ms: tuple[int, ...], device: str = "cuda") -> list[dict[str, Any]]:
    """FP8 weight-only against W8A8 per projection, scale layout and M, each on the config its own kind's
    table gives (``PLAIT_GEMV_CONFIG_DIR`` first, as at run time), timed as ``tune`` times: rows of us
    and TB/s (weight bytes read, scales included) of both forms. ``device`` "cpu": the interpreter."""
    rows: list[dict[str, Any]] = []
    for layout in ("fp8_channel", "fp8_block"):
        for c in cases(shapes, (layout,), (1,)):
            ws, scale, block = make_weights(layout, c.n, c.k, rotate=device == "cuda", device=device)
            assert scale is not None
            weight_bytes = c.n * c.k + 4 * scale.numel()
            for m in ms:
                x = torch.randn(m, c.k, device=device, dtype=torch.bfloat16)
                row: dict[str, Any] = {"kind": layout, "N": c.n, "K": c.k, "M": m, "layers": c.layers}
                for form, w8a8 in (("weight_only", False), ("w8a8", True)):
                    seconds = time_config(x, ws, scale, block, None, reps=4, w8a8=w8a8)
                    row[form] = {"us": seconds * 1e6, "tb_s": weight_bytes / seconds / 1e12}
                row["speedup"] = row["weight_only"]["us"] / row["w8a8"]["us"]
                rows.append(row)
                print(f"compare {layout:11s} N={c.n:6d} K={c.k:6d} M={m:2d}: weight-only "
                      f"{row['weight_only']['us']:7.2f} us {row['weight_only']['tb_s']:.2f} TB/s | w8a8 "
                      f"{row['w8a8']['us']:7.2f} us {row['w8a8']['tb_s']:.2f} TB/s | x{row['speedup']:.2f}", flush=True)
            del ws
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


def compare_cublas(shapes: tuple[str, ...], ms: tuple[int, ...], extra: dict[str, tuple[int, int]] | None = None,
                   device: str = "cuda") -> list[dict[str, Any]]:
    """bf16 weights: the GEMV on the config in force (the table's, else ``default_config``) against
    cuBLAS (``F.linear``) per projection of ``shapes`` and the ``extra`` (N, K) named in it (an lm_head)
    and per M: rows of us and TB/s of weight bytes read, timed as ``tune`` times, and which of the two
    a dense layer takes there (``gemv_takes``: past one token only where this device's table says)."""
    rows: list[dict[str, Any]] = []
    nks = [(c.n, c.k, c.layers) for c in cases(shapes, ("bf16",), (1,))]
    nks += [(n, k, [name]) for name, (n, k) in (extra or {}).items()]
    name = torch.cuda.get_device_name() if device == "cuda" else "cpu"
    for n, k, layers in nks:
        ws, _, _ = make_weights("bf16", n, k, rotate=device == "cuda", device=device)
        for m in ms:
            takes = "gemv" if gemv_takes("bf16", m, n, k, name) else "cublas"
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            forms = {"gemv": time_config(x, ws, None, None, None, reps=4),
                     "cublas": time_cublas(x, ws, reps=4)}
            row: dict[str, Any] = {"N": n, "K": k, "M": m, "layers": layers, "dense_layers_take": takes,
                                   **{f: {"us": t * 1e6, "tb_s": 2 * n * k / t / 1e12} for f, t in forms.items()}}
            row["cublas_speedup"] = forms["gemv"] / forms["cublas"]
            rows.append(row)
            print(f"N={n:6d} K={k:6d} M={m:2d} (dense layers take {takes}): " + " | ".join(
                f"{f} {row[f]['us']:7.2f} us {row[f]['tb_s']:.2f} TB/s" for f in forms), flush=True)
        del ws
        if device == "cuda":
            torch.cuda.empty_cache()
    return rows


def w8a8_preferences(rows: list[dict[str, Any]], weight_only_entry: Callable[[str, int, int, int], GemvConfig],
                     margin: float = 1.05) -> dict[str, Any]:
    """Table entries (the config file's layout) for ``compare_forms`` rows: each case's weight-only config
    in force (``weight_only_entry(kind, m, n, k)``) at the bucket of its M, with ``prefer_w8a8`` where
    W8A8 measured at least ``margin`` times faster, and without it elsewhere."""
    table: dict[str, Any] = {}
    for r in rows:
        cfg = replace(weight_only_entry(r["kind"], r["M"], r["N"], r["K"]), prefer_w8a8=r["speedup"] >= margin)
        table.setdefault(r["kind"], {}).setdefault(shape_key(r["N"], r["K"]), {})[str(r["M"])] = cfg.to_json()
    return table
