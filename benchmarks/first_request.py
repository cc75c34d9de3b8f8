"""Is a started engine's first request slow, and is any request after the device idled slow? Builds the offline
Engine on SHAPE (dummy weights, the engine's default warm-up), then runs single requests (IN prompt tokens,
OUT new tokens, fresh prompts) in this order: after an idle of IDLE_S, right after, after IDLE_S again, right
after, then prompts of lengths no request had yet. For each request: its wall time, and each of its first
steps' wall time and device time (CUDA events around the forward), so a slow first step shows whether the host
(a lazy initialisation) or the device (clocks, first graph launches) is slow. With NVSMI=1 the SM clock is
sampled every 10 ms through the run (nvidia-smi, sm-clock.csv) beside the requests' start times. Last, on a
GPU, the first and second call of each of the model's projections at row counts no forward had yet (a kernel
loaded on first use shows as a slow first call).

  PYTHONPATH=$PWD python benchmarks/first_request.py --shape llama-3.2-1b --out DIR
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import tempfile
import time

import torch

from plait.bench.shapes import write_shape_dir
from plait.bench.workloads import make_engine, random_prompts
from plait.engine.step_timing import step_timing


def one_request(engine, prompt: list[int], out_len: int) -> dict:
    t0 = time.perf_counter()
    with step_timing(engine.scheduler) as times:
        engine.generate(input_ids=prompt, sampling_params={"max_new_tokens": out_len, "temperature": 0.0,
                                                           "ignore_eos": True})
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = [("prefill", t) for t in times.times["prefill"]] + [("decode", t) for t in times.times["decode"]]
    device = [(k, s.elapsed_time(e)) for k, _, s, e in times.forwards]
    return {"wall_ms": 1e3 * wall, "step_wall_ms": [(k, round(1e3 * t, 2)) for k, t in steps[:6]],
            "forward_device_ms": [(k, round(ms, 2)) for k, ms in device[:6]]}


class TritonCompiles:
    """Every Triton kernel variant built in this process (a compile, or a load from the on-disk cache:
    both go through ``JITFunction._do_compile``), with its host time, so a request can be charged
    with the variants its launches needed."""

    def __init__(self) -> None:
        self.events: list[dict] = []
        try:
            from triton.runtime.jit import JITFunction
        except ImportError:
            return
        original = JITFunction._do_compile
        events = self.events

        def timed(fn, key, signature, device, constexprs, options, attrs, warmup):
            t0 = time.perf_counter()
            try:
                return original(fn, key, signature, device, constexprs, options, attrs, warmup)
            finally:
                events.append({"kernel": fn.__name__, "ms": round(1e3 * (time.perf_counter() - t0), 2),
                               "key": str(key)[:300]})

        JITFunction._do_compile = timed

    def since(self, start: int) -> list[dict]:
        return self.events[start:]


def profile_request(engine, prompt: list[int], out_len: int, out: pathlib.Path) -> None:
    """One request under the torch profiler: the host ops with the most self time, and the device
    kernels with the most time (printed and written to profile-*.txt)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities) as prof:
        one_request(engine, prompt, out_len)
    table = prof.key_averages()
    cpu = table.table(sort_by="self_cpu_time_total", row_limit=25, max_name_column_width=70)
    dev = table.table(sort_by="self_device_time_total", row_limit=15, max_name_column_width=70) \
        if torch.cuda.is_available() else ""
    (out / "profile-host.txt").write_text(cpu)
    (out / "profile-device.txt").write_text(dev)
    print(cpu, flush=True)
    print(dev, flush=True)


def gemm_first_calls(engine, rows: list[int]) -> list[dict]:
    """For each row count no forward had yet, the first and the second ``F.linear`` with each distinct
    projection weight of the model (cuBLAS picks a kernel per problem size; lazily loaded, a kernel's
    first launch in a process also loads its module), timed on the host around a synchronized call."""
    import torch.nn.functional as F

    shapes = sorted({tuple(p.shape) for name, p in engine.runner.model.named_parameters()
                     if p.dim() == 2 and "embed" not in name})
    device, dtype = engine.runner.device, engine.runner.model_config.dtype
    sync = torch.cuda.synchronize if torch.device(device).type == "cuda" else (lambda: None)
    weights = [torch.randn(n, k, device=device, dtype=dtype) for n, k in shapes]
    out = []
    for m in rows:
        row: dict = {"rows": m, "first_ms": [], "second_ms": []}
        for w in weights:
            x = torch.randn(m, w.shape[1], device=device, dtype=dtype)
            for key in ("first_ms", "second_ms"):
                sync()
                t0 = time.perf_counter()
                F.linear(x, w)
                sync()
                row[key].append(round(1e3 * (time.perf_counter() - t0), 3))
        row["weight_shapes"] = shapes
        out.append(row)
        print(json.dumps({k: v for k, v in row.items() if k != "weight_shapes"}), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-3.2-1b")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=8)
    ap.add_argument("--idle-s", type=float, default=2.0)
    ap.add_argument("--gemm-rows", type=int, nargs="+", default=[448, 768, 2560, 6000])
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    clocks = out / "sm-clock.csv"
    sampler = None
    if os.environ.get("NVSMI") == "1":
        sampler = subprocess.Popen(["nvidia-smi", "--query-gpu=timestamp,clocks.sm,power.draw",
                                    "--format=csv,noheader", "-lms", "10"], stdout=clocks.open("w"))
    marks: list[tuple[str, float]] = []
    shape_dir = write_shape_dir(tempfile.mkdtemp(), args.shape)
    t0 = time.perf_counter()
    engine = make_engine(str(shape_dir))
    marks.append(("built", time.time()))
    result: dict = {"shape": args.shape, "cuda_module_loading": os.environ.get("CUDA_MODULE_LOADING"),
                    "build_s": time.perf_counter() - t0, "requests": []}
    vocab = engine.runner.model_config.vocab_size
    # (label, idle before it, prompt length): then prompt lengths no request had yet, right after
    # one another (a GEMM of a new row count may pick a cuBLAS kernel whose module is not loaded yet).
    n = args.input_len
    compiles = TritonCompiles()
    plan = [("after idle", args.idle_s, n), ("right after", 0.0, n), ("after idle", args.idle_s, n),
            ("right after", 0.0, n), ("after short idle", 0.2, n), ("new length", 0.0, 3 * n // 4),
            ("new length", 0.0, 5 * n // 4), ("new length", 0.0, 3 * n), ("new length again", 0.0, 3 * n)]
    for i, (label, idle, length) in enumerate(plan):
        prompt = random_prompts(1, length, vocab, seed=11 + i)[0]
        time.sleep(idle)
        marks.append((f"request {i} ({label})", time.time()))
        seen = len(compiles.events)
        row = one_request(engine, prompt, args.output_len)
        result["requests"].append({"label": label, "idle_s": idle, "prompt_tokens": length, **row,
                                   "triton_variants_built": compiles.since(seen)})
        print(json.dumps(result["requests"][-1])[:1500], flush=True)
    # A prompt length no request had yet, profiled: where a new length's slow first prefill spends its time.
    profile_request(engine, random_prompts(1, 5 * n // 8, vocab, seed=5)[0], args.output_len, out)
    result["gemm_first_calls"] = gemm_first_calls(engine, args.gemm_rows)
    engine.shutdown()
    if sampler is not None:
        sampler.terminate()
        sampler.wait()
        result["clock_marks"] = marks
    (out / "first-request.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
