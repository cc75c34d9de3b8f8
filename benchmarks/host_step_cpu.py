"""The scheduler's host time per decode step outside the forward, at 256 requests, on the CPU: a 1-layer tiny
Llama in fp32, 256 prompts of 64 tokens, 64 new tokens each, one untimed pass and one timed pass. Prints each
decode step's wall median, the forward's median (``ModelRunner.forward_batch``, which on the CPU includes the
compute) and their difference: what the host spends per step on scheduling, sampling bookkeeping and
processing results, the work overlap scheduling has to hide behind a GPU forward.

    python benchmarks/host_step_cpu.py
"""

from __future__ import annotations

import statistics
import tempfile
import time
from collections.abc import Callable
from typing import Any

from plait.engine import Engine
from plait.engine.step_timing import step_timing
from plait.models.tiny import make_tiny_model

NUM_REQUESTS, PROMPT_LEN, NEW_TOKENS = 256, 64, 64


def timed(fn: Callable[..., Any], spent: list[float]) -> Callable[..., Any]:
    def run(*args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        spent.append(time.perf_counter() - t0)
        return out
    return run


def main() -> None:
    path = make_tiny_model(tempfile.mkdtemp(), "llama", num_hidden_layers=1)
    engine = Engine(model=str(path), device="cpu", dtype="float32", max_total_tokens=65536,
                    max_running_requests=NUM_REQUESTS)
    runner = engine.scheduler.runner
    forwards: list[float] = []
    runner.forward_batch = timed(runner.forward_batch, forwards)  # type: ignore[method-assign]
    prompts = [[(i * 7 + j) % 400 + 3 for j in range(PROMPT_LEN)] for i in range(NUM_REQUESTS)]
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": NEW_TOKENS}
    engine.generate(input_ids=prompts, sampling_params=params)
    forwards.clear()
    with step_timing(engine.scheduler) as steps:
        engine.generate(input_ids=[[t + 1 for t in p] for p in prompts], sampling_params=params)
    decode = steps.times["decode"]
    wall, forward = statistics.median(decode), statistics.median(forwards[-len(decode):])
    print(f"decode steps {len(decode)}: wall median {1e3 * wall:.2f} ms, forward median {1e3 * forward:.2f} ms, "
          f"host outside the forward {1e3 * (wall - forward):.2f} ms")


if __name__ == "__main__":
    main()
