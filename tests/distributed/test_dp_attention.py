"""DP attention with dp_size = tp_size = 2, real processes over gloo: each rank schedules its own
requests, attention runs per rank, the MLP is sharded over both. Greedy outputs must equal a single
rank's, whatever the split of requests, phases and idle ranks."""

from __future__ import annotations

import os
import signal

import pytest

from plait.forward_batch import DPPaddingMode
from plait.parallel.ranks import TensorParallelError
from tests.helpers import make_engine, prompt_ids, single_rank_outputs

GREEDY12 = {"temperature": 0.0, "max_new_tokens": 12}
PROMPTS32 = prompt_ids(16, seed=1) + prompt_ids(16, seed=2)


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    """Greedy outputs of one rank (no DP) for every prompt used below."""
    return single_rank_outputs(model, PROMPTS32, GREEDY12)


@pytest.fixture(scope="module")
def dp_engine(model):
    # One spawned rank serves every test of this module (each test reads only what it caused).
    engine = make_engine(model, tp_size=2, dp_size=2, enable_dp_attention=True, dist_timeout=60)
    yield engine
    engine.shutdown()


def _generate(engine, prompts, params=GREEDY12) -> list[list[int]]:
    return [o.token_ids for o in engine.generate(prompts, params)]


def _new_rounds(engine, before: int) -> list:
    return list(engine.runner.rounds)[before:]


def test_32_requests_over_both_ranks_match_a_single_rank(dp_engine, reference):
    assigned = dict(dp_engine.scheduler.assigned)
    out = _generate(dp_engine, PROMPTS32)
    assert out == [reference[tuple(p)] for p in PROMPTS32]
    spread = {r: dp_engine.scheduler.assigned[r] - assigned.get(r, 0) for r in (0, 1)}
    assert spread == {0: 16, 1: 16}  # shortest queue alternates between equally loaded ranks


def test_rank_1_idle_while_rank_0_works(dp_engine, reference):
    before = len(dp_engine.runner.rounds)
    assert _generate(dp_engine, PROMPTS32[:1]) == [reference[tuple(PROMPTS32[0])]]
    rounds = _new_rounds(dp_engine, before)
    assert rounds and all(counts[0] > 0 and counts[1] == 0 for counts, _, _ in rounds)


def test_rank_0_idle_while_rank_1_works(dp_engine, reference):
    """Rank 0 gets a one-token request (it finishes at once); rank 1 then decodes alone, and rank 0
    joins every round with an IDLE batch."""
    idle_before, before = dp_engine.runner.idle_rounds, len(dp_engine.runner.rounds)
    short, long = dp_engine.generate(PROMPTS32[:2], [{"temperature": 0.0, "max_new_tokens": 1}, GREEDY12])
    assert long.token_ids == reference[tuple(PROMPTS32[1])]
    assert short.token_ids == reference[tuple(PROMPTS32[0])][:1]
    rounds = _new_rounds(dp_engine, before)
    assert sum(1 for counts, _, _ in rounds if counts[0] == 0 and counts[1] > 0) >= 10
    assert dp_engine.runner.idle_rounds - idle_before >= 10


def test_one_rank_prefills_while_the_other_decodes(dp_engine, reference):
    """Uneven phases: rank 0 decodes while rank 1 prefills (SUM_LEN), then both decode."""
    sched = dp_engine.scheduler
    before = len(dp_engine.runner.rounds)
    first = dp_engine.make_request(PROMPTS32[4], GREEDY12)
    sched.add_request(first)  # both queues empty: rank 0
    for _ in range(3):
        sched.step()
    assert first.output_ids and not first.finished
    second = dp_engine.make_request(PROMPTS32[6], GREEDY12)
    sched.add_request(second)  # rank 0 has one live request: rank 1
    while not (first.finished and second.finished):
        sched.step()
    assert first.output_ids == reference[tuple(PROMPTS32[4])]
    assert second.output_ids == reference[tuple(PROMPTS32[6])]
    rounds = _new_rounds(dp_engine, before)
    mixed = [(c, m) for c, ext, m in rounds if ext == (False, True) and c[0] > 0]
    assert mixed and all(m == DPPaddingMode.SUM_LEN for _, m in mixed)
    assert any(ext == (False, False) and m == DPPaddingMode.MAX_LEN for _, ext, m in rounds)


def test_abort_of_a_request_on_another_rank(dp_engine):
    sched = dp_engine.scheduler
    reqs = [dp_engine.make_request(p, {"temperature": 0.0, "max_new_tokens": 200, "ignore_eos": True})
            for p in PROMPTS32[:2]]
    for r in reqs:
        sched.add_request(r)
    assert sched.loads() == [1, 1]
    sched.step()
    assert dp_engine.abort(reqs[1].rid)  # served by rank 1
    while not reqs[1].finished:
        sched.step()
    assert reqs[1].finish_reason.value == "abort"
    dp_engine.abort(reqs[0].rid)
    while sched.has_work():
        sched.step()
    assert sched.loads() == [0, 0]


def test_killed_rank_ends_the_dp_engine_with_an_error(model):
    engine = make_engine(model, tp_size=2, dp_size=2, enable_dp_attention=True, dist_timeout=10)
    try:
        (proc,) = engine.runner.procs.values()
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(5)
        with pytest.raises(TensorParallelError, match=r"tp rank 1 .* exited with code -9"):
            _generate(engine, PROMPTS32[:2])
    finally:
        engine.shutdown()


def test_prompt_logprobs_and_logit_bias_of_requests_on_either_rank(dp_engine, model):
    """A request served by rank 1 reports its prompt logprobs through rank 0's stand-in; logit_bias
    applies on the rank that samples."""
    prompts = PROMPTS32[4:6]
    params = {**GREEDY12, "max_new_tokens": 3, "logprobs": True, "logprob_start_len": 1,
              "logit_bias": {"9": 100}, "ignore_eos": True}
    with make_engine(model) as single:
        ref = single.generate(prompts, params)
    assigned = dict(dp_engine.scheduler.assigned)
    out = dp_engine.generate(prompts, params)
    assert {r: dp_engine.scheduler.assigned[r] - assigned.get(r, 0) for r in (0, 1)} == {0: 1, 1: 1}
    for o, r, p in zip(out, ref, prompts, strict=True):
        assert o.token_ids == [9, 9, 9]
        got, want = o.meta_info["input_token_logprobs"], r.meta_info["input_token_logprobs"]
        assert [tid for _, tid, _ in got] == p[1:]
        assert [lp for lp, _, _ in got] == pytest.approx([lp for lp, _, _ in want], abs=1e-4)


CONSTRAINED = [{"regex": r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)"},
               {"json_schema": {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0,
                                                                       "maximum": 999}},
                                "required": ["id"], "additionalProperties": False}}]


def test_constrained_requests_on_either_rank_equal_one_rank(dp_engine, model):
    """Each rank compiles and applies the grammars of the requests it schedules: constrained greedy
    output under DP attention is one rank's, on both ranks, beside unconstrained requests."""
    prompts = PROMPTS32[8:12]
    params = [{**GREEDY12, "max_new_tokens": 24, **CONSTRAINED[i % 2]} if i < 2 else GREEDY12
              for i in range(len(prompts))]
    with make_engine(model) as single:
        ref = single.generate(prompts, params)
    assigned = dict(dp_engine.scheduler.assigned)
    out = dp_engine.generate(prompts, params)
    assert {r: dp_engine.scheduler.assigned[r] - assigned.get(r, 0) for r in (0, 1)} == {0: 2, 1: 2}
    assert [o.token_ids for o in out] == [r.token_ids for r in ref]
    # Before, a constrained request under DP attention was aborted with a message.
    assert [o.finish_reason for o in out[:2]] == [r.finish_reason for r in ref[:2]]
    assert all("abort" not in str(o.finish_reason) for o in out)
