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
import contextlib
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from collections import defaultdict
from types import SimpleNamespace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from plait import Engine
from plait.bench.spec import NGRAM, random_prompts
from plait.testing import make_tiny_model

CRITICAL = ("propose", "next_verify", "build_verify_batch", "accept", "commit", "commit_kv")
HIDDEN = ("deferred_work", "predraft", "premap_chains", "launch_ahead", "stage_guess")
EITHER = ("commit_tokens",)  # hidden when a verify is queued behind it, else critical


class OpCounter(TorchDispatchMode):
    """Counts the aten ops each stage dispatches (on a GPU each is a kernel launch or a copy, 5-20 us
    of host time): ops go to the innermost stage running, the forward's own ops to ``forward``."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.ops: dict[str, dict[str, int]] = defaultdict(lambda: defaultdict(int))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.stack:
            self.ops[self.stack[-1]][str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


class Timer:
    """Wraps methods and records each call's seconds under its stage name."""

    def __init__(self, prof: cProfile.Profile | None, cuda: bool = False, ops: OpCounter | None = None,
                 record: bool = False) -> None:
        self.ops = ops
        self.record = record  # each stage's call inside a torch.profiler.record_function of its name
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.prof = prof
        self.in_step = False  # inside decode_step
        self.in_guess = False  # inside stage_guess (PLAIT_SPEC_STAGE_NEXT): its stages run while a verify is queued
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
                if self.ops is not None:
                    self.ops.stack.append("other")
                t0 = time.perf_counter()
                try:
                    with self.recorded("other"):
                        return inner(*args, **kwargs)
                finally:
                    self.calls["other"].append(time.perf_counter() - t0 - self.nested)
                    self.in_step = False
                    if self.ops is not None:
                        self.ops.stack.pop()
            stage = name
            if name in EITHER:
                stage = f"{name} ({'hidden' if self.queued else 'critical'})"
            if self.in_guess:
                stage = f"{name} (staged)"
            guess = name == "stage_guess"
            if guess:
                self.in_guess = True
            if self.ops is not None:
                self.ops.stack.append(stage)
            profiled = self.prof is not None and name != "forward"
            if profiled:
                self.prof.enable()
            events = None
            if self.cuda and name == "forward":
                events = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                events[0].record()
            t0 = time.perf_counter()
            try:
                with self.recorded(stage):
                    return inner(*args, **kwargs)
            finally:
                dt = time.perf_counter() - t0
                if guess:
                    self.in_guess = False
                if events is not None:
                    events[1].record()
                    fb = args[0] if args else kwargs["fb"]
                    self.forwards.append((self.steps, fb.forward_mode.is_target_verify(), *events))
                if profiled:
                    self.prof.disable()
                if self.ops is not None:
                    self.ops.stack.pop()
                self.calls[stage].append(dt)
                if self.in_step:
                    self.nested += dt
                if name == "forward" and args and args[0].forward_mode.is_target_verify():
                    self.queued = True
                elif name == "accept":
                    self.queued = False

        setattr(obj, name, wrapper)

    def recorded(self, stage: str) -> contextlib.AbstractContextManager[Any]:
        return torch.profiler.record_function(f"stage:{stage}") if self.record else contextlib.nullcontext()


def runtime_report(prof: torch.profiler.profile, steps: int) -> None:
    """The CUDA runtime calls (cudaMemcpyAsync, cudaHostAlloc, cudaEventQuery, ...) each stage made,
    with their host time: a stage slower on a GPU's host than on the CPU shows which call it waits in."""
    per: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for ev in prof.events():
        if not ev.name.startswith("cuda"):
            continue
        parent, stage = ev.cpu_parent, "outside any stage"
        while parent is not None:
            if parent.name.startswith("stage:"):
                stage = parent.name[len("stage:"):]
                break
            parent = parent.cpu_parent
        per[stage][ev.name].append(ev.cpu_time_total)
    print("  CUDA runtime calls per verify step by stage: count, host us (the largest first)")
    for stage, calls in sorted(per.items()):
        total = sum(sum(v) for v in calls.values())
        top = ", ".join(f"{name} {len(v) / steps:.1f}x {sum(v) / steps:.0f}us"
                        for name, v in sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:6])
        print(f"  {stage:28s} {total / steps:7.0f} us  ({top})")

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
    ap.add_argument("--cuda-api", action="store_true",
                    help="on a GPU, the CUDA runtime calls per stage and their host time (torch.profiler)")
    ap.add_argument("--ops", action="store_true", help="count the aten ops (kernel launches on a GPU) per stage")
    ap.add_argument("--shape", default=None, help="a bench shape (e.g. llama-3.1-8b) with dummy weights, on the GPU")
    args = ap.parse_args()
    engine, prompts = make_engine_for(args)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 64}
    for _ in range(2):
        engine.generate(prompts, params)  # fills the n-gram and prefix caches
    worker = engine.scheduler.spec_worker
    on_gpu = args.shape is not None and torch.cuda.is_available()
    counter = OpCounter() if args.ops else None
    timer = Timer(cProfile.Profile() if args.profile else None, cuda=on_gpu, ops=counter, record=args.cuda_api)
    stages = [n for n in (*CRITICAL, *HIDDEN, *EITHER) if hasattr(worker, n)]  # older commits lack some
    for name in stages:
        timer.wrap(worker, name)
    timer.wrap(engine.runner, "forward")
    timer.wrap(worker, "decode_step")
    if hasattr(engine.runner, "stage"):  # a staged verify's launch is timed as its forward
        stage = engine.runner.stage

        def timed_stage(fb: Any) -> Any:
            launch = stage(fb)
            if launch is None:
                return None
            shim = SimpleNamespace(forward=lambda _fb: launch())
            timer.wrap(shim, "forward")
            return lambda: shim.forward(fb)
        engine.runner.stage = timed_stage
    steps0 = worker.stats.verify_steps
    plain0 = dict(getattr(worker.stats, "plain_steps", {}))  # older commits do not count them
    stats = getattr(worker, "predraft_stats", None)  # older commits do not pre-draft
    if stats is not None:
        stats.clear()
    tracing = contextlib.ExitStack()
    if counter is not None:
        tracing.enter_context(counter)
    api_prof = None
    if args.cuda_api:
        activities = [torch.profiler.ProfilerActivity.CPU]
        if on_gpu:
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        api_prof = tracing.enter_context(torch.profiler.profile(activities=activities))
    t0 = time.perf_counter()
    with tracing:
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
        kind = "hidden" if name in HIDDEN or name.endswith(("(hidden)", "(staged)")) else "critical"
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
    plain = {k: n - plain0.get(k, 0) for k, n in getattr(worker.stats, "plain_steps", {}).items()}
    print(f"  scheduler steps without a verify, by cause: {plain}")
    if stats is not None:
        print(f"  proposals pre-drafted during the verify (hit), drafted anew (miss, unprepared): {dict(stats)}")
    if counter is not None:
        print("  aten ops per verify step (a kernel launch or copy each on a GPU), by stage:")
        for name, ops in sorted(counter.ops.items()):
            if name == "forward":
                continue
            top = ", ".join(f"{op} {n / steps:.1f}" for op, n in sorted(ops.items(), key=lambda kv: -kv[1])[:8])
            print(f"  {name:28s} {sum(ops.values()) / steps:6.1f}  ({top})")
    if api_prof is not None:
        runtime_report(api_prof, steps)
    if timer.cuda:
        device_report(timer)
    engine.shutdown()
    if timer.prof is not None:
        out = io.StringIO()
        pstats.Stats(timer.prof, stream=out).sort_stats("tottime").print_stats(30)
        print(out.getvalue())


if __name__ == "__main__":
    main()
