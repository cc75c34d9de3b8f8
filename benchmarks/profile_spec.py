"""Where an NGRAM speculative step's time goes (H200, llama-3.1-8b shape): the spec-ngram-repeat pass
at bs 1 (16 prompts, 64 tokens) and bs 16 (64 prompts, 128 tokens), a repeat over the same prompts,
under cProfile, with the forwards counted by mode and by path (graph replay or eager), and the
device's busy time and top kernels from torch.profiler over the same pass, so host time the GPU
waits for shows as wall minus busy.

    PYTHONPATH=$PWD python benchmarks/profile_spec.py OUT_DIR [--miss]
"""

from __future__ import annotations

import cProfile
import io
import json
import pathlib
import pstats
import sys
import tempfile
import time
from collections import Counter
from typing import Any

import torch

from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.spec import NGRAM, _params, random_prompts
from plait.bench.workloads import make_engine, release

SHAPE = "llama-3.1-8b"


def _count_forwards(engine: Any, counts: Counter[str]) -> None:
    """Record each forward's mode and whether a captured graph ran it."""
    runner = engine.runner
    forward = runner.forward

    def counted(fb: Any, *args: Any, **kwargs: Any) -> Any:
        mode = fb.forward_mode
        if mode.is_target_verify():
            graphed = runner.verify_graph_runner is not None and runner.verify_graph_runner.can_run(fb)
        elif mode.is_decode():
            graphed = runner.graph_runner is not None and runner.graph_runner.can_run(fb)
        else:
            graphed = False
        counts[f"{mode.name}{' graph' if graphed else ' eager'}"] += 1
        return forward(fb, *args, **kwargs)

    runner.forward = counted


def _device_busy_ms(fn: Any, top: int = 15) -> tuple[float, list[dict[str, Any]]]:
    """Device time of ``fn`` in ms, and its ``top`` kernels by total time (name, calls, total ms)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    events = sorted(prof.key_averages(), key=lambda e: -e.device_time_total)
    table = [{"kernel": e.key[:100], "calls": e.count, "total_ms": e.device_time_total / 1e3} for e in events[:top]]
    return sum(e.device_time_total for e in events) / 1e3, table


def profile_pass(shape_dir: str, bs: int, prompts: list[list[int]], out_len: int,
                 params: dict[str, Any] | None = None, warm: list[list[list[int]]] | None = None,
                 **options: Any) -> tuple[dict[str, Any], str]:
    """``warm``: prompt sets for the two untimed passes (default: ``prompts`` itself, the repeat case)."""
    engine = make_engine(shape_dir, max_running_requests=bs, **NGRAM, **options)
    params = params or _params(out_len)
    for warm_prompts in warm or [prompts, prompts]:
        engine.generate(warm_prompts, params)  # fills the caches, warms the shapes
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    busy_ms, kernels = _device_busy_ms(lambda: engine.generate(prompts, params))
    counts: Counter[str] = Counter()
    _count_forwards(engine, counts)
    stats = engine.scheduler.spec_worker.stats
    v0 = stats.verify_steps
    prof = cProfile.Profile()
    prof.enable()
    engine.generate(prompts, params)
    torch.cuda.synchronize()
    prof.disable()
    row = {"bs": bs, "wall_s": wall, "tok_s": len(prompts) * out_len / wall, "device_busy_s": busy_ms / 1e3,
           "host_gap_s": wall - busy_ms / 1e3, "verify_steps": stats.verify_steps - v0, "forwards": dict(counts),
           "mean_accept_length": stats.mean_accept_length(), "kernels": kernels}
    release(engine)
    text = io.StringIO()
    ps = pstats.Stats(prof, stream=text)
    ps.sort_stats("tottime").print_stats(30)
    ps.sort_stats("cumulative").print_stats(40)
    return row, text.getvalue()


def main() -> None:
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), SHAPE))
    prompts = random_prompts(16, 128, SHAPES[SHAPE]["vocab_size"], seed=7)
    rows = []
    vocab = SHAPES[SHAPE]["vocab_size"]
    miss = "--miss" in sys.argv  # spec-ngram-miss at bs 16: sampled outputs over fresh prompts
    with open(out / f"profile-spec{'-miss' if miss else ''}-host.txt", "w") as f:
        for bs in (16,) if miss else (1, 16):
            if miss:
                row, text = profile_pass(shape_dir, bs, random_prompts(16, 128, vocab, seed=13), 64,
                                         params={**_params(64), "temperature": 1.0, "seed": 1234},
                                         warm=[random_prompts(16, 128, vocab, seed=s) for s in (11, 12)],
                                         disable_radix_cache=True)
            elif bs == 1:
                row, text = profile_pass(shape_dir, bs, prompts, 64)
            else:  # bs 16 at the sizes: 64 prompts x 128 tokens (admissions while others decode)
                row, text = profile_pass(shape_dir, bs, random_prompts(64, 128, vocab, seed=7), 128)
            rows.append(row)
            print(json.dumps(row))
            f.write(f"=== bs {bs}: {json.dumps(row)}\n{text[:12000]}\n")
    (out / f"profile-spec{'-miss' if miss else ''}.json").write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
