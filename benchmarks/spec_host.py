"""Host time of NGRAM speculative steps, with the worker's stages timed around their calls: 16 prompts x
64 tokens repeated (the spec-ngram-repeat pattern; BS requests at once).

Without ``--shape``, the tiny llama (one layer) on the CPU: the forward is the CPU model's compute and
says nothing about a GPU; the other stages are host work, split by where it runs on a GPU:

- critical: between a verify's result and the next launch (or the scheduler's return), the time the GPU
  waits for: ``propose`` (a chain's first step), ``next_verify`` (a chained step: the outcome's prepared
  proposals, slots), ``build_verify_batch``, ``accept`` (its result read, acceptance; on the CPU with
  the argmax over the vocabulary, which a verify graph computes on the GPU), ``commit_kv``,
  ``commit_tokens`` when no verify is queued behind it (a chain's last step), and ``other`` (the rest of
  ``decode_step``: candidates, admission, slot allocation);
- hidden: while a verify forward is queued (launched, its result not read): ``premap_chains`` (a
  chain batch's KV map), ``deferred_work``, ``predraft`` and ``commit_tokens`` of the step before it.

With ``--shape`` (a GPU; the named shape with dummy weights in bf16, as ``plait bench spec`` runs it),
the same stages (``accept`` then includes the wait for the verify's result), and the device's side from
CUDA events around each forward: its time, and the device's idle time between consecutive forwards,
split into gaps inside a chain (both verifies launched by one scheduler step) and gaps across scheduler
steps (a chain's end, the engine's loop, admission, a plain decode step between).

    PYTHONPATH=$PWD python benchmarks/spec_host.py [BS] [--rounds R] [--profile] [--shape SHAPE]

Per stage: total, mean per verify step, and the median call (robust to a shared machine's pauses).
``--rounds``: timed repeat passes (more verify steps, steadier means); ``--profile``: a cProfile of the
timed stages (the forward excluded).
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

import torch

from plait import Engine
from plait.bench.spec import NGRAM, random_prompts
from plait.testing import make_tiny_model

CRITICAL = ("propose", "next_verify", "build_verify_batch", "accept", "commit", "commit_kv")
HIDDEN = ("deferred_work", "predraft", "premap_chains", "launch_ahead")
EITHER = ("commit_tokens",)  # hidden when a verify is queued behind it, else critical


class Timer:
    """Wraps methods and records each call's seconds under its stage name."""

    def __init__(self, prof: cProfile.Profile | None, cuda: bool = False) -> None:
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.prof = prof
        self.in_step = False  # inside decode_step
        self.queued = False  # a verify forward is launched and its result not read yet
        self.nested = 0.0  # seconds of timed stages (and forwards) inside decode_step
        self.cuda = cuda
        self.steps = 0  # decode_step calls so far
        # On a GPU, every forward in launch order: (its decode_step's number, whether it verifies,
        # start event, end event).
        self.forwards: list[tuple[int, bool, torch.cuda.Event, torch.cuda.Event]] = []

    def wrap(self, obj: Any, name: str) -> None:
        inner = getattr(obj, name)

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if name == "decode_step":
                self.in_step, self.nested = True, 0.0
                self.steps += 1
                t0 = time.perf_counter()
                try:
                    return inner(*args, **kwargs)
                finally:
                    self.calls["other"].append(time.perf_counter() - t0 - self.nested)
                    self.in_step = False
            stage = name
            if name in EITHER:
                stage = f"{name} ({'hidden' if self.queued else 'critical'})"
            profiled = self.prof is not None and name != "forward"
            if profiled:
                self.prof.enable()
            events = None
            if self.cuda and name == "forward":
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if events is not None:
                    events[1].record()
                    fb = args[0] if args else kwargs["fb"]
                    self.forwards.append((self.steps, fb.forward_mode.is_target_verify(), *events))
                if profiled:
                    self.prof.disable()
                self.calls[stage].append(dt)
                if self.in_step:
                    self.nested += dt
                if name == "forward" and args and args[0].forward_mode.is_target_verify():
                    self.queued = True
                elif name == "accept":
                    self.queued = False

        setattr(obj, name, wrapper)


def device_report(timer: Timer) -> None:
    """The device's side of a GPU run (call after it finished): forward times and the idle gaps
    between consecutive forwards, inside a chain and across scheduler steps, in microseconds."""
    verify_us = [a.elapsed_time(b) * 1e3 for _, verify, a, b in timer.forwards if verify]
    gaps: dict[str, list[float]] = defaultdict(list)
    for (step, _, _, end), (next_step, verify, start, _) in zip(timer.forwards, timer.forwards[1:], strict=False):
        kind = "inside a chain" if next_step == step else "across scheduler steps"
        gaps[kind if verify else "before a plain forward"].append(end.elapsed_time(start) * 1e3)
    print(f"  device: {len(verify_us)} verify forwards, median {statistics.median(verify_us):.1f} us")
    for kind, values in sorted(gaps.items()):
        print(f"  idle {kind:24s} {len(values):5d} gaps, total {sum(values) / 1e3:8.2f} ms, "
              f"median {statistics.median(values):7.1f} us, per verify {sum(values) / len(verify_us):7.1f} us")


def make_engine_for(args: argparse.Namespace) -> tuple[Any, list[list[int]]]:
    """(engine, prompts): the tiny llama on the CPU, or ``--shape`` with dummy weights on the GPU."""
    if args.shape is None:
        path = make_tiny_model(tempfile.mkdtemp(), "llama", num_hidden_layers=1)
        engine = Engine(model=str(path), max_running_requests=args.bs, attention_backend="torch_native", **NGRAM)
        return engine, random_prompts(16, 128, 400, seed=7)
    from plait.bench.shapes import SHAPES, write_shape_dir
    from plait.bench.workloads import make_engine

    shape_dir = str(write_shape_dir(tempfile.mkdtemp(prefix="plait-shapes-"), args.shape))
    engine = make_engine(shape_dir, max_running_requests=args.bs, **NGRAM)
    return engine, random_prompts(16, 128, SHAPES[args.shape]["vocab_size"], seed=7)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("bs", type=int, nargs="?", default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--profile", action="store_true")
    ap.add_argument("--shape", default=None, help="a bench shape (e.g. llama-3.1-8b) with dummy weights, on the GPU")
    args = ap.parse_args()
    engine, prompts = make_engine_for(args)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 64}
    for _ in range(2):
        engine.generate(prompts, params)  # fills the n-gram and prefix caches
    worker = engine.scheduler.spec_worker
    on_gpu = args.shape is not None and torch.cuda.is_available()
    timer = Timer(cProfile.Profile() if args.profile else None, cuda=on_gpu)
    stages = [n for n in (*CRITICAL, *HIDDEN, *EITHER) if hasattr(worker, n)]  # older commits lack some
    for name in stages:
        timer.wrap(worker, name)
    timer.wrap(engine.runner, "forward")
    timer.wrap(worker, "decode_step")
    steps0 = worker.stats.verify_steps
    stats = getattr(worker, "predraft_stats", None)  # older commits do not pre-draft
    if stats is not None:
        stats.clear()
    t0 = time.perf_counter()
    for _ in range(args.rounds):
        engine.generate(prompts, params)
    if timer.cuda:
        torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    steps = max(1, worker.stats.verify_steps - steps0)
    calls = timer.calls
    total = {name: sum(v) for name, v in calls.items()}
    print(f"bs {args.bs}: {steps} verify steps in {len(calls['other'])} speculative scheduler steps, "
          f"wall {wall * 1e3:.1f} ms, forward {total.get('forward', 0.0) * 1e3:.1f} ms")
    print(f"  {'stage':28s} {'total ms':>9s} {'us/step':>8s} {'median us':>9s}")
    names = sorted(n for n in calls if n not in ("forward",))
    crit = hidden = 0.0
    for name in names:
        t = total[name]
        med = statistics.median(calls[name]) * 1e6
        kind = "hidden" if name in HIDDEN or name.endswith("(hidden)") else "critical"
        if kind == "hidden":
            hidden += t
        else:
            crit += t
        print(f"  {name:28s} {t * 1e3:9.2f} {t / steps * 1e6:8.1f} {med:9.1f}  {kind}")
    print(f"  critical path: {crit / steps * 1e6:.1f} us/step; hidden behind a queued verify: "
          f"{hidden / steps * 1e6:.1f} us/step")
    # Everything of the pass but the forwards and the hidden stages (the scheduler's and the engine's
    # loops included): the host time a GPU would wait for, per verify step.
    rest = wall - total.get("forward", 0.0) - hidden
    print(f"  all host time outside forwards, less the hidden stages: {rest / steps * 1e6:.1f} us/step")
    if stats is not None:
        print(f"  proposals pre-drafted during the verify (hit), drafted anew (miss, unprepared): {dict(stats)}")
    if timer.cuda:
        device_report(timer)
    engine.shutdown()
    if timer.prof is not None:
        out = io.StringIO()
        pstats.Stats(timer.prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
