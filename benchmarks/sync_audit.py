"""Which host syncs an offline run's scheduler steps make (H200): torch's CUDA sync debug mode over
the timed part of a small offline-throughput run, every synchronizing call reported with the Python
stack that made it (counted per distinct stack), and each step's host launch time beside its wall
time, per step kind. A sync on the launch path makes the host wait for the batch in flight, so the
device then idles while the host builds and launches the next one.

    PYTHONPATH=$PWD python benchmarks/sync_audit.py OUT_DIR [SHAPE] [PROMPTS] [nano]

``nano``: nano-vllm's lengths (prompt and output uniform in [100, 1024] per request) instead of 512-token
prompts and 16 new tokens, so requests finish at different steps and the batch shrinks as they do.
"""

from __future__ import annotations

import json
import random
import sys
import tempfile
import time
import traceback
import warnings
from collections import Counter, defaultdict
from typing import Any

import torch

from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.warm_start import TritonCompiles
from plait.bench.workloads import make_engine, random_prompts, release


def main() -> None:
    out_dir = sys.argv[1]
    shape = sys.argv[2] if len(sys.argv) > 2 else "llama-3.2-1b"
    n = int(sys.argv[3]) if len(sys.argv) > 3 else 64
    nano = len(sys.argv) > 4 and sys.argv[4] == "nano"
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(), shape))
    vocab = SHAPES[shape]["vocab_size"]
    engine = make_engine(shape_dir, max_running_requests=256)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 16}
    engine.generate(random_prompts(n, 512, vocab, seed=0), params)  # warm-up
    sched = engine.scheduler

    stacks: Counter[str] = Counter()

    def record(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
        if "synchroniz" in str(message):
            frames = [f for f in traceback.extract_stack()[:-1] if "/plait/" in f.filename]
            stacks["\n".join(f"  {f.filename.split('/plait/')[-1]}:{f.lineno} {f.name}" for f in frames[-8:])] += 1

    launch_ms: dict[str, list[float]] = defaultdict(list)
    step_ms: dict[str, list[float]] = defaultdict(list)
    original_launch = sched._launch
    kinds: list[str] = []

    def timed_launch(batch: Any) -> Any:
        kind = "mixed" if any(not e.is_decode for e in batch.entries) else "decode"
        kinds.append(kind)
        t0 = time.perf_counter()
        try:
            return original_launch(batch)
        finally:
            launch_ms[kind].append(1e3 * (time.perf_counter() - t0))

    sched._launch = timed_launch
    if nano:
        rng = random.Random(1)
        lengths = [(rng.randint(100, 1024), rng.randint(100, 1024)) for _ in range(n)]
        prompts = random_prompts(n, [i for i, _ in lengths], vocab, seed=1)
        timed_params = [{**params, "max_new_tokens": o} for _, o in lengths]
    else:
        prompts, timed_params = random_prompts(n, 512, vocab, seed=1), [params] * n
    for p, sp in zip(prompts, timed_params, strict=True):
        sched.add_request(engine.make_request(p, sp))
    # Every Triton kernel variant this process first launches inside the audited run (compiled, or loaded
    # from the disk cache): launch classes that the start-up warm-up and the untimed pass missed, with
    # the argument specialisations (dtypes, 16-divisibility) that tell them apart.
    with TritonCompiles() as compiles:
        old_show = warnings.showwarning
        warnings.showwarning = record
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        try:
            while sched.has_work():
                kinds.clear()
                t0 = time.perf_counter()
                sched.step()
                step_ms[kinds[0] if kinds else "none"].append(1e3 * (time.perf_counter() - t0))
            sched.flush()
            if torch.cuda.is_available():
                torch.cuda.synchronize()
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = old_show
    release(engine)

    def summary(v: list[float]) -> dict[str, float]:
        s = sorted(v)
        return {"count": len(s), "median_ms": s[len(s) // 2], "max_ms": s[-1], "total_ms": sum(s)}

    missed = compiles.variants
    result = {"shape": shape, "prompts": n, "lengths": "nano-vllm" if nano else "512 in / 16 out",
              "triton_variants_first_launched_in_run": missed,
              "syncs": [{"count": c, "stack": s} for s, c in stacks.most_common(20)],
              "launch": {k: summary(v) for k, v in launch_ms.items()},
              "step": {k: summary(v) for k, v in step_ms.items()}}
    print(json.dumps({k: result[k] for k in ("launch", "step")}, indent=1))
    for row in result["syncs"][:10]:
        print(f"--- {row['count']} x\n{row['stack']}")
    for variant in missed:
        print(f"first launched in the run: {variant[:400]}")
    with open(f"{out_dir}/sync-audit-{shape}{'-nano' if nano else ''}.json", "w") as f:
        json.dump(result, f, indent=2)


if __name__ == "__main__":
    main()
