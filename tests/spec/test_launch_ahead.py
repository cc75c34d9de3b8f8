"""Verifies launched ahead (BaseSpecWorker.launch_ahead): inside a chain of greedy NGRAM verifies that
replay verify graphs, the next verify is queued before the current one's result is read, its tokens
and positions chosen on the device. Greedy output stays plait's non-speculative greedy output, a
guessed bonus that misses costs only acceptance, a stop token drops the rows launched ahead, and no
KV slot outlives its request. The graphs are the EagerGraph stand-in (replay re-runs the recorded
function over the static buffers) on the Triton backend under the interpreter, 1-layer model."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from plait.forward_batch import ForwardMode  # noqa: E402
from plait.speculative.verify_batch import chain_verify_batch_after  # noqa: E402
from tests.helpers import assert_no_leaks  # noqa: E402
from tests.spec.chain_cases import GREEDY, PROMPTS, chain_engine  # noqa: E402


@pytest.fixture
def reference(chain_reference):
    return chain_reference


@pytest.fixture(autouse=True)
def _launch_ahead_on(monkeypatch):
    monkeypatch.setenv("PLAIT_SPEC_LAUNCH_AHEAD", "1")


def test_device_picks_the_bonus_and_the_drafts_of_the_outcome_that_arrived():
    # Two requests, chains 3 wide: the first accepts both drafts, the second none.
    greedy = torch.tensor([[7, 8, 9], [5, 6, 1]])
    guesses = torch.tensor([[7, 8], [4, 6]])
    next_drafts = torch.arange(2 * 3 * 2).view(2, 3, 2) + 100  # [request, accepted, draft]
    fb = chain_verify_batch_after(greedy, guesses, next_drafts, torch.tensor([10, 20]), [10, 20],
                                  torch.tensor([3, 4]), torch.arange(6) + 50)
    assert fb.forward_mode == ForwardMode.TARGET_VERIFY and fb.lens_on_device
    # Request 0: a = 2, bonus 9 (the argmax after node 2), drafts for a = 2; request 1: a = 0, bonus 5.
    assert fb.input_ids.tolist() == [9, 104, 105, 5, 106, 107]
    assert fb.positions.tolist() == [13, 14, 15, 21, 22, 23]
    assert fb.extend.prefix_lens.tolist() == [13, 21] and fb.seq_lens.tolist() == [16, 24]
    assert fb.spec_info.custom_mask is None and fb.spec_info.num_tokens_per_req == [3, 3]


@pytest.mark.parametrize("bs", [1, 3])
def test_verifies_launched_ahead_keep_greedy_output_unchanged(one_layer, reference, bs):
    engine = chain_engine(one_layer, bs, reference)
    worker = engine.scheduler.spec_worker
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert worker.stats.launched_ahead > 0
    assert_no_leaks(engine)


def test_a_batch_of_chains_of_mixed_widths_launches_ahead_at_its_padded_width(one_layer, reference, monkeypatch):
    """A request whose acceptance average asks for a shorter chain than the others' rides in the batch
    padded to the widest; the verify launched ahead gives it a chain that wide, and output is unchanged."""
    engine = chain_engine(one_layer, 3, reference)
    worker = engine.scheduler.spec_worker
    max_depth, depth_limit = worker._max_depth, worker._depth_limit

    def shallow(req, depth):  # the second request's drafts are one token deep when the host drafts
        return min(depth, 1) if depth is not None and req.origin_input_ids == PROMPTS[1] else depth

    monkeypatch.setattr(worker, "_max_depth", lambda req: shallow(req, max_depth(req)))
    monkeypatch.setattr(worker, "_depth_limit", lambda req, gained: shallow(req, depth_limit(req, gained)))
    launches = []
    ahead = worker.launch_ahead

    def spy(sched, step):
        launched = ahead(sched, step)
        launches.append((sorted(t.width for t in step.trees), launched is not None))
        return launched

    monkeypatch.setattr(worker, "launch_ahead", spy)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert ([2, 4, 4], True) in launches  # launched ahead from a mixed batch, which gave the short chain
    assert launches[launches.index(([2, 4, 4], True)) + 1][0] == [4, 4, 4]  # the batch's full width
    assert_no_leaks(engine)


def test_ahead_drafts_top_up_a_short_proposal_and_fill_outcomes_past_a_short_chain(one_layer):
    from plait.speculative.ngram import PreparedDrafts
    from plait.speculative.tree import DraftTree

    engine = chain_engine(one_layer, 1)
    worker = engine.scheduler.spec_worker
    req = engine.make_request([5, 6, 7], GREEDY)
    tree = DraftTree.chain(7, [8])  # 2 wide, in a batch padded to 4
    proposals = {(9,): DraftTree.chain(9, [10]), (8, 11): DraftTree.chain(11, [12, 13, 14])}
    worker.prepared[req.rid] = PreparedDrafts(req.fill_len, worker.drafter.cache.version, proposals)
    # Outcome 0 (no draft accepted, bonus 9): its one-draft proposal topped up with filler (the chain's
    # last token); outcome 1: the first three drafts; outcomes 2 and 3, past the chain: filler.
    assert worker.ahead_drafts([req], [tree], 4) == [[[10, 8, 8], [12, 13, 14], [8, 8, 8], [8, 8, 8]]]


def test_drafts_launched_ahead_that_miss_cost_acceptance_not_output(one_layer, reference, monkeypatch):
    """Whatever the drafts prepared for an outcome (those for a bonus guess that missed), the verify
    launched ahead with them accepts only what the model agrees with."""
    engine = chain_engine(one_layer, 1, reference)
    worker = engine.scheduler.spec_worker
    prepared = worker.ahead_drafts

    def wrong(reqs, trees, width):
        drafts = prepared(reqs, trees, width)
        return None if drafts is None else [[[(t + 1) % 400 + 4 for t in d] for d in per] for per in drafts]

    monkeypatch.setattr(worker, "ahead_drafts", wrong)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert worker.stats.launched_ahead > 0 and worker.stats.accept_histogram[0] > 0
    assert_no_leaks(engine)


def test_a_stop_token_drops_the_rows_of_the_verify_launched_ahead(one_layer, reference):
    engine = chain_engine(one_layer, 3, reference)
    worker = engine.scheduler.spec_worker
    stop = reference[0][12]
    params = [{**GREEDY, "stop_token_ids": [stop]}, GREEDY, GREEDY]
    outs = engine.generate(PROMPTS, params)
    assert outs[0].token_ids == reference[0][: reference[0].index(stop) + 1]
    assert [o.token_ids for o in outs[1:]] == reference[1:]
    assert worker.stats.launched_ahead > 0
    assert_no_leaks(engine)


def test_with_the_switch_off_no_verify_launches_ahead(one_layer, reference, monkeypatch):
    monkeypatch.setenv("PLAIT_SPEC_LAUNCH_AHEAD", "0")
    engine = chain_engine(one_layer, 1, reference)
    worker = engine.scheduler.spec_worker
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert not worker.launches_ahead and worker.stats.launched_ahead == 0


def test_a_batch_off_its_run_of_whole_chains_accepted_waits_for_the_host(one_layer, reference):
    """When fewer than half the requests accepted their whole chain last time (at bs 1: the model left
    the drafted text), the host reads the outcome before the next launch and may end the chain."""
    engine = chain_engine(one_layer, 1, reference)
    worker = engine.scheduler.spec_worker
    calls = []
    inner = worker.launch_ahead

    def spy(sched, step):
        whole = [worker.accepted_all.get(r.rid, False) for r in step.reqs]
        launched = inner(sched, step)
        calls.append((whole, launched is not None))
        return launched

    worker.launch_ahead = spy
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert any(launched for _, launched in calls)
    assert any(not all(whole) for whole, _ in calls)  # a request's first verify has no run yet
    assert not any(launched for whole, launched in calls if not all(whole))
