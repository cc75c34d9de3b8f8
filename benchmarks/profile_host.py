"""Host time of the offline-throughput workload (H200, llama-3.2-1b shape, overlap on as shipped):
cProfile of the timed run, to find the Python work that the GPU waits for.

    PYTHONPATH=$PWD python benchmarks/profile_host.py OUT_DIR
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import tempfile
import time

import torch

from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import make_engine, random_prompts, release

SHAPE = "llama-3.2-1b"


def main() -> None:
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), SHAPE))
    engine = make_engine(shape_dir, max_running_requests=256)
    prompts = random_prompts(256, 512, SHAPES[SHAPE]["vocab_size"], seed=0)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 128}
    engine.generate(prompts, params)
    engine.scheduler.tree_cache.reset()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    plain = time.perf_counter() - t0
    engine.scheduler.tree_cache.reset()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    prof.disable()
    profiled = time.perf_counter() - t0
    release(engine)
    text = io.StringIO()
    text.write(f"offline-throughput {SHAPE}: {plain:.3f} s unprofiled, {profiled:.3f} s under cProfile\n")
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("cumulative").print_stats(60)
    stats.sort_stats("tottime").print_stats(40)
    print(text.getvalue()[:6000])
    with open(f"{sys.argv[1]}/profile-host-offline.txt", "w") as f:
        f.write(text.getvalue())


if __name__ == "__main__":
    main()
