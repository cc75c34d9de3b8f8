"""Overlap scheduling: results of batch N are processed after batch N+1 is launched, and outputs are
identical with overlap on or off (float32, CPU)."""

from __future__ import annotations

import pytest

from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(8, seed=11)
CASES = {
    "greedy": GREEDY,
    "seeded_sampling": {"temperature": 0.9, "top_p": 0.9, "seed": 5, "max_new_tokens": 32},
    "penalties": {"temperature": 0.7, "seed": 9, "frequency_penalty": 1.0, "repetition_penalty": 1.3,
                  "max_new_tokens": 24},
    "min_p_top_k": {"temperature": 1.2, "top_k": 20, "min_p": 0.05, "seed": 3, "max_new_tokens": 24},
}


@pytest.fixture(scope="module")
def path(tiny_model_dir):
    return tiny_model_dir("qwen3")


@pytest.mark.parametrize("case", sorted(CASES))
def test_outputs_identical_with_overlap_on_and_off(path, case):
    on = make_engine(path, disable_overlap_schedule=False)
    off = make_engine(path, disable_overlap_schedule=True)
    a = on.generate(PROMPTS, CASES[case])
    b = off.generate(PROMPTS, CASES[case])
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.text for o in a] == [o.text for o in b]
    assert_no_leaks(on)


def test_stop_tokens_identical_with_overlap_on_and_off(path):
    off = make_engine(path, disable_overlap_schedule=True)
    full = off.generate(PROMPTS, GREEDY)
    params = [{**GREEDY, "stop_token_ids": [o.token_ids[5]]} for o in full]
    on = make_engine(path, disable_overlap_schedule=False)
    a = on.generate(PROMPTS, params)
    b = off.generate(PROMPTS, params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert all(o.finish_reason == "stop" for o in a)
    assert_no_leaks(on)


def test_overlap_processes_results_one_step_later(path):
    on = make_engine(path, disable_overlap_schedule=False)
    off = make_engine(path, disable_overlap_schedule=True)
    reqs = []
    for engine in (on, off):
        req = engine.make_request(PROMPTS[0], GREEDY)
        engine.scheduler.add_request(req)
        engine.scheduler.step()
        reqs.append(req)
    assert len(reqs[0].output_ids) == 0 and reqs[0].pending == 1  # sampled, still "on the device"
    assert len(reqs[1].output_ids) == 1 and reqs[1].pending == 0
    on.scheduler.step()  # launches decode 1, then processes the prefill's sample
    assert len(reqs[0].output_ids) == 1 and reqs[0].pending == 1


def test_retraction_under_overlap_keeps_outputs(path):
    off = make_engine(path, disable_overlap_schedule=True)
    ref = off.generate(PROMPTS, GREEDY)
    on = make_engine(path, disable_overlap_schedule=False, max_total_tokens=200)
    out = on.generate(PROMPTS, GREEDY)
    assert on.scheduler.stats.num_retractions >= 1
    assert [o.token_ids for o in out] == [o.token_ids for o in ref]
    assert_no_leaks(on)


def test_abort_under_overlap_releases_everything(path):
    on = make_engine(path, disable_overlap_schedule=False)
    reqs = [on.make_request(p, GREEDY) for p in PROMPTS[:4]]
    for r in reqs:
        on.scheduler.add_request(r)
    for _ in range(4):
        on.scheduler.step()
    on.abort(reqs[2].rid)
    while on.scheduler.has_work():
        on.scheduler.step()
    assert reqs[2].finish_reason == "abort"
    assert all(r.finish_reason == "length" for i, r in enumerate(reqs) if i != 2)
    assert_no_leaks(on)
