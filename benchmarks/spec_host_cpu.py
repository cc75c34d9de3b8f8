"""Host time of NGRAM speculative steps, without a GPU: the tiny llama (one layer) on the CPU, 16 prompts
x 64 tokens repeated (the spec-ngram-repeat pattern at bs 16), with the worker's stages timed around
their calls. The forward is the CPU model's compute and says nothing about a GPU; the other stages are
the host work a GPU would wait for, except the hidden ones: on a GPU ``deferred_work`` and ``predraft``
run while the verify forward is queued (here they show, since the CPU forward is synchronous).
``other`` is the rest of ``decode_step`` (candidate selection, admission, slot allocation).

    PYTHONPATH=$PWD python benchmarks/spec_host_cpu.py [BS] [--rounds R] [--profile]

Per stage: total, mean per verify step, and the median call (robust to a shared machine's pauses).
``--rounds``: timed repeat passes (more verify steps, steadier means); ``--profile``: a cProfile of
the timed stages (the forward excluded).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from typing import Any

from plait import Engine
from plait.bench.spec import NGRAM, random_prompts
from plait.testing import make_tiny_model

CRITICAL = ("propose", "build_verify_batch", "accept", "commit")
HIDDEN = ("deferred_work", "predraft")


def _timed(calls: dict[str, list[float]], obj: Any, name: str, prof: cProfile.Profile | None,
           inside: list[bool]) -> None:
    """Record every call's seconds under ``name``, and under ``name + "/step"`` the calls made inside
    ``decode_step`` (``inside[0]``), which ``other`` is computed from."""
    inner = getattr(obj, name)

    def wrapper(*args: Any, **kwargs: Any) -> Any:
        outer = name == "decode_step"
        nested = inside[0]
        if outer:
            inside[0] = True
        if prof is not None and not outer and name != "forward":
            prof.enable()
        t0 = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            dt = time.perf_counter() - t0
            calls[name].append(dt)
            if nested:
                calls[name + "/step"].append(dt)
            if outer:
                inside[0] = False
            elif prof is not None and name != "forward":
                prof.disable()

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bs", type=int, nargs="?", default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    args = ap.parse_args()
    path = make_tiny_model(tempfile.mkdtemp(), "llama", num_hidden_layers=1)
    engine = Engine(model=str(path), max_running_requests=args.bs, attention_backend="torch_native", **NGRAM)
    prompts = random_prompts(16, 128, 400, seed=7)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 64}
    for _ in range(2):
        engine.generate(prompts, params)  # fills the n-gram and prefix caches
    worker = engine.scheduler.spec_worker
    calls: dict[str, list[float]] = defaultdict(list)
    prof = cProfile.Profile() if args.profile else None
    stages = [name for name in (*CRITICAL, *HIDDEN) if hasattr(worker, name)]  # older commits lack some
    inside = [False]
    for name in stages:
        _timed(calls, worker, name, prof, inside)
    _timed(calls, engine.runner, "forward", prof, inside)
    _timed(calls, worker, "decode_step", prof, inside)
    steps0 = worker.stats.verify_steps
    stats = getattr(worker, "predraft_stats", None)  # older commits do not pre-draft
    if stats is not None:
        stats.clear()
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        engine.generate(prompts, params)
    wall = time.perf_counter() - t0
    steps = max(1, worker.stats.verify_steps - steps0)
    total = {name: sum(v) for name, v in calls.items()}
    fwd = total.get("forward", 0.0)
    print(f"bs {args.bs}: {steps} verify steps, wall {wall * 1e3:.1f} ms, forward {fwd * 1e3:.1f} ms")
    nested = sum(total.get(n + "/step", 0.0) for n in (*stages, "forward"))
    other = total.get("decode_step", 0.0) - nested
    print(f"  {'stage':20s} {'total ms':>9s} {'us/step':>8s} {'median us':>9s}")
    for name in (*stages, "other"):
        t = other if name == "other" else total.get(name, 0.0)
        med = statistics.median(calls[name]) * 1e6 if calls.get(name) else float("nan")
        print(f"  {name:20s} {t * 1e3:9.2f} {t / steps * 1e6:8.1f} {med:9.1f}")
    crit = sum(total.get(n, 0.0) for n in CRITICAL)
    print(f"  critical path (propose + build + accept + commit): {crit / steps * 1e6:.1f} us/step")
    if stats is not None:
        print(f"  proposals pre-drafted during the verify (hit), drafted anew (miss, unprepared): {dict(stats)}")
    engine.shutdown()
    if prof is not None:
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
