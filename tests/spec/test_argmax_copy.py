"""Where acceptance reads only a verify's argmax (every request greedy and unconstrained), the argmax's
copy to the host starts at the verify's launch, ahead of the host work queued behind the forward (the
KV premap, the previous step's commit, the next verify's staging); a verify with a sampled or
constrained request reads more and starts none. EagerGraph stand-in on the Triton backend under the
interpreter, 1-layer model."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from plait.sampling import SamplingParams  # noqa: E402
from plait.scheduler.req import Req  # noqa: E402
from plait.speculative.worker import VerifyStep, reads_argmax_only  # noqa: E402
from tests.helpers import assert_no_leaks  # noqa: E402
from tests.spec.chain_cases import GREEDY, PROMPTS, chain_engine  # noqa: E402


def _record_steps(engine, monkeypatch) -> list[VerifyStep]:
    """Every verify step the worker reads, as ``accept_step`` receives it (the method still runs)."""
    worker, steps = engine.scheduler.spec_worker, []
    accept_step = worker.accept_step

    def recorded(step: VerifyStep):
        steps.append(step)
        return accept_step(step)

    monkeypatch.setattr(worker, "accept_step", recorded)
    return steps


def test_a_greedy_chain_starts_its_argmax_copy_at_each_launch(one_layer, chain_reference, monkeypatch):
    engine = chain_engine(one_layer, 1, chain_reference)
    steps = _record_steps(engine, monkeypatch)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == chain_reference
    assert steps and all(s.greedy_host is not None for s in steps)
    assert_no_leaks(engine)


def test_a_verify_with_a_sampled_request_starts_no_argmax_copy(one_layer, chain_reference, monkeypatch):
    engine = chain_engine(one_layer, 1, chain_reference)
    steps = _record_steps(engine, monkeypatch)
    # Sampled by the sampler's rule, yet as sure as the argmax: its text follows the drafter's cache, so
    # it verifies drafts.
    engine.generate(PROMPTS[:1], {**GREEDY, "temperature": 0.01, "seed": 5})
    assert steps and all(s.greedy_host is None for s in steps)
    assert_no_leaks(engine)


def test_a_constrained_request_is_not_read_by_its_argmax_alone():
    req = Req("r", [1, 2, 3], SamplingParams(temperature=0.0), seed=0, detokenizer=None)
    assert reads_argmax_only(req)
    req.grammar = object()  # type: ignore[assignment]  # any matcher: its rows are masked before the argmax
    assert not reads_argmax_only(req)
