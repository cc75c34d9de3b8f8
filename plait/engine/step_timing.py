"""Wall time of every scheduler step by kind (prefill or decode) and, on a GPU, the device time of each
step's forward: whether a run's steps wait for the device or for the host. The offline benchmarks wrap
an engine's scheduler with it; the scheduler process does under PLAIT_LOOP_TRACE (the serving bench)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch


class StepTimes:
    """Wall time of every scheduler step of a run, by kind: ``prefill`` when the scheduler (rank 0's,
    under DP attention) had prompts waiting or mid-prefill as the step began, else ``decode``. The
    rest of a run's time is ``outside_steps`` (request setup, flush, building outputs). On a GPU also
    the device time of each step's forward (CUDA events around ``runner.forward_batch``: the graph
    replay or eager kernels and the sampler), so ``device_busy`` against ``total_s`` says whether a
    kind's steps waited for the host (with overlap scheduling a step's wall time is the larger of
    the two)."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {"prefill": [], "decode": []}
        # Every forward in launch order: (its step's kind, its batch's requests, start event, end event).
        self.forwards: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] = []

    def summary(self, seconds: float) -> dict[str, Any]:
        """The steps by kind; waits for the last forward's end event (the events are read)."""
        if self.forwards:
            self.forwards[-1][3].synchronize()
        out: dict[str, Any] = {}
        for kind, ts in self.times.items():
            if ts:
                ordered = sorted(ts)
                out[kind] = {"count": len(ts), "total_s": sum(ts), "mean_ms": 1e3 * sum(ts) / len(ts),
                             "median_ms": 1e3 * ordered[len(ts) // 2],
                             "p90_ms": 1e3 * ordered[min(len(ts) - 1, (9 * len(ts)) // 10)]}
                busy = [start.elapsed_time(end) / 1e3 for k, _, start, end in self.forwards if k == kind]
                if busy:
                    out[kind] |= {"device_busy_s": sum(busy), "device_busy_fraction": sum(busy) / sum(ts),
                                  "device_median_ms": 1e3 * sorted(busy)[len(busy) // 2]}
        out["outside_steps_s"] = seconds - sum(sum(ts) for ts in self.times.values())
        if len(self.forwards) > 1:
            out["device_gaps"] = self.device_gaps()
        return out

    def device_gaps(self) -> dict[str, Any]:
        """The device time between one forward's end and the next one's start (the step's own copies and
        scatters, and any wait for the host to launch), summed by the batch size of the forward after
        the gap (requests, in buckets), with the largest gaps: where a run's device idles."""
        buckets = ((128, "bs >= 128"), (32, "bs 32-127"), (8, "bs 8-31"), (0, "bs 1-7"))
        by_bucket: dict[str, dict[str, float]] = {}
        gaps: list[tuple[float, int, int]] = []
        for (_, bs_before, _, end), (_, bs, start, _) in zip(self.forwards, self.forwards[1:], strict=False):
            gap_ms = end.elapsed_time(start)
            gaps.append((gap_ms, bs_before, bs))
            label = next(name for lo, name in buckets if bs >= lo)
            row = by_bucket.setdefault(label, {"gaps": 0, "total_s": 0.0, "over_50us": 0})
            row["gaps"] += 1
            row["total_s"] += gap_ms / 1e3
            row["over_50us"] += gap_ms > 0.05
        gaps.sort(reverse=True)
        return {"total_s": sum(g for g, _, _ in gaps) / 1e3, "by_batch_size": by_bucket,
                "largest": [{"ms": g, "bs_before": a, "bs_after": b} for g, a, b in gaps[:8]]}


@contextmanager
def step_timing(scheduler: Any) -> Iterator[StepTimes]:
    """Time ``scheduler.step`` calls (a perf_counter pair per step) while the block runs, and on a GPU
    each step's forward on the device (a CUDA event pair around ``runner.forward_batch``)."""
    times = StepTimes()
    step = scheduler.step
    # A DP-attention engine's scheduler drives its ranks' runners itself: there, wall times only.
    runner = getattr(scheduler, "runner", None)
    on_gpu = runner is not None and torch.device(runner.device).type == "cuda"
    forward = runner.forward_batch if on_gpu else None
    kind = "prefill"

    def timed_step() -> Any:
        nonlocal kind
        kind = "prefill" if scheduler.waiting or scheduler.prefilling else "decode"
        t0 = time.perf_counter()
        out = step()
        times.times[kind].append(time.perf_counter() - t0)
        return out

    def timed_forward(fb: Any, *args: Any, **kwargs: Any) -> Any:
        assert forward is not None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = forward(fb, *args, **kwargs)
        end.record()
        times.forwards.append((kind, fb.batch_size, start, end))
        return out

    scheduler.step = timed_step
    if on_gpu:
        runner.forward_batch = timed_forward
    try:
        yield times
    finally:
        del scheduler.step  # back to the class's method
        if on_gpu:
            del runner.forward_batch
