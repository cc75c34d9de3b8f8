"""Where a graph-replayed decode step's time goes (H200): the scheduler's step time against the graph
replay alone, and a per-kernel table of steady steps (kernels inside the graph and the eager ones
around it: input copies, sampler, result copy). Cases are SHAPE:BS[:PROMPT_LEN] (default: bs 1 of
llama-3.2-1b and llama-3.1-8b, 128-token prompts); the JSON is profile-graph-step.json, or
profile-graph-step-<cases>.json for other cases.

    PYTHONPATH=$PWD python benchmarks/profile_graph_step.py OUT_DIR [llama-3.2-1b:256:512 ...]
"""

from __future__ import annotations

import json
import sys
import tempfile

import torch

from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import make_engine, release, steady_decode_timing

STEPS = 20


def profile_shape(shape: str, bs: int = 1, prompt_len: int = 128) -> dict:
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), shape))
    vocab = SHAPES[shape]["vocab_size"]
    engine = make_engine(shape_dir, max_running_requests=max(8, bs), disable_radix_cache=True)
    timing = steady_decode_timing(engine, bs, vocab, steps=100, prompt_len=prompt_len)
    prof = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA,
                                              torch.profiler.ProfilerActivity.CPU])
    steady_decode_timing(engine, bs, vocab, steps=STEPS, on_steady=prof.__enter__,
                         after_timed=lambda: prof.__exit__(None, None, None), prompt_len=prompt_len)
    release(engine)
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    kernels = [{"kernel": e.key[:100], "calls_per_step": e.count / STEPS, "us_per_step": e.device_time_total / STEPS}
               for e in events if e.device_time_total > 0][:40]
    gpu_us = sum(e.device_time_total for e in events if e.device_time_total > 0 and e.device_type.name == "CUDA")
    return {**timing, "kernels": kernels, "profiled_cuda_us_per_step": gpu_us / STEPS}


def main() -> None:
    out = {"device": torch.cuda.get_device_name()}
    cases = sys.argv[2:] or ["llama-3.2-1b:1", "llama-3.1-8b:1"]
    for case in cases:
        shape, bs, *prompt_len = case.split(":")
        out[case] = profile_shape(shape, int(bs), *(int(n) for n in prompt_len))
        print(case, {k: v for k, v in out[case].items() if k != "kernels"})
        for row in out[case]["kernels"][:25]:
            print("  ", row)
    name = "profile-graph-step" + ("-" + "-".join(c.replace(":", "x") for c in sys.argv[2:]) if sys.argv[2:] else "")
    with open(f"{sys.argv[1]}/{name}.json", "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
