"""The scheduler process's hot path: plain updates appended as rows (``LiveRequest.take_update_into``,
``UpdateBatch.rows``) arrive on the other side of the wire as the same updates ``take_update``
gives, after the batch's objects; rich ones (logprobs, the finish) stay objects."""

from __future__ import annotations

import pickle

import pytest

from plait.engine.core import LiveRequest
from plait.engine.messages import RequestUpdate, SchedulerSnapshot, UpdateBatch
from tests.helpers import make_engine

GREEDY = {"max_new_tokens": 5, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    with make_engine(tiny_model_dir("llama")) as e:
        yield e


def _run(engine, params: dict, into: bool) -> list[RequestUpdate]:
    """Step one request to its end, taking its updates each step; with ``into``, through rows and
    the wire, as the scheduler process sends them."""
    engine.scheduler.tree_cache.reset()  # both runs start uncached (cached_tokens equal)
    live = LiveRequest(engine.make_request([1, 2, 3], params, rid="r"))
    engine.scheduler.add_request(live.req)
    updates: list[RequestUpdate] = []
    while not updates or not updates[-1].finished:
        if not live.req.finished:
            engine.scheduler.step()
        if into:
            rows: list = []
            rich = live.take_update_into(rows, 1)
            batch = UpdateBatch([rich] if rich else [], SchedulerSnapshot(), rows)
            updates += pickle.loads(pickle.dumps(batch)).updates
        elif (update := live.take_update()) is not None:
            updates.append(update)
    engine.scheduler.flush()
    return updates


@pytest.mark.parametrize("params", [GREEDY, {**GREEDY, "logprobs": True, "top_logprobs": 2}],
                         ids=["plain", "logprobs"])
def test_rows_give_the_same_updates_as_take_update(engine, params):
    assert _run(engine, params, into=True) == _run(engine, params, into=False)


def test_a_running_request_without_logprobs_goes_to_rows_and_its_finish_is_an_object(engine):
    live = LiveRequest(engine.make_request([1, 2, 3], {**GREEDY, "max_new_tokens": 3}))
    engine.scheduler.add_request(live.req)
    while not live.req.output_ids:
        engine.scheduler.step()
    rows: list = []
    assert live.take_update_into(rows, 1) is None and len(rows) == 1
    rid, token_ids, text, prompt, completion, cached = rows[0]
    assert (rid, token_ids, prompt, completion) == (live.req.rid, live.req.output_ids, 3, len(token_ids))
    assert not live.req.finished
    while not live.req.finished:
        engine.scheduler.step()
    final = live.take_update_into(rows, 1)
    assert final is not None and final.finish_reason == "length" and len(rows) == 1
    engine.scheduler.flush()


def test_rows_follow_the_batch_objects_on_the_wire():
    ack = RequestUpdate("a", prompt_tokens=4)
    done = RequestUpdate("b", [9], "z", finish_reason="stop", completion_tokens=3)
    rows = [("a", [5], " x", 4, 1, 0), ("c", [6], " y", 2, 7, 1)]
    back = pickle.loads(pickle.dumps(UpdateBatch([ack, done], SchedulerSnapshot(num_running=2), rows)))
    assert back.rows == [] and back.stats == SchedulerSnapshot(num_running=2)
    assert back.updates == [ack, done, RequestUpdate("a", [5], " x", prompt_tokens=4, completion_tokens=1),
                            RequestUpdate("c", [6], " y", prompt_tokens=2, completion_tokens=7, cached_tokens=1)]
