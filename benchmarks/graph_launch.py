"""What a CUDA graph's launch costs when the GPU is idle at the launch, against a launch queued behind work.

A chained verify is launched after the host has read the previous verify's result, so the GPU is idle
at its launch: if the GPU starts a graph only once its launch has been submitted whole, the launch's host
time is idle device time. Per graph this prints the median of:

- ``host``: the host time of ``replay()``;
- ``idle``: device time from an event recorded just before the launch (the GPU idle) to one just after;
- ``busy``: the same with the launch queued behind a 3 ms spin kernel (the graph's own run time);

so ``idle - busy`` is the device time the launch costs. First a synthetic chain of N small kernels as one
graph and as geometric segments, then (``--shape``) the bs-1 decode graph and the width-4 verify graph of
the named shape with dummy weights, captured as ``PLAIT_SEGMENTED_VERIFY_GRAPHS`` says.

    PYTHONPATH=$PWD python benchmarks/graph_launch.py [--shape llama-3.1-8b] [--kernels 500]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

SPIN_CYCLES = 6_000_000  # torch.cuda._sleep: about 3 ms at 2 GHz


def measure(replay: Callable[[], None], reps: int = 30) -> dict[str, float]:
    host, idle, busy = [], [], []
    for queued in (False, True):
        for _ in range(reps):
            torch.cuda.synchronize()
            if queued:
                torch.cuda._sleep(SPIN_CYCLES)
            e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            e0.record()
            t0 = time.perf_counter()
            replay()
            t1 = time.perf_counter()
            e1.record()
            e1.synchronize()
            (busy if queued else idle).append(e0.elapsed_time(e1) * 1e3)
            if not queued:
                host.append((t1 - t0) * 1e6)
    out = {"host_us": statistics.median(host), "idle_us": statistics.median(idle), "busy_us": statistics.median(busy)}
    out["launch_cost_us"] = out["idle_us"] - out["busy_us"]
    return out


def synthetic(kernels: int) -> dict[str, dict[str, float]]:
    """N dependent elementwise kernels over 256k floats, as one graph and cut at 1, 3, 7, ... kernels'
    worth of 1/32 of the chain (the segments a 32-layer forward gets)."""
    from plait.executor.graph_utils import segment_starts

    x = torch.zeros(1 << 18, device="cuda")
    per_layer = max(1, kernels // 64)  # steps per "layer"; each step launches two kernels

    def body(lo: int, hi: int) -> None:
        for _ in range(lo, hi):
            x.mul_(1.0001).add_(1e-4)

    stream = torch.cuda.Stream()
    results = {}
    for name, starts in (("one graph", []), ("segmented", segment_starts(32))):
        bounds = [0, *[s * per_layer for s in starts], 32 * per_layer]
        graphs = []
        body(0, 2)
        torch.cuda.synchronize()
        pool = None
        with torch.cuda.stream(stream):
            for lo, hi in zip(bounds, bounds[1:], strict=False):
                g = torch.cuda.CUDAGraph()
                g.capture_begin(pool=pool)
                body(lo, hi)
                g.capture_end()
                pool = g.pool()
                graphs.append(g)
        torch.cuda.synchronize()

        def replay(graphs: list[torch.cuda.CUDAGraph] = graphs) -> None:
            for g in graphs:
                g.replay()

        results[f"{name} ({2 * bounds[-1]} kernels, {len(graphs)} graphs)"] = measure(replay)
    return results


def engine_graphs(shape: str) -> dict[str, dict[str, float]]:
    from plait import envs
    from plait.bench.shapes import write_shape_dir
    from plait.bench.workloads import make_engine

    shape_dir = str(write_shape_dir(tempfile.mkdtemp(prefix="plait-shapes-"), shape))
    engine = make_engine(shape_dir, max_running_requests=1, cuda_graph_bs=[1], speculative_algorithm="NGRAM",
                         speculative_num_steps=3, speculative_eagle_topk=1, speculative_num_draft_tokens=4)
    runner = engine.runner
    segmented = envs.SEGMENTED_VERIFY_GRAPHS.get()
    out = {}
    assert runner.graph_runner is not None and runner.verify_graph_runner is not None
    out["decode bs 1"] = measure(runner.graph_runner.graphs[1].replay)
    verify = runner.verify_graph_runner.graphs[(4, 1)]
    segments = len(getattr(verify, "segments", [None]))
    out[f"verify bs 1 width 4 ({segments} segment{'s' if segments > 1 else ''}, segmented={int(segmented)})"] = \
        measure(verify.replay)
    engine.shutdown()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default=None)
    ap.add_argument("--kernels", type=int, default=512)
    ap.add_argument("--skip-synthetic", action="store_true")
    args = ap.parse_args()
    results = {} if args.skip_synthetic else synthetic(args.kernels)
    if args.shape:
        results.update(engine_graphs(args.shape))
    for name, r in results.items():
        print(f"{name:60s} host {r['host_us']:8.1f} us  idle {r['idle_us']:8.1f}  busy {r['busy_us']:8.1f}  "
              f"launch cost {r['launch_cost_us']:7.1f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
