"""The serving path's batching: the stream interval (EngineConfig.stream_interval), the compact wire
form of UpdateBatch, and the merging of a request's queued updates in the HTTP process."""

from __future__ import annotations

import pathlib
import pickle

import pytest

from plait.config import EngineConfig
from plait.engine.core import LiveRequest, adaptive_stream_interval
from plait.engine.messages import (
    PlainRow,
    RequestUpdate,
    SchedulerSnapshot,
    UpdateBatch,
    coalesce_updates,
    merge_updates,
)
from plait.engine.scheduler_process import SchedulerProcess
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
    with pytest.raises(ValueError, match=r"stream_interval must be >= 1 output token \(or unset: adaptive\), got 0"):
        EngineConfig(model="m", stream_interval=0)


def test_the_adaptive_interval_is_one_token_up_to_64_live_requests_then_grows_to_at_most_eight():
    assert [adaptive_stream_interval(n) for n in (0, 1, 64, 65, 128, 129, 256, 512, 4096)] == [
        1, 1, 1, 2, 2, 3, 4, 8, 8]


def _rows_per_step(model: pathlib.Path, tmp_path: pathlib.Path, streams: int, steps: int,
                   stream_interval: int | None) -> list[list[int]]:
    """A scheduler process's ``_collect`` over ``streams`` live streaming requests that each get one token
    per step (appended as the scheduler's step does): per step, the token counts of the rows it reports."""
    proc = SchedulerProcess(EngineConfig(model=str(model), device="cpu", stream_interval=stream_interval),
                            [f"ipc://{tmp_path}/requests"], [f"ipc://{tmp_path}/outputs"], None)
    try:
        with make_engine(model) as engine:
            for _ in range(streams):
                req = engine.make_request(PROMPT, {**PARAMS, "max_new_tokens": 100})
                proc.live[req.rid] = LiveRequest(req)
            per_step = []
            for s in range(steps):
                for live in proc.live.values():
                    live.req.output_ids.append(7 + s)
                    live.req.detokenizer.add_token(7 + s)
                rows: list[PlainRow] = []
                assert proc._collect(rows) == []  # nothing finished, nothing but plain rows
                per_step.append([len(row[1]) for row in rows])
    finally:
        proc.close()
    return per_step


def test_the_scheduler_process_streams_every_token_while_64_requests_are_live(one_layer, tmp_path):
    assert _rows_per_step(one_layer, tmp_path, 64, 3, None) == [[1] * 64] * 3


def test_the_scheduler_process_sends_every_second_token_to_65_live_requests(one_layer, tmp_path):
    # The first token at once, then two per update.
    assert _rows_per_step(one_layer, tmp_path, 65, 5, None) == [[1] * 65, [], [2] * 65, [], [2] * 65]


def test_a_fixed_stream_interval_holds_whatever_the_load(one_layer, tmp_path):
    assert _rows_per_step(one_layer, tmp_path, 65, 3, 1) == [[1] * 65] * 3


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
