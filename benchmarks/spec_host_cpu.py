"""Host time of NGRAM speculative steps, without a GPU: the tiny llama (one layer) on the CPU, 16 prompts
x 64 tokens repeated (the spec-ngram-repeat pattern at bs 16), with the worker's stages timed around
their calls. The forward is the CPU model's compute and says nothing about a GPU; the other stages are
the host work a GPU would wait for (on a GPU the deferred work inside ``decode_step`` hides behind the
queued verify forward; here it shows, since the CPU forward is synchronous).

    PYTHONPATH=$PWD python benchmarks/spec_host_cpu.py [BS]
"""

from __future__ import annotations

import sys
import tempfile
import time
from collections import Counter
from typing import Any

from plait import Engine
from plait.bench.spec import NGRAM, random_prompts
from plait.testing import make_tiny_model

STAGES = ("propose", "build_verify_batch", "accept", "commit", "deferred_work")


def _timed(counter: Counter[str], obj: Any, name: str) -> None:
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            counter[name] += time.perf_counter() - t0

    setattr(obj, name, wrapper)


def main() -> None:
    bs = int(sys.argv[1]) if len(sys.argv) > 1 else 16
    path = make_tiny_model(tempfile.mkdtemp(), "llama", num_hidden_layers=1)
    engine = Engine(model=str(path), max_running_requests=bs, attention_backend="torch_native", **NGRAM)
    prompts = random_prompts(16, 128, 400, seed=7)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 64}
    for _ in range(2):
        engine.generate(prompts, params)  # fills the n-gram and prefix caches
    worker = engine.scheduler.spec_worker
    seconds: Counter[str] = Counter()
    stages = [name for name in STAGES if hasattr(worker, name)]  # older commits lack some stages
    for name in stages:
        _timed(seconds, worker, name)
    _timed(seconds, engine.runner, "forward")
    steps0 = worker.stats.verify_steps
    t0 = time.perf_counter()
    engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps = worker.stats.verify_steps - steps0
    print(f"bs {bs}: {steps} verify steps, wall {wall * 1e3:.1f} ms, forward {seconds['forward'] * 1e3:.1f} ms")
    for name in stages:
        print(f"  {name:20s} {seconds[name] * 1e3:7.2f} ms  {seconds[name] / max(1, steps) * 1e3:6.3f} ms/step")
    engine.shutdown()


if __name__ == "__main__":
    main()
