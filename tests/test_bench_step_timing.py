"""plait.bench.workloads.step_timing: the offline benchmark's per-step breakdown of a real run."""

from __future__ import annotations

from plait import Engine
from plait.bench.workloads import release, step_timing


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
