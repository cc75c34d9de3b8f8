"""Where one decode step's time goes (H200): scheduler host phases vs the CUDA graph replay, and a
per-kernel table of one eager decode step, for the llama-3.2-1b shape at bs=1 and bs=256.

    PYTHONPATH=$PWD python benchmarks/profile_step.py OUT_DIR
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from collections import defaultdict

import torch

# Run as a script: this folder is on sys.path.
from profile_throughput import decode_kernels_bs1  # noqa: E402

from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import make_engine, release, steady_decode_timing

SHAPE = "llama-3.2-1b"


def host_phases(engine, bs: int, steps: int = 40) -> dict[str, float]:
    """Steady decode at ``bs`` with the scheduler's host phases timed (wall time, per step)."""
    sched = engine.scheduler
    totals: dict[str, float] = defaultdict(float)
    for name in ("_schedule", "_launch", "_process"):
        original = getattr(sched, name)

        def timed(*a, _orig=original, _name=name, **k):
            t0 = time.perf_counter()
            out = _orig(*a, **k)
            totals[_name] += time.perf_counter() - t0
            return out

        setattr(sched, name, timed)
    timed_totals: dict[str, float] = {}
    out = steady_decode_timing(engine, bs, SHAPES[SHAPE]["vocab_size"], steps=steps, seed=bs,
                               on_steady=totals.clear, after_timed=lambda: timed_totals.update(totals))
    out.update({f"host{k}_ms": v / steps * 1e3 for k, v in timed_totals.items()})
    return out


def main() -> None:
    out_dir = sys.argv[1]
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), SHAPE))
    result = {"shape": SHAPE, "device": torch.cuda.get_device_name()}
    for bs in (1, 256):
        engine = make_engine(shape_dir, max_running_requests=max(bs, 8), disable_radix_cache=True)
        result[f"bs{bs}"] = host_phases(engine, bs)
        release(engine)
        print(json.dumps(result[f"bs{bs}"]))
    result["eager_decode_kernels_bs1"] = decode_kernels_bs1(SHAPE)
    for row in result["eager_decode_kernels_bs1"]:
        print(row)
    with open(f"{out_dir}/profile-step-{SHAPE}.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
