"""Where a MoE decode step's time goes (CUDA only): qwen3-30b-a3b and gpt-oss-20b, random weights.

1. ``step``: an engine at bs 1 with CUDA graphs; the scheduler's step time against the graph replay
   alone, then torch.profiler over steady steps: every kernel (inside the graph and the eager ones
   around it) with its calls and time per step and per layer, the kernels per step, the GPU-busy
   time and the idle gap per kernel (replay time minus busy time, over the kernels in the graph:
   what launch latency costs).
2. ``layer``: one MoE layer's experts alone at M = 1..8 tokens as CUDA graph replays rotating over 8
   routings, the small-batch path (``plait.layers.moe.small_batch``) against the aligned pipeline,
   with the kernels each launches and the bytes of the distinct experts read; the router alone, one
   fused launch against torch's; and with ``--sweep`` the small path's candidate tiles
   (``tune_fused_moe.small_batch_candidates``) at M = 1.

    PYTHONPATH=$PWD python benchmarks/profile_moe_step.py --out OUT_DIR [--shape qwen3-30b-a3b] [--sweep] [--no-step]
"""

from __future__ import annotations

import argparse
import collections
import gc
import json
import os
import sys
import tempfile
from typing import Any

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tune_fused_moe import (  # noqa: E402
    MOE_KERNEL_SHAPES,
    MoeShape,
    graph_time_us,
    make_inputs,
    make_weights,
    small_batch_candidates,
)

from plait.bench.shapes import SHAPES, write_shape_dir  # noqa: E402
from plait.bench.workloads import make_engine, release, steady_decode_timing  # noqa: E402
from plait.layers.moe.fused_moe_triton import fused_experts_triton  # noqa: E402
from plait.layers.moe.fused_router import fused_topk  # noqa: E402
from plait.layers.moe.router import RouterConfig, select_experts  # noqa: E402
from plait.layers.moe.small_batch import SmallBatchConfig, fused_experts_small_batch, small_batch_plan  # noqa: E402

STEPS = 20
ROTATIONS = 8
# Names of the MoE layer's Triton kernels (the router GEMM is a cuBLAS kernel like the others).
MOE_KERNELS = ("_fused_topk_kernel", "_small_gate_up_kernel", "_small_down_sum_kernel", "fused_moe_kernel",
               "_align_scan_kernel", "_align_scatter_kernel", "_moe_activation_kernel", "_moe_sum_kernel")


def cuda_kernels(prof: torch.profiler.profile) -> list[Any]:
    return [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


def kernel_table(events: list[Any], per: int, layers: int) -> list[dict[str, Any]]:
    """Calls and microseconds per ``per`` repetitions, by kernel name, slowest first."""
    calls: collections.Counter[str] = collections.Counter()
    us: collections.Counter[str] = collections.Counter()
    for ev in events:
        calls[ev.name] += 1
        us[ev.name] += ev.time_range.elapsed_us()
    rows = [{"kernel": name[:120], "moe": any(name.startswith(k) for k in MOE_KERNELS),
             "calls_per_step": calls[name] / per, "calls_per_layer": calls[name] / per / layers,
             "us_per_step": us[name] / per, "us_per_call": us[name] / calls[name]} for name in calls]
    return sorted(rows, key=lambda r: -r["us_per_step"])


def profile_step(shape: str, bs: int) -> dict[str, Any]:
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), shape))
    vocab, layers = SHAPES[shape]["vocab_size"], SHAPES[shape]["num_hidden_layers"]
    engine = make_engine(shape_dir, max_running_requests=8, cuda_graph_max_bs=8, disable_radix_cache=True)
    timing = steady_decode_timing(engine, bs, vocab, steps=50)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
    steady_decode_timing(engine, bs, vocab, steps=STEPS, on_steady=prof.__enter__,
                         after_timed=lambda: prof.__exit__(None, None, None))
    release(engine)
    events = cuda_kernels(prof)
    table = kernel_table(events, STEPS, layers)
    per_layer = [r for r in table if r["calls_per_layer"] >= 1 and r["calls_per_step"] % layers == 0]
    busy_us = sum(r["us_per_step"] for r in table)
    kernels = sum(r["calls_per_step"] for r in table)
    moe_rows = [r for r in table if r["moe"]]
    return {
        **timing, "layers": layers, "kernels_per_step": kernels, "kernel_busy_us_per_step": busy_us,
        "idle_us_per_kernel": (timing["replay_ms"] * 1e3 - busy_us) / kernels if kernels else None,
        "kernels_per_layer": sum(r["calls_per_layer"] for r in per_layer),
        "kernel_us_per_layer": sum(r["us_per_step"] for r in per_layer) / layers,
        "moe_triton_kernels_per_layer": sum(r["calls_per_layer"] for r in moe_rows),
        "moe_triton_us_per_layer": sum(r["us_per_step"] for r in moe_rows) / layers,
        "kernels": table[:60],
    }


def expert_bytes(shape: MoeShape) -> int:
    per = 3 * shape.hidden * shape.inter + (2 * shape.inter + shape.hidden if shape.bias else 0)
    return 2 * per  # bf16


def layer_path_us(shape: MoeShape, experts: tuple, num_tokens: int, small_batch: bool,
                  config: SmallBatchConfig | None = None) -> dict[str, Any]:
    w13, w2, b13, b2, _ = experts  # bf16 experts (no scales)
    inputs = [make_inputs(shape, num_tokens, seed=s) for s in range(ROTATIONS)]
    if config is not None:
        fns = [lambda i=i: fused_experts_small_batch(i[0], w13, w2, i[1], i[2], shape.activation, b13, b2, config)
               for i in inputs]
    else:
        fns = [lambda i=i: fused_experts_triton(i[0], w13, w2, i[1], i[2], shape.activation, b13, b2,
                                                small_batch=small_batch) for i in inputs]
    us = graph_time_us(fns)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fns[0]()
        torch.cuda.synchronize()
    distinct = sum(len(set(i[2].flatten().tolist()) - {-1}) for i in inputs) / ROTATIONS
    moved = distinct * expert_bytes(shape)
    return {"us": us, "kernels": len(cuda_kernels(prof)), "distinct_experts": distinct, "bytes": moved,
            "achieved_TB_per_s": moved / us / 1e6}


def router_us(shape: MoeShape, num_tokens: int) -> dict[str, float]:
    scoring = "topk_softmax" if shape.activation == "swiglu_oai" else "softmax_topk"
    softmax_first = scoring == "softmax_topk"
    cfg = RouterConfig(shape.num_experts, shape.top_k, scoring, renormalize=softmax_first)
    logits = [torch.randn(num_tokens, shape.num_experts, device="cuda").bfloat16() for _ in range(ROTATIONS)]
    return {"fused_us": graph_time_us([lambda x=x: fused_topk(x, cfg.top_k, softmax_first, cfg.renormalize)
                                       for x in logits]),
            "torch_us": graph_time_us([lambda x=x: select_experts(x, cfg, fused=False) for x in logits])}


def profile_layer(name: str, sweep: bool) -> dict[str, Any]:
    shape = MOE_KERNEL_SHAPES[name]
    experts = make_weights(shape)
    rows = []
    for m in range(1, 9):
        plan = small_batch_plan(m, shape.local_experts, shape.top_k, shape.hidden, shape.inter,
                                torch.cuda.get_device_name())
        row: dict[str, Any] = {"num_tokens": m, "dispatch_takes_small_batch": plan is not None}
        row["small_batch"] = layer_path_us(shape, experts, m, small_batch=True)
        row["aligned"] = layer_path_us(shape, experts, m, small_batch=False)
        row["router"] = router_us(shape, m)
        print(name, json.dumps(row), flush=True)
        rows.append(row)
    out: dict[str, Any] = {"rows": rows}
    if sweep:
        out["sweep_m1"] = []
        for cfg in small_batch_candidates(shape.top_k):
            try:
                res = layer_path_us(shape, experts, 1, small_batch=True, config=cfg)
            except Exception as e:  # a tile that does not fit: say so, keep sweeping
                res = {"error": f"{type(e).__name__}: {str(e)[:200]}"}
            out["sweep_m1"].append({"config": vars(cfg), **res})
            print(name, "sweep", json.dumps(out["sweep_m1"][-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="directory for profile-moe-step.json")
    ap.add_argument("--shape", action="append", choices=sorted(MOE_KERNEL_SHAPES), help="repeatable; default both")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--sweep", action="store_true", help="also time the small-batch candidate tiles at M = 1")
    ap.add_argument("--no-step", action="store_true", help="skip the engine decode-step profile")
    args = ap.parse_args()
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "bs": args.bs}
    for shape in args.shape or sorted(MOE_KERNEL_SHAPES):
        result[shape] = {"layer": profile_layer(shape, sweep=args.sweep)}
        gc.collect()
        torch.cuda.empty_cache()  # the layer's experts go before the engine sizes its KV pool
        if not args.no_step:
            step = profile_step(shape, args.bs)
            result[shape]["step"] = step
            print(shape, json.dumps({k: v for k, v in step.items() if k != "kernels"}), flush=True)
            for row in step["kernels"][:30]:
                print("  ", json.dumps(row))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "profile-moe-step.json"), "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
