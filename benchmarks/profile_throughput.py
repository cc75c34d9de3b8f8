"""Where offline-throughput time goes (H200): time per forward mode over the whole workload (each
step synchronised, so overlap is off while measuring), a per-kernel table of one MIXED step, and a
per-kernel table of one eager decode step of the llama-3.1-8b shape at bs=1.

    PYTHONPATH=$PWD python benchmarks/profile_throughput.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict

import torch

from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import make_engine, random_prompts, release


def kernel_rows(prof: torch.profiler.profile, per: int, top: int = 15) -> list[dict[str, float | str]]:
    return [{"kernel": e.key[:90], "calls": e.count / per, "us": e.device_time_total / per}
            for e in sorted(prof.key_averages(), key=lambda e: -e.device_time_total)[:top]]


def offline_breakdown(shape: str) -> dict:
    root = tempfile.mkdtemp()
    shape_dir = str(write_shape_dir(root, shape))
    vocab = SHAPES[shape]["vocab_size"]
    engine = make_engine(shape_dir, max_running_requests=256, disable_overlap_schedule=True)
    prompts = random_prompts(256, 512, vocab, seed=0)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 128}
    engine.generate(prompts, params)  # warm-up (kernel compiles)
    engine.scheduler.tree_cache.reset()
    sched = engine.scheduler
    per_mode: dict[str, list[float]] = defaultdict(list)
    original = engine.runner.forward

    def timed_forward(fb, skip_attn_backend_init=None):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = original(fb)
        torch.cuda.synchronize()
        per_mode[fb.forward_mode.name].append(time.perf_counter() - t0)
        return out

    engine.runner.forward = timed_forward
    for p in random_prompts(256, 512, vocab, seed=1):
        sched.add_request(engine.make_request(p, params))
    t0 = time.perf_counter()
    mixed_profiled = None
    while sched.has_work():
        if mixed_profiled is None and sched.running and sched.waiting:
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                sched.step()
            mixed_profiled = kernel_rows(prof, 1)
        else:
            sched.step()
    total = time.perf_counter() - t0
    release(engine)
    return {"total_s": total, "steps": {m: {"count": len(v), "seconds": sum(v), "mean_ms": 1e3 * sum(v) / len(v)}
                                        for m, v in per_mode.items()},
            "mixed_step_kernels": mixed_profiled}


def decode_kernels_bs1(shape: str) -> list[dict[str, float | str]]:
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), shape))
    engine = make_engine(shape_dir, disable_cuda_graph=True, max_running_requests=8, disable_radix_cache=True)
    prompt = random_prompts(1, 128, SHAPES[shape]["vocab_size"], seed=0)[0]
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}
    engine.generate(prompt, params)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(prompt, {**params, "max_new_tokens": 11})
    release(engine)
    return kernel_rows(prof, 11)


def main() -> None:
    out = {"device": torch.cuda.get_device_name(), "offline-throughput llama-3.2-1b": offline_breakdown("llama-3.2-1b")}
    print(json.dumps(out["offline-throughput llama-3.2-1b"]["steps"]))
    out["eager decode step llama-3.1-8b bs1"] = decode_kernels_bs1("llama-3.1-8b")
    for row in out["eager decode step llama-3.1-8b bs1"]:
        print(row)
    with open(f"{sys.argv[1]}/profile-throughput.json", "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
