"""The named workloads' requests (plait.bench.workloads), as the benchmarks and the A/B scripts draw them."""

from __future__ import annotations

from plait.bench.workloads import nano_vllm_requests


def test_nano_vllm_requests_follow_its_recipe_and_repeat_per_seed():
    prompts, params = nano_vllm_requests(32)
    assert len(prompts) == len(params) == 32
    assert all(100 <= len(p) <= 1024 and all(0 <= t <= 10000 for t in p) for p in prompts)
    assert all(100 <= q["max_new_tokens"] <= 1024 and q["temperature"] == 0.6 and q["ignore_eos"] for q in params)
    assert [q["seed"] for q in params] == list(range(32))
    assert nano_vllm_requests(32) == (prompts, params)
    assert nano_vllm_requests(32, seed=1)[0] != prompts
