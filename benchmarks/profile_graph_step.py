"""Where a graph-replayed decode step's time goes (H200), bs=1, llama-3.2-1b and llama-3.1-8b shapes:
the scheduler's step time against the graph replay alone, and a per-kernel table of steady steps
(kernels inside the graph and the eager ones around it: input copies, sampler, result copy).

    PYTHONPATH=$PWD python benchmarks/profile_graph_step.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import make_engine, release, steady_decode_timing

STEPS = 20


def profile_shape(shape: str) -> dict:
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), shape))
    vocab = SHAPES[shape]["vocab_size"]
    engine = make_engine(shape_dir, max_running_requests=8, disable_radix_cache=True)
    timing = steady_decode_timing(engine, 1, vocab, steps=100)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                              torch.profiler.ProfilerActivity.CPU])
    steady_decode_timing(engine, 1, vocab, steps=STEPS, on_steady=prof.__enter__,
                         after_timed=lambda: prof.__exit__(None, None, None))
    release(engine)
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    kernels = [{"kernel": e.key[:100], "calls_per_step": e.count / STEPS, "us_per_step": e.device_time_total / STEPS}
               for e in events if e.device_time_total > 0][:40]
    gpu_us = sum(e.device_time_total for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA")
    return {**timing, "kernels": kernels, "profiled_cuda_us_per_step": gpu_us / STEPS}


def main() -> None:
    out = {"device": torch.cuda.get_device_name()}
    for shape in ("llama-3.2-1b", "llama-3.1-8b"):
        out[shape] = profile_shape(shape)
        print(shape, {k: v for k, v in out[shape].items() if k != "kernels"})
        for row in out[shape]["kernels"][:25]:
            print("  ", row)
    with open(f"{sys.argv[1]}/profile-graph-step.json", "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
