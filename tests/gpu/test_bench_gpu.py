"""The offline benchmark's per-step breakdown on the GPU (plait.engine.step_timing.step_timing): every
step's forward also carries its device time (H200, llama-3.2-1b shape with random weights,
graph-replayed decode)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts, release, timed  # noqa: E402
from plait.engine.step_timing import step_timing  # noqa: E402

SHAPE = "llama-3.2-1b"


def test_step_timing_reports_each_kinds_device_busy_time(shape_dir):
    engine = make_engine(shape_dir, max_running_requests=32, disable_radix_cache=True)
    prompts = random_prompts(32, 200, SHAPES[SHAPE]["vocab_size"], seed=3)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24}
    engine.generate(prompts, params)  # warm
    with step_timing(engine.scheduler) as steps:
        _, seconds = timed(lambda: engine.generate(prompts, params))
    summary = steps.summary(seconds)
    assert "forward_batch" not in vars(engine.runner)  # the runner's method is back
    release(engine)
    # With overlap a forward's device time lands in the wall time of the step after it (the one that
    # waits for its results), so per kind the two differ by about a step; over the run they cannot.
    busy = summary["prefill"]["device_busy_s"] + summary["decode"]["device_busy_s"]
    assert summary["prefill"]["device_busy_s"] > 0
    assert 0 < busy <= seconds
    assert 0 < summary["decode"]["device_busy_fraction"] <= 1.1
    assert summary["decode"]["device_median_ms"] > 0
    # The device time between forwards: every gap counted once, none negative, within the run.
    gaps = summary["device_gaps"]
    assert sum(row["gaps"] for row in gaps["by_batch_size"].values()) == len(steps.forwards) - 1
    assert 0 <= gaps["total_s"] <= seconds
    assert all(g["ms"] >= 0 for g in gaps["largest"])
