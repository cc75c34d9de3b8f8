"""Where a bs-1 verify forward's device time goes beside a plain decode forward's (GPU): one NGRAM engine
of the shape (dummy weights, bf16, the engine as ``spec-ngram-repeat`` builds it) runs a repeat pass so
its graphs hold a real batch, then the captured decode graph of ``--bs`` requests (default 1) and the
chain verify graph of as many (width 4) are replayed back to back, alone:

- device time per replay (``plait.bench.hardware.seconds_per_call``: CUDA events around ``--reps``
  replays; the replays queue faster than they run, so this is the graph's device time, not the host's);
- per kernel, device us per replay from ``torch.profiler`` over 20 replays of each graph, and the same
  summed by class (dense GEMM or GEMV, attention, norms, rotary, activation, the rest).

The difference of the two tables is what a verify costs beyond a plain step on the device, the share
``speedup_over_accept_length`` loses before any host gap. Run once per GEMV table
(``PLAIT_GEMV_CONFIG_DIR``) to see what tiles past one token change.

    PYTHONPATH=$PWD python benchmarks/profile_verify_graph.py OUT_DIR [--shape llama-3.1-8b] [--bs 1] [--tag NAME]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import tempfile
from typing import Any

import torch

from plait.bench.hardware import seconds_per_call
from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.spec import NGRAM, random_prompts
from plait.bench.workloads import make_engine, release

WIDTH = 4  # the chain verify's width with NGRAM's 3 drafts
CLASSES = (  # first match wins; kernel names as CUPTI reports them
    ("gemm", re.compile(r"nvjet|gemm|gemv|cutlass|splitKreduce|_matmul", re.I)),
    ("attention", re.compile(r"decode|extend|attn|flash|fmha|softmax_merge", re.I)),
    ("norm", re.compile(r"norm", re.I)),
    ("rotary", re.compile(r"rotary|rope", re.I)),
    ("activation", re.compile(r"silu|gelu|act", re.I)),
)


def kernel_class(name: str) -> str:
    return next((label for label, pattern in CLASSES if pattern.search(name)), "other")


def kernel_table(replay: Any, reps: int = 20) -> list[dict[str, Any]]:
    """Per kernel: calls and device us per replay, largest first."""
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            replay()
        torch.cuda.synchronize()
    rows = [{"kernel": e.key[:110], "class": kernel_class(e.key), "calls": e.count / reps,
             "us": e.device_time_total / reps}
            for e in prof.key_averages() if e.device_time_total > 0]
    return sorted(rows, key=lambda r: -r["us"])


def by_class(rows: list[dict[str, Any]]) -> dict[str, float]:
    sums: dict[str, float] = {}
    for row in rows:
        sums[row["class"]] = sums.get(row["class"], 0.0) + row["us"]
    return dict(sorted(sums.items(), key=lambda kv: -kv[1]))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama-3.1-8b")
    ap.add_argument("--tag", default="shipped")
    ap.add_argument("--bs", type=int, default=1)
    ap.add_argument("--reps", type=int, default=200)
    args = ap.parse_args()
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(prefix="plait-shapes-"), args.shape))
    engine = make_engine(shape_dir, max_running_requests=args.bs, **NGRAM)
    prompts = random_prompts(max(4, args.bs), 128, SHAPES[args.shape]["vocab_size"], seed=7)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 64}
    engine.generate(prompts, params)
    engine.generate(prompts, params)  # a repeat: verifies run, the verify graph's buffers hold a chain batch
    runner = engine.runner
    if runner.graph_runner is None or runner.verify_graph_runner is None:
        raise SystemExit("this needs the decode and verify graphs (a CUDA device, graphs enabled)")
    graphs = {"decode": runner.graph_runner.graphs[args.bs].replay,
              "verify": runner.verify_graph_runner.graphs[(WIDTH, args.bs)].replay}
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(), "shape": args.shape, "bs": args.bs,
                              "tag": args.tag, "gemv_config_dir": os.environ.get("PLAIT_GEMV_CONFIG_DIR", "")}
    for name, replay in graphs.items():
        rows = kernel_table(replay)
        result[name] = {"replay_us": seconds_per_call(replay, args.reps) * 1e6,
                        "profiled_us": sum(r["us"] for r in rows), "by_class": by_class(rows), "kernels": rows[:30]}
    release(engine)
    dec, ver = result["decode"], result["verify"]
    print(f"[{args.tag}] {args.shape} bs {args.bs}: decode replay {dec['replay_us']:.1f} us, verify (width {WIDTH}) "
          f"{ver['replay_us']:.1f} us ({ver['replay_us'] / dec['replay_us']:.3f}x)")
    print(f"  {'class':<12}{'decode us':>12}{'verify us':>12}{'extra':>10}")
    for label in sorted(set(dec["by_class"]) | set(ver["by_class"]), key=lambda c: -ver["by_class"].get(c, 0.0)):
        d, v = dec["by_class"].get(label, 0.0), ver["by_class"].get(label, 0.0)
        print(f"  {label:<12}{d:>12.1f}{v:>12.1f}{v - d:>10.1f}")
    for name in graphs:
        print(f"  {name} kernels (us per replay, calls):")
        for row in result[name]["kernels"][:14]:
            print(f"    {row['us']:>9.1f} {row['calls']:>5.0f}  {row['class']:<10} {row['kernel']}")
    with open(os.path.join(args.out, f"profile-verify-graph-bs{args.bs}-{args.tag}.json"), "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
