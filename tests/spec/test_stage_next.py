"""Verifies staged for their guessed outcome (BaseSpecWorker.stage_guess, PLAIT_SPEC_STAGE_NEXT): inside
a chain of greedy NGRAM verifies that replay verify graphs, the next verify is built and staged while
the current one runs, for the outcome where every draft is accepted and the bonus is the drafter's
guess, and launched as staged when that outcome arrives. Staging changes when the host does the work,
never what is verified: greedy output, the accept histogram and the verify count are those without
it, a wrong guess is dropped with its slots, and no KV slot outlives its request. EagerGraph stand-in
on the Triton backend under the interpreter, 1-layer model."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from tests.helpers import assert_no_leaks  # noqa: E402
from tests.spec.chain_cases import GREEDY, PROMPTS, chain_engine  # noqa: E402


@pytest.fixture
def reference(chain_reference):
    return chain_reference


def _run(one_layer, reference, monkeypatch, stage: bool, bs: int = 1, wrong_guess: bool = False):
    """(outputs, worker) of one generate with the drafter's cache holding the reference (``bs`` requests
    at once: each batch size's verify graphs are captured under the interpreter, so 1 unless it matters)."""
    monkeypatch.setenv("PLAIT_SPEC_STAGE_NEXT", "1" if stage else "0")
    engine = chain_engine(one_layer, bs, reference)
    worker = engine.scheduler.spec_worker
    if wrong_guess:
        guess = worker.guessed_bonus
        monkeypatch.setattr(worker, "guessed_bonus",
                            lambda req, tree: None if guess(req, tree) is None else guess(req, tree) + 1)
    outs = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert_no_leaks(engine)
    return outs, worker


@pytest.mark.parametrize("bs", [1, 3])
def test_staged_verifies_keep_greedy_output_and_launch_when_their_guess_arrives(one_layer, reference, monkeypatch,
                                                                                  bs):
    outs, worker = _run(one_layer, reference, monkeypatch, stage=True, bs=bs)
    assert outs == reference
    assert worker.stats.staged["hit"] > 0


def test_staging_verifies_what_the_chain_verifies_without_it(one_layer, reference, monkeypatch):
    staged, plain = (_run(one_layer, reference, monkeypatch, stage=stage)[1].stats for stage in (True, False))
    assert staged.accept_histogram == plain.accept_histogram
    assert staged.verify_steps == plain.verify_steps
    assert not plain.staged


def test_a_wrong_guess_is_dropped_with_its_slots(one_layer, reference, monkeypatch):
    outs, worker = _run(one_layer, reference, monkeypatch, stage=True, wrong_guess=True)
    assert outs == reference
    assert worker.stats.staged["miss"] > 0 and worker.stats.staged["hit"] == 0


def test_a_missed_guess_leaves_the_drafters_bookkeeping_as_without_staging(one_layer, reference, monkeypatch):
    missed = _run(one_layer, reference, monkeypatch, stage=True, wrong_guess=True)[1]
    plain = _run(one_layer, reference, monkeypatch, stage=False)[1]
    assert missed.predraft_stats == plain.predraft_stats
    assert missed.stats.accept_histogram == plain.stats.accept_histogram
