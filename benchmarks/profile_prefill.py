"""Where one offline-throughput prefill step's time goes (H200): the kernels of one EXTEND step of
16 x 512 prompt tokens (the default 8192-token chunk), per shape, against the step's matmul floor.

    PYTHONPATH=$PWD python benchmarks/profile_prefill.py OUT_DIR [SHAPE ...]
"""

from __future__ import annotations

import json
import sys
import tempfile
import time

import torch

# Run as a script: this folder is on sys.path.
from profile_throughput import kernel_rows  # noqa: E402

from plait.bench.hardware import bf16_matmul_rate
from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import make_engine, prefill_flops, random_prompts, release

PROMPTS, PROMPT_LEN = 16, 512


def prefill_profile(shape: str, rate: float) -> dict:
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), shape))
    vocab = SHAPES[shape]["vocab_size"]
    engine = make_engine(shape_dir, max_running_requests=256, disable_radix_cache=True)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 1}
    for seed in (0, 1):  # warm-up: kernel compiles and autotuning
        engine.generate(random_prompts(PROMPTS, PROMPT_LEN, vocab, seed=seed), params)
    walls = []
    for seed in (2, 3, 4):
        prompts = random_prompts(PROMPTS, PROMPT_LEN, vocab, seed=seed)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        engine.generate(prompts, params)
        torch.cuda.synchronize()
        walls.append(time.perf_counter() - t0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        engine.generate(random_prompts(PROMPTS, PROMPT_LEN, vocab, seed=5), params)
    release(engine)
    rows = kernel_rows(prof, 1, top=30)
    kernel_us = sum(e.device_time_total for e in prof.key_averages())
    floor_ms = 1e3 * prefill_flops(shape, [PROMPT_LEN] * PROMPTS) / rate
    return {"wall_ms": [1e3 * w for w in walls], "kernels_total_us": kernel_us, "matmul_floor_ms": floor_ms,
            "kernels": rows}


def main() -> None:
    out_dir, shapes = sys.argv[1], sys.argv[2:] or ["llama-3.2-1b", "llama-3.1-8b"]
    rate = bf16_matmul_rate()
    out = {"device": torch.cuda.get_device_name(), "matmul_rate": rate}
    for shape in shapes:
        r = prefill_profile(shape, rate)
        out[shape] = r
        print(f"{shape}: wall {min(r['wall_ms']):.1f} ms, kernels {r['kernels_total_us'] / 1e3:.1f} ms, "
              f"matmul floor {r['matmul_floor_ms']:.1f} ms", flush=True)
        for row in r["kernels"][:22]:
            print(f"  {row['us']:9.1f} us  x{row['calls']:5.0f}  {row['kernel']}", flush=True)
    with open(f"{out_dir}/profile-prefill.json", "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
