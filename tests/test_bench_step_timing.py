"""plait.engine.step_timing.step_timing and gc_pauses: the offline benchmark's per-step breakdown of a real
run, and the collector's stalls inside it."""

from __future__ import annotations

import gc

from plait import Engine
from plait.bench.workloads import release
from plait.engine.heap import gc_pauses
from plait.engine.step_timing import step_timing


def test_step_timing_splits_a_run_into_prefill_and_decode_steps_and_restores_step(tiny_model_dir):
    engine = Engine(model=str(tiny_model_dir("llama")), max_running_requests=4, chunked_prefill_size=16)
    try:
        prompts = [[5 + i] * 20 for i in range(3)]  # 60 prompt tokens: several 16-token prefill steps
        params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 6}
        with step_timing(engine.scheduler) as steps:
            engine.generate(prompts, params)
        summary = steps.summary(seconds=10.0)
        assert summary["prefill"]["count"] >= 60 // 16
        assert summary["decode"]["count"] >= 5  # the tokens after the first come from decode steps
        stepped = summary["prefill"]["total_s"] + summary["decode"]["total_s"]
        assert summary["outside_steps_s"] == 10.0 - stepped
        assert "step" not in vars(engine.scheduler)  # the class's step is back
    finally:
        release(engine)


def test_gc_pauses_counts_each_generations_collections_in_the_block_only():
    gc.collect()  # before the block: not counted
    with gc_pauses() as pauses:
        gc.collect()
        gc.collect(0)
    gc.collect()  # after the block: not counted
    assert pauses["gen2"]["collections"] == 1
    assert pauses["gen0"]["collections"] >= 1
    assert pauses["gen2"]["seconds"] > 0.0


class _DeviceClock:
    """Stands in for a recorded CUDA event (none exist on the CPU): its time on the device, in ms."""

    def __init__(self, ms: float) -> None:
        self.ms = ms

    def elapsed_time(self, later: _DeviceClock) -> float:
        return later.ms - self.ms


def test_device_gaps_sum_the_idle_time_between_forwards_by_the_next_batch_size():
    from plait.engine.step_timing import StepTimes

    times = StepTimes()
    # (requests, start ms, end ms): gaps of 0.02 ms before the bs-200 forward, 0.5 before bs 3, 0.1 before bs 2.
    for bs, start, end in ((256, 0.0, 5.0), (200, 5.02, 9.0), (3, 9.5, 10.0), (2, 10.1, 10.5)):
        times.forwards.append(("decode", bs, _DeviceClock(start), _DeviceClock(end)))
    gaps = times.device_gaps()
    assert abs(gaps["total_s"] - 0.62e-3) < 1e-9
    assert {k: (v["gaps"], v["over_50us"]) for k, v in gaps["by_batch_size"].items()} == {
        "bs >= 128": (1, 0), "bs 1-7": (2, 2)}
    assert [(g["bs_before"], g["bs_after"]) for g in gaps["largest"]] == [(200, 3), (3, 2), (256, 200)]
