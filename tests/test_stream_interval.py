"""The serving path's batching: the stream interval (EngineConfig.stream_interval), the compact wire
form of UpdateBatch, and the merging of a request's queued updates in the HTTP process."""

from __future__ import annotations

import pickle

import pytest

from plait.config import EngineConfig
from plait.engine.messages import RequestUpdate, SchedulerSnapshot, UpdateBatch, coalesce_updates, merge_updates
from tests.helpers import make_engine

PROMPT = [5, 17, 99, 240, 31]
PARAMS = {"max_new_tokens": 11, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture(scope="module")
def fourth(one_layer):
    engine = make_engine(one_layer, stream_interval=4)
    yield engine
    engine.shutdown()


def test_stream_interval_reports_the_first_token_then_every_n_and_always_the_end(fourth):
    chunks = list(fourth.generate_stream(PROMPT, PARAMS))
    # 11 tokens: the first at once, then 4 + 4, then the last 2 with the finish.
    assert [len(c.delta_token_ids) for c in chunks] == [1, 4, 4, 2]
    assert [c.finish_reason for c in chunks] == [None, None, None, "length"]


def test_stream_interval_streams_the_tokens_and_text_of_the_whole_output(fourth):
    whole = fourth.generate(PROMPT, PARAMS)
    four = list(fourth.generate_stream(PROMPT, PARAMS))
    assert len(four) == 4
    assert [t for c in four for t in c.delta_token_ids] == whole.token_ids
    assert "".join(c.delta_text for c in four) == whole.text == four[-1].text


def test_stream_interval_below_one_is_refused_naming_the_field():
    with pytest.raises(ValueError, match="stream_interval must be >= 1 output token, got 0"):
        EngineConfig(model="m", stream_interval=0)


def _mixed_updates() -> list[RequestUpdate]:
    plain = [RequestUpdate(f"r{i}", [100 + i], f" t{i}", prompt_tokens=9, completion_tokens=3, cached_tokens=i)
             for i in range(6)]
    return [RequestUpdate("ack", prompt_tokens=4), *plain[:2],
            RequestUpdate("lp", [7, 8], "ab", logprobs=[-0.5, -1.0], top_logprobs=[[(7, -0.5)], [(8, -1.0)]],
                          input_logprobs=[None, -2.0], input_top_logprobs=[None, [(3, -2.0)]]),
            *plain[2:4],
            RequestUpdate("done", [9], "c", finish_reason="stop", finish_message=None, matched_stop=9,
                          completion_tokens=5),
            RequestUpdate("bad", error="the request queue is full", error_status=503),
            *plain[4:]]


def test_update_batch_survives_the_wire_with_every_update_in_its_place():
    batch = UpdateBatch(_mixed_updates(), SchedulerSnapshot(num_running=6, kv_slots_in_use=40))
    back = pickle.loads(pickle.dumps(batch))
    assert back == batch
    assert [u.rid for u in back.updates] == [u.rid for u in batch.updates]


def test_update_batch_sends_plain_updates_as_columns_smaller_than_objects():
    updates = [RequestUpdate(f"{i:032x}-0", [1000 + i], " word", prompt_tokens=512, completion_tokens=7)
               for i in range(64)]
    compact = len(pickle.dumps(UpdateBatch(updates, SchedulerSnapshot())))
    objects = len(pickle.dumps(updates))
    assert compact < 0.7 * objects


def test_merged_updates_concatenate_outputs_and_take_the_later_counts_and_finish():
    a = RequestUpdate("r", [1], "x", logprobs=[-0.1], prompt_tokens=3, completion_tokens=1)
    b = RequestUpdate("r", [2, 3], "yz", logprobs=[-0.2, -0.3], finish_reason="length", completion_tokens=3)
    m = merge_updates(a, b)
    assert (m.token_ids, m.text, m.logprobs) == ([1, 2, 3], "xyz", [-0.1, -0.2, -0.3])
    assert (m.finish_reason, m.completion_tokens, m.prompt_tokens) == ("length", 3, 3)
    assert m.top_logprobs is None and m.input_logprobs is None


def test_coalescing_merges_each_requests_queued_updates_in_arrival_order():
    q = [RequestUpdate("a", [1], "1"), RequestUpdate("b", [5], "5"), RequestUpdate("a", [2], "2"),
         RequestUpdate("a", [3], "3", finish_reason="length"), RequestUpdate("b", [6], "6")]
    out = coalesce_updates(q)
    assert [(u.rid, u.token_ids, u.text, u.finish_reason) for u in out] == [
        ("a", [1, 2, 3], "123", "length"), ("b", [5, 6], "56", None)]


def test_coalescing_never_merges_into_an_error_or_past_a_finish():
    err = RequestUpdate("a", error="aborted", error_status=499)
    q = [RequestUpdate("a", [1], "1"), err, RequestUpdate("c", [4], "4", finish_reason="stop"),
         RequestUpdate("c", [5], "5")]
    out = coalesce_updates(q)
    assert out == [q[0], err, q[2], q[3]]
