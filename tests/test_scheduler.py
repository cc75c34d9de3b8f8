"""Scheduler behaviour: chunked prefill, prefix-cache hits, retraction, batching invariance, leaks.

Every test compares against transformers' greedy output (or plait's own unbatched output) so that a
scheduling path that computes something else fails."""

from __future__ import annotations

import pytest

from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

ARCH = "llama"
PROMPTS = prompt_ids(8)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir(ARCH)


@pytest.fixture(scope="module")
def reference_tokens(model_path, hf_reference):
    return [hf_reference(model_path, p, 32).tokens for p in PROMPTS]


def test_tiny_token_budget_chunks_prefill_and_keeps_outputs(model_path, reference_tokens):
    engine = make_engine(model_path, chunked_prefill_size=4)
    steps_before = engine.scheduler.stats.forward_steps
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_tokens
    # The longest prompt (31 tokens) alone needs 8 chunks of 4.
    assert engine.scheduler.stats.forward_steps - steps_before > 32 + 8
    assert_no_leaks(engine)


def test_repeated_prompts_hit_the_prefix_cache(model_path, reference_tokens):
    engine = make_engine(model_path)
    engine.generate(PROMPTS, GREEDY)
    again = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == reference_tokens
    assert all(o.meta_info["cached_tokens"] > 0 for o in again)
    assert_no_leaks(engine)


def test_a_prefill_of_only_the_last_prompt_token_runs_as_a_decode_step(model_path, reference_tokens):
    """Whole-prompt prefix hits leave one token to prefill: the batch is a DECODE (graph-replayable)."""
    engine = make_engine(model_path)
    engine.generate(PROMPTS, GREEDY)
    modes: list[str] = []
    forward = engine.runner.forward
    engine.runner.forward = lambda fb, *a, **kw: modes.append(fb.forward_mode.name) or forward(fb, *a, **kw)
    again = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == reference_tokens
    assert all(o.meta_info["cached_tokens"] == len(p) - 1 for o, p in zip(again, PROMPTS, strict=True))
    assert set(modes) == {"DECODE"}
    assert_no_leaks(engine)


def test_shared_prefix_is_reused_across_requests(model_path, hf_reference):
    system = PROMPTS[6]  # 31 tokens of shared prefix
    prompts = [system + tail for tail in ([7, 8, 9], [10, 11], [12, 13, 14, 15])]
    refs = [hf_reference(model_path, p, 32).tokens for p in prompts]
    engine = make_engine(model_path)
    first = engine.generate(prompts[0], GREEDY)
    rest = engine.generate(prompts[1:], GREEDY)
    assert [first.token_ids] + [o.token_ids for o in rest] == refs
    assert all(o.meta_info["cached_tokens"] >= len(system) for o in rest)
    assert_no_leaks(engine)


def test_small_kv_pool_forces_retraction_and_outputs_are_unchanged(model_path, reference_tokens):
    # 8 requests need up to 8 * (31 + 32) tokens; 200 slots cannot hold them all at once.
    engine = make_engine(model_path, max_total_tokens=200, disable_radix_cache=True)
    outs = engine.generate(PROMPTS, GREEDY)
    assert engine.scheduler.stats.num_retractions >= 1
    assert [o.token_ids for o in outs] == reference_tokens
    assert sum(o.meta_info["num_retractions"] for o in outs) >= 1
    assert_no_leaks(engine)


def test_retraction_with_prefix_cache_keeps_outputs(model_path, reference_tokens):
    engine = make_engine(model_path, max_total_tokens=200)
    outs = engine.generate(PROMPTS, GREEDY)
    assert engine.scheduler.stats.num_retractions >= 1
    assert [o.token_ids for o in outs] == reference_tokens
    assert_no_leaks(engine)


def test_request_alone_equals_request_inside_batch_of_16(model_path):
    prompts = prompt_ids(16, seed=3)
    engine = make_engine(model_path)
    batched = engine.generate(prompts, GREEDY)
    fresh = make_engine(model_path)
    alone = fresh.generate(prompts[5], GREEDY)
    assert alone.token_ids == batched[5].token_ids
    assert_no_leaks(engine)


def test_max_running_requests_caps_the_batch(model_path, reference_tokens):
    engine = make_engine(model_path, max_running_requests=2)
    peak = 0
    original_step = engine.scheduler.step

    def step():
        nonlocal peak
        out = original_step()
        peak = max(peak, engine.scheduler.num_running())
        return out

    engine.scheduler.step = step
    outs = engine.generate(PROMPTS, GREEDY)
    assert peak == 2
    assert [o.token_ids for o in outs] == reference_tokens
    assert_no_leaks(engine)


def test_abort_of_a_running_request_frees_it_and_others_finish(model_path, reference_tokens):
    engine = make_engine(model_path)
    reqs = [engine.make_request(p, GREEDY) for p in PROMPTS[:3]]
    for r in reqs:
        engine.scheduler.add_request(r)
    for _ in range(5):
        engine.scheduler.step()
    assert engine.abort(reqs[1].rid)
    while engine.scheduler.has_work():
        engine.scheduler.step()
    assert reqs[1].finish_reason == "abort"
    assert len(reqs[1].output_ids) < 32
    assert reqs[0].output_ids == reference_tokens[0]
    assert reqs[2].output_ids == reference_tokens[2]
    assert_no_leaks(engine)


def test_abort_of_a_waiting_request_finishes_it_at_once(model_path):
    engine = make_engine(model_path)
    req = engine.make_request(PROMPTS[0], GREEDY)
    engine.scheduler.add_request(req)
    assert engine.abort(req.rid)
    assert req.finish_reason == "abort"
    assert req.output_ids == []
    assert not engine.scheduler.has_work()


def test_abort_of_unknown_request_returns_false(model_path):
    engine = make_engine(model_path)
    assert engine.abort("no-such-request") is False


def test_admission_stops_where_the_reserved_kv_would_exceed_the_free_pool(model_path):
    """Each admitted request reserves its prompt and its expected new tokens; one admission pass
    takes waiting requests in order until the next would not fit, and those it took fit."""
    engine = make_engine(model_path, max_total_tokens=512, disable_radix_cache=True)
    sched = engine.scheduler
    params = {**GREEDY, "max_new_tokens": 200}
    for p in PROMPTS:
        sched.add_request(engine.make_request(p, params))
    sched.admit()
    admitted, waiting = len(sched.prefilling), len(sched.waiting)
    ratio = sched.new_token_ratio
    reserved = sum(r.fill_len - r.kv_len + (200 - r.num_generated) * ratio for r in sched.prefilling)
    available = sched.available_kv_tokens()
    assert 0 < admitted < len(PROMPTS)
    assert reserved <= available
    nxt = sched.waiting[0]
    assert reserved + len(nxt.fill_ids) + 200 * ratio > available
    sched.admit()  # nothing changed: the same request still does not fit
    assert (len(sched.prefilling), len(sched.waiting)) == (admitted, waiting)
    while sched.has_work():
        sched.step()
    assert_no_leaks(engine)


def test_decode_rows_count_each_request_a_plain_forward_decoded(model_path):
    """Every token after a request's first (which its prefill gives) is one decode row."""
    engine = make_engine(model_path)
    before = engine.scheduler.stats.decode_rows
    outs = engine.generate(PROMPTS[:3], {"temperature": 0.0, "max_new_tokens": 6, "ignore_eos": True})
    assert [len(o.token_ids) for o in outs] == [6, 6, 6]
    assert engine.scheduler.stats.decode_rows - before == 3 * 5
