"""Micro-benchmarks of the Triton attention kernels (CUDA only).

Workloads (llama-3.1-8b attention shape: 32 q / 8 kv heads, head dim 128, bf16, page size 1):
  attn-decode  bs=1 ctx=384, bs=256 ctx=640 (plus bs=1 ctx=32k and bs=64 ctx=4k for context)
  attn-extend  8 x 2048 new tokens, no prefix; 8 x 2048 new tokens over a 2048-token cached prefix

Timing: torch.cuda.Event around each call, L2 flushed (256 MiB write) before each timed call, median
of --iters after --warmup calls. Decode is timed both eagerly (host launch cost included) and as a CUDA
graph replay (GPU time only, what the engine sees under graphs). The KV cache is scattered over random
slots (page size 1), the worst case for locality.

Floors, measured in the same run: decode = bytes read (K/V + indices + q/o) / read-only HBM bandwidth
(a large fp32 sum; copy bandwidth is reported too); extend = causal attention FLOPs / bf16 matmul rate
(8192^3). Peers: torch SDPA on dense, unpaged K/V of the same shape (decode: enable_gqa; extend: K/V
repeated to 32 heads outside the timed region so the flash backend applies).

  python benchmarks/kernels_bench.py [--out-dir benchmarks/results] [--sweep]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from plait.attention.triton import kernels as K  # noqa: E402
from plait.attention.triton.decode import DEFAULT_MIN_SPLIT_LEN, DEFAULT_PROGRAMS_PER_SM  # noqa: E402

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
# Where a batch's KV slots lie (--kv-layout): "random" (every slot anywhere: a fragmented pool),
# "contiguous" (each request's slots consecutive: the best locality an allocator could give), or
# "decode" (each request's first half consecutive, as a prefill allocates it, and the rest one slot per
# request per step, interleaved across the batch, as decode steps allocate them).
KV_LAYOUTS = ("random", "contiguous", "decode")
KV_LAYOUT = "random"
# Decode contexts: 0, every request at ``ctx``; LO > 0, uniform in [LO, 2 * ctx - LO] per request (mean ctx),
# as a batch of requests admitted at different lengths and decoding for different times holds them.
RAGGED_LO = 0
# Decode's split merge inside the split kernel (split counters given), as the Triton backend runs it
# unless PLAIT_TRITON_DECODE_TWO_STAGE=1; False (--two-stage): the separate merge kernel.
FUSED_MERGE = True
ELEM = 2  # bytes per bf16


# ---------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------


class Timer:
    def __init__(self, iters: int, warmup: int) -> None:
        self.iters = iters
        self.warmup = warmup
        self.flush_buf = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")

    def __call__(self, fn: Callable[[], Any], flush: bool = True) -> float:
        """Median milliseconds of one call of ``fn``."""
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        events = []
        for _ in range(self.iters):
            if flush:
                self.flush_buf.zero_()
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) for s, e in events)

    def graph(self, fn: Callable[[], Any], flush: bool = True) -> float:
        """Median milliseconds of one replay of a CUDA graph holding one call of ``fn``."""
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                fn()
        torch.cuda.current_stream().wait_stream(s)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            fn()
        return self(g.replay, flush=flush)


def measure_device(timer: Timer) -> dict[str, float]:
    n = 1 << 30  # 1 Gi fp32 elements = 4 GiB, far beyond L2

    def bandwidth_ms() -> tuple[float, float]:
        x = torch.empty(n, dtype=torch.float32, device="cuda").normal_()
        y = torch.empty_like(x)
        return timer(lambda: y.copy_(x), flush=False), timer(lambda: x.sum(), flush=False)

    copy_ms, read_ms = bandwidth_ms()
    a = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    b = torch.randn(8192, 8192, dtype=DTYPE, device="cuda")
    mm_ms = timer(lambda: a @ b, flush=False)
    return {
        "copy_bw_GBps": 2 * n * 4 / copy_ms / 1e6,  # read + write
        "read_bw_GBps": n * 4 / read_ms / 1e6,
        "bf16_matmul_TFLOPs": 2 * 8192**3 / mm_ms / 1e9,
    }


# ---------------------------------------------------------------------------------------------------
# problem builders
# ---------------------------------------------------------------------------------------------------


def kv_slots(lens: list[int], num_slots: int, gen: torch.Generator) -> torch.Tensor:
    """The slots of every request, request-major, in the ``KV_LAYOUT`` layout (int64 [sum(lens)])."""
    total = sum(lens)
    if KV_LAYOUT == "random":
        return torch.randperm(num_slots, generator=gen)[:total]
    if KV_LAYOUT == "contiguous":
        return torch.arange(total)
    # "decode": prefills first (consecutive runs), then the decode steps, step-major across requests.
    prompts = [n - n // 2 for n in lens]
    prompt_start = [0]
    for n in prompts[:-1]:
        prompt_start.append(prompt_start[-1] + n)
    base = sum(prompts)
    out, live = [], len(lens)
    for i, n in enumerate(lens):
        step_slots = [base + step * live + i for step in range(n // 2)]
        out.append(torch.cat([torch.arange(prompt_start[i], prompt_start[i] + prompts[i]),
                              torch.tensor(step_slots, dtype=torch.long)]))
    slots = torch.cat(out)
    assert int(slots.max()) < num_slots, "the decode layout assumes requests of one length"
    return slots


def paged_kv(lens: list[int], gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """K/V buffers over slots laid out as ``KV_LAYOUT``; returns (k_buf, v_buf, kv_indptr, kv_indices)."""
    total = sum(lens)
    num_slots = total + 1024
    slots = kv_slots(lens, num_slots, gen).to(torch.int32).cuda()
    k_buf = torch.randn(num_slots, HKV, D, dtype=DTYPE, device="cuda")
    v_buf = torch.randn(num_slots, HKV, D, dtype=DTYPE, device="cuda")
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device="cuda")
    indptr[1:] = torch.cumsum(torch.tensor(lens, device="cuda"), 0)
    return k_buf, v_buf, indptr, slots


def bench_decode(
    timer: Timer,
    bs: int,
    ctx: int,
    max_kv_splits: int,
    num_sms: int,
    config: K.LaunchConfig | None = None,
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
    with_peer: bool = True,
    layers: int = 0,
) -> dict[str, Any]:
    """Per-layer decode attention cost. The split counts are chosen once per batch (as the backend does,
    in its metadata step) and timed on their own. ``layers`` > 0 also times one graph of that many
    decode calls over distinct per-layer caches, without L2 flushes (the model's steady state)."""
    gen = torch.Generator().manual_seed(bs * 100003 + ctx)
    lens = (torch.randint(RAGGED_LO, 2 * ctx - RAGGED_LO + 1, (bs,), generator=gen).tolist() if RAGGED_LO
            else [ctx] * bs)
    k_buf, v_buf, indptr, indices = paged_kv(lens, gen)
    q = torch.randn(bs, HQ, D, dtype=DTYPE, device="cuda")
    o = torch.empty_like(q)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    logits = torch.empty(bs, HQ, max_kv_splits, D, dtype=torch.float32, device="cuda")
    lse = torch.empty(bs, HQ, max_kv_splits, dtype=torch.float32, device="cuda")
    scale = D**-0.5

    def choose_splits() -> None:
        K.get_num_kv_splits(seq_lens, splits, max_kv_splits, num_sms, HKV, programs_per_sm, min_split_len)

    counters = torch.zeros(bs * HQ, dtype=torch.int32, device="cuda") if FUSED_MERGE else None

    def run(kb: torch.Tensor = k_buf, vb: torch.Tensor = v_buf) -> None:
        K.decode_attention_fwd(q, kb, vb, o, indptr, indices, logits, lse, splits, max_kv_splits, scale, config=config,
                               split_counters=counters)

    choose_splits()
    eager_ms = timer(run)
    graph_ms = timer.graph(run)
    tokens = sum(lens)
    bytes_read = tokens * HKV * 2 * D * ELEM + tokens * 4 + 2 * bs * HQ * D * ELEM
    out: dict[str, Any] = {
        "bs": bs,
        "ctx": ctx,
        "max_kv_splits": max_kv_splits,
        "num_kv_splits": int(splits.max()),
        "eager_us": eager_ms * 1e3,
        "graph_us": graph_ms * 1e3,
        "split_choice_graph_us": timer.graph(choose_splits) * 1e3,
        "bytes": bytes_read,
        "graph_GBps": bytes_read / graph_ms / 1e6,
        "eager_GBps": bytes_read / eager_ms / 1e6,
    }
    if layers > 0:
        caches = [(torch.randn_like(k_buf), torch.randn_like(v_buf)) for _ in range(layers)]

        def all_layers() -> None:
            for kb, vb in caches:
                run(kb, vb)

        out[f"graph_{layers}_layers_us_per_layer"] = timer.graph(all_layers, flush=False) * 1e3 / layers
    if with_peer:
        # Dense, unpaged K/V of the same shape through torch SDPA.
        kd = torch.randn(bs, HKV, ctx, D, dtype=DTYPE, device="cuda")
        vd = torch.randn(bs, HKV, ctx, D, dtype=DTYPE, device="cuda")
        qd = q.view(bs, HQ, 1, D)
        out["peer_us"] = timer(lambda: F.scaled_dot_product_attention(qd, kd, vd, enable_gqa=True)) * 1e3
    return out


def bench_extend(
    timer: Timer,
    bs: int,
    ext: int,
    prefix: int,
    config: K.LaunchConfig | None = None,
    with_peer: bool = True,
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(bs * 7919 + ext + prefix)
    k_buf, v_buf, kv_indptr, kv_indices = paged_kv([max(prefix, 0)] * bs, gen)
    t = bs * ext
    q = torch.randn(t, HQ, D, dtype=DTYPE, device="cuda")
    k = torch.randn(t, HKV, D, dtype=DTYPE, device="cuda")
    v = torch.randn(t, HKV, D, dtype=DTYPE, device="cuda")
    o = torch.empty_like(q)
    qo_indptr = torch.arange(0, t + 1, ext, dtype=torch.int32, device="cuda")
    scale = D**-0.5

    def run() -> None:
        K.extend_attention_fwd(
            q, k, v, o, k_buf, v_buf, qo_indptr, kv_indptr, kv_indices, None, None, ext, scale, config=config
        )

    ms = timer(run)
    # QK^T and PV, 2 FLOPs per MAC: each new token i (0-based) sees prefix + i + 1 keys.
    visible = bs * (prefix * ext + ext * (ext + 1) // 2)
    flops = 4 * HQ * D * visible
    out: dict[str, Any] = {
        "bs": bs,
        "ext": ext,
        "prefix": prefix,
        "us": ms * 1e3,
        "flops": flops,
        "TFLOPs": flops / ms / 1e9,
    }
    if with_peer and prefix == 0:
        qd = q.view(bs, ext, HQ, D).transpose(1, 2)
        kd = k.view(bs, ext, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()
        vd = v.view(bs, ext, HKV, D).transpose(1, 2).repeat_interleave(HQ // HKV, 1).contiguous()
        out["peer_us"] = timer(lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True)) * 1e3
    return out


# ---------------------------------------------------------------------------------------------------
# reporting
# ---------------------------------------------------------------------------------------------------


def _commit() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=os.path.dirname(__file__)
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _versions() -> dict[str, str | None]:
    import triton

    try:
        import transformers

        tf: str | None = transformers.__version__
    except ImportError:
        tf = None
    return {"torch": torch.__version__, "triton": triton.__version__, "transformers": tf}


def write_result(out_dir: str | None, record: dict[str, Any]) -> None:
    print(json.dumps(record, indent=None, default=str))
    if not out_dir:
        return
    os.makedirs(out_dir, exist_ok=True)
    device = record["device"].replace(" ", "_")
    name = f"{record['date']}-{record['workload']}-{record['shape']}-{device}.json"
    with open(os.path.join(out_dir, name), "w") as f:
        json.dump(record, f, indent=2, default=str)


def main() -> None:
    global HQ, HKV, D
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=None, help="write one JSON per workload/shape here")
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--max-kv-splits", type=int, default=32)
    parser.add_argument("--sweep", action="store_true", help="also sweep launch configs and split heuristics")
    parser.add_argument("--sweep-decode", default=None, metavar="BSxCTX,...",
                        help="only sweep decode launch configs x split heuristics at these shapes (e.g. 128x576)")
    parser.add_argument("--sweep-extend", default=None, metavar="BSxEXT+PREFIX,...",
                        help="only sweep extend launch configs at these shapes (e.g. 16x512+0)")
    parser.add_argument("--kv-layout", choices=KV_LAYOUTS, default="random",
                        help="where the KV slots lie (see KV_LAYOUTS); default random")
    parser.add_argument("--two-stage", action="store_true",
                        help="decode with the separate split-merge kernel (default: the merge inside the split "
                             "kernel, as the Triton backend runs it)")
    parser.add_argument("--ragged", type=int, default=0, metavar="LO",
                        help="decode contexts uniform in [LO, 2 x CTX - LO] per request instead of CTX each")
    parser.add_argument("--heads", default=None, metavar="HQ,HKV,D",
                        help=f"attention heads and head dim (default {HQ},{HKV},{D}: llama-3.1-8b; 32,8,64: 3.2-1b)")
    args = parser.parse_args()
    global KV_LAYOUT, RAGGED_LO, FUSED_MERGE
    KV_LAYOUT = args.kv_layout
    RAGGED_LO = args.ragged
    FUSED_MERGE = not args.two_stage
    if args.heads:
        HQ, HKV, D = (int(v) for v in args.heads.split(","))
    if not torch.cuda.is_available():
        raise SystemExit("kernels_bench.py needs a CUDA GPU")

    timer = Timer(args.iters, args.warmup)
    props = torch.cuda.get_device_properties(0)
    num_sms = props.multi_processor_count
    if args.sweep_extend:
        sweep_extend(timer, [tuple(int(v) for v in shape.replace("+", "x").split("x"))
                             for shape in args.sweep_extend.split(",")])
        return
    if args.sweep_decode:
        shapes = [tuple(int(v) for v in shape.split("x")) for shape in args.sweep_decode.split(",")]
        sweep_decode(timer, shapes, args.max_kv_splits, num_sms)
        return
    dev = measure_device(timer)
    print(f"# {props.name}: {num_sms} SMs, {json.dumps({k: round(v, 1) for k, v in dev.items()})}")
    base = {
        "device": torch.cuda.get_device_name(0),
        "commit": _commit(),
        "date": dt.date.today().isoformat(),
        "versions": _versions(),
        "measured": dev,
    }

    decode_shapes = [(1, 384), (256, 640), (1, 32768), (64, 4096)]
    for bs, ctx in decode_shapes:
        cfg, _ = K.decode_config(torch.empty(bs, device="cuda"), D, HKV)
        r = bench_decode(timer, bs, ctx, args.max_kv_splits, num_sms, layers=32 if bs * ctx <= 4096 else 0)
        floor_us = r["bytes"] / (dev["read_bw_GBps"] * 1e3)
        write_result(
            args.out_dir,
            {
                **base,
                "workload": "attn-decode",
                "shape": f"bs{bs}-ctx{ctx}-h{HQ}kv{HKV}d{D}-bf16",
                "metric": "decode_attention_us_graph",
                "plait": r["graph_us"],
                "peer_name": "torch SDPA (dense unpaged KV, enable_gqa)",
                "peer": r.get("peer_us"),
                "ratio_vs_peer": (r["peer_us"] / r["graph_us"]) if r.get("peer_us") else None,
                "floor": floor_us,
                "fraction_of_floor": floor_us / r["graph_us"],
                "config": {
                    "stage1": asdict(cfg),
                    "max_kv_splits": args.max_kv_splits,
                    "programs_per_sm": DEFAULT_PROGRAMS_PER_SM,
                    "min_split_len": DEFAULT_MIN_SPLIT_LEN,
                    "kv_layout": f"page size 1, {KV_LAYOUT} slots",
                },
                "detail": r,
            },
        )

    for bs, ext, prefix in [(8, 2048, 0), (8, 2048, 2048)]:
        cfg = K.extend_config(torch.empty(1, device="cuda"), D, ext, HQ // HKV)
        r = bench_extend(timer, bs, ext, prefix)
        floor_us = r["flops"] / (dev["bf16_matmul_TFLOPs"] * 1e6)
        write_result(
            args.out_dir,
            {
                **base,
                "workload": "attn-extend",
                "shape": f"{bs}x{ext}-prefix{prefix}-h{HQ}kv{HKV}d{D}-bf16",
                "metric": "extend_attention_us",
                "plait": r["us"],
                "peer_name": "torch SDPA causal (dense, K/V repeated to 32 heads)" if prefix == 0 else None,
                "peer": r.get("peer_us"),
                "ratio_vs_peer": (r["peer_us"] / r["us"]) if r.get("peer_us") else None,
                "floor": floor_us,
                "fraction_of_floor": floor_us / r["us"],
                "config": {"kernel": asdict(cfg), "causal": True, "kv_layout": f"page size 1, {KV_LAYOUT} slots"},
                "detail": r,
            },
        )

    if args.sweep:
        sweep(Timer(iters=20, warmup=3), args.max_kv_splits, num_sms)


def sweep_decode(timer: Timer, shapes: list[tuple[int, ...]], max_kv_splits: int, num_sms: int) -> None:
    """Every stage-1 launch config x split heuristic (programs per SM, min split length) at each
    (bs, ctx): graph us per layer and the bandwidth it reaches, fastest first."""
    configs = [None] + [K.LaunchConfig(block_n=bn, num_warps=w, num_stages=st)
                        for bn, w, st in ((32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (128, 4, 2), (128, 8, 2))]
    configs += [K.LaunchConfig(block_n=bn, num_warps=w, num_stages=st, kv_pack=pack)
                for pack in (2, 4) if HKV % pack == 0 and pack * D <= 256
                for bn, w, st in ((32, 4, 2), (32, 8, 2), (64, 4, 2), (64, 8, 2), (64, 8, 3), (16, 4, 3))]
    # Wider packs fill the 16-row q tile with small GQA groups (2 heads x 8 KV heads): a slot's whole
    # KV row per program, in narrow token tiles.
    configs += [K.LaunchConfig(block_n=bn, num_warps=w, num_stages=st, kv_pack=pack)
                for pack in (4, 8) if HKV % pack == 0 and 256 < pack * D <= 1024
                for bn, w, st in ((16, 4, 2), (16, 8, 2), (32, 8, 2))]
    for bs, ctx in shapes:
        rows = []
        for cfg in configs:
            # Large batches at one context do not split: one heuristic is enough there. Ragged ones may
            # split their longest requests.
            for pps in (4, 8, 16) if bs < 64 else (4, 8, 16, 32) if RAGGED_LO else (4,):
                for msl in (64, 128, 256) if bs < 64 else (128,):
                    try:
                        r = bench_decode(timer, bs, ctx, max_kv_splits, num_sms, cfg, pps, msl, with_peer=False)
                    except Exception as e:  # out of resources etc.
                        print(f"  bs{bs} ctx{ctx} {cfg}: {type(e).__name__}")
                        continue
                    name = "default" if cfg is None else f"{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}p{cfg.kv_pack}"
                    rows.append((r["graph_us"], f"{name} pps{pps} msl{msl}->{r['num_kv_splits']}", r["graph_GBps"]))
        rows.sort()
        default = next(row for row in rows if row[1].startswith("default pps4 msl128"))
        print(f"bs{bs} ctx{ctx}: default {default[0]:.1f}us ({default[2]:.0f} GB/s); best: "
              + "  ".join(f"{n}={t:.1f}us({g:.0f})" for t, n, g in rows[:10]), flush=True)


def sweep(timer: Timer, max_kv_splits: int, num_sms: int) -> None:
    def cfg_str(c: K.LaunchConfig) -> str:
        tail = f"{c.block_n}/{c.num_warps}/{c.num_stages}"
        return f"{c.block_m}{'p' if c.pack_gqa else ''}/{tail}" if c.block_m else tail

    print("# decode stage-1 configs x max_kv_splits (graph us): block_n/warps/stages@max_splits->splits")
    decode_cfgs = [
        K.LaunchConfig(block_n=bn, num_warps=w, num_stages=st)
        for bn, w, st in ((64, 4, 2), (64, 4, 3), (128, 4, 2), (128, 4, 3), (128, 8, 3), (32, 4, 2))
    ]
    for bs, ctx in [(1, 384), (1, 32768), (8, 4096), (32, 2048), (128, 1024), (256, 640)]:
        rows = []
        for mks in (16, 32) if bs <= 8 else (max_kv_splits,):
            for cfg in [None, *decode_cfgs]:
                try:
                    r = bench_decode(timer, bs, ctx, mks, num_sms, config=cfg, with_peer=False)
                except Exception as e:  # out of resources etc.
                    print(f"  bs{bs} ctx{ctx} {cfg}: {type(e).__name__}")
                    continue
                name = "default" if cfg is None else cfg_str(cfg)
                rows.append((r["graph_us"], f"{name}@{mks}->{r['num_kv_splits']}"))
        rows.sort()
        print(f"  bs{bs} ctx{ctx}: " + "  ".join(f"{n}={t:.1f}" for t, n in rows[:8]))
    print("# decode split heuristic (graph us): programs_per_sm/min_split_len->splits")
    for bs, ctx in [(1, 384), (1, 2048), (4, 4096), (16, 4096), (64, 1024), (256, 640)]:
        rows = []
        for pps in (2, 4, 8):
            for msl in (32, 64, 128, 256):
                r = bench_decode(timer, bs, ctx, max_kv_splits, num_sms, None, pps, msl, with_peer=False)
                rows.append((r["graph_us"], pps, msl, r["num_kv_splits"]))
        rows.sort()
        print(f"  bs{bs} ctx{ctx}: " + "  ".join(f"{p}/{m}->{n}={t:.1f}" for t, p, m, n in rows[:6]))
    sweep_extend(timer, [(8, 2048, 0), (8, 2048, 2048), (1, 512, 8192), (64, 8, 4096), (8, 64, 2048)])


EXTEND_SWEEP_CONFIGS = [
    K.LaunchConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
    for bm, bn, w, st in ((128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 3), (64, 128, 4, 3), (128, 64, 8, 4),
                          (64, 64, 4, 4), (128, 32, 4, 3), (16, 64, 4, 3), (32, 64, 4, 3), (16, 128, 4, 3),
                          (128, 64, 4, 3), (64, 128, 8, 3))
] + [
    K.LaunchConfig(block_m=bm, block_n=bn, num_warps=w, num_stages=st, pack_gqa=True)
    for bm, bn, w, st in ((16, 64, 4, 3), (32, 64, 4, 3), (64, 64, 4, 3), (32, 128, 4, 3), (64, 64, 4, 2))
]


def sweep_extend(timer: Timer, shapes: list[tuple[int, ...]]) -> None:
    """Every extend launch config at each (requests, extend tokens, cached prefix): us and TFLOP/s,
    fastest first."""
    print("# extend configs (us): block_m/block_n/warps/stages")
    for bs, ext, prefix in shapes:
        rows = []
        for cfg in [None, *EXTEND_SWEEP_CONFIGS]:
            try:
                r = bench_extend(timer, bs, ext, prefix, config=cfg, with_peer=False)
            except Exception as e:
                print(f"  {bs}x{ext}+{prefix} {cfg}: {type(e).__name__}")
                continue
            name = "default" if cfg is None else (
                f"{cfg.block_m}{'p' if cfg.pack_gqa else ''}/{cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}")
            rows.append((r["us"], name, r["TFLOPs"]))
        rows.sort()
        print(f"  {bs}x{ext}+{prefix}: " + "  ".join(f"{n}={t:.0f}us({tf:.0f}TF)" for t, n, tf in rows[:8]),
              flush=True)


if __name__ == "__main__":
    main()
