"""A stream whose HTTP process fell behind the scheduler: the tokens that queued up for a request go
out as one server-sent event, and what the client assembles is exactly the non-streamed answer.

The backlog is forced for real: right after the response headers the HTTP process is stopped
(SIGSTOP) while its scheduler process keeps generating, then resumed; every update that arrived
meanwhile is read before any stream writes, so each stream sends them merged."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from tests.server.test_server_api import GREEDY, MESSAGES, token_ids

# Long enough for the tiny model to generate most of MAX_TOKENS on a busy machine.
PAUSE_S = 0.4
MAX_TOKENS = 32
PROMPT = "Once upon a time"


@contextlib.contextmanager
def stopped(pid: int, seconds: float) -> Iterator[None]:
    os.kill(pid, signal.SIGSTOP)
    try:
        time.sleep(seconds)
    finally:
        os.kill(pid, signal.SIGCONT)
    yield


def with_backlog(server: Any, create: Callable[[], Any]) -> list[Any]:
    """The chunks of ``create()``'s stream, with the server stopped for PAUSE_S after its headers."""
    stream = create()  # returns once the status line and headers are in: the request was admitted
    with stopped(server.proc.pid, PAUSE_S):
        pass
    return list(stream)


def test_a_lagging_stream_sends_queued_tokens_as_one_event_with_the_same_text_and_ids(server, client, model_name):
    kwargs = {"model": model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, **GREEDY,
              "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    full = client.completions.create(**kwargs).choices[0]
    chunks = with_backlog(server, lambda: client.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    events = [c.choices[0] for c in chunks if c.choices]
    assert max(len(token_ids(e)) for e in events) > 1  # merged
    assert len(events) < MAX_TOKENS
    assert [t for e in events for t in token_ids(e)] == token_ids(full)
    assert "".join(e.text for e in events) == full.text
    assert [e.finish_reason for e in events] == [None] * (len(events) - 1) + ["length"]
    assert chunks[-1].usage.completion_tokens == MAX_TOKENS


def test_merged_completion_events_carry_every_tokens_logprobs_and_offsets(server, client, model_name):
    kwargs = {"model": model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "logprobs": 2, **GREEDY,
              "extra_body": {"ignore_eos": True}}
    full = client.completions.create(**kwargs).choices[0].logprobs
    events = [c.choices[0] for c in with_backlog(server, lambda: client.completions.create(**kwargs, stream=True))]
    assert max(len(e.logprobs.tokens) for e in events) > 1
    assert [t for e in events for t in e.logprobs.tokens] == full.tokens
    assert [v for e in events for v in e.logprobs.token_logprobs] == pytest.approx(full.token_logprobs, abs=1e-5)
    assert [sorted(d) for e in events for d in e.logprobs.top_logprobs] == [sorted(d) for d in full.top_logprobs]
    assert [o for e in events for o in e.logprobs.text_offset] == full.text_offset


def test_merged_events_of_n_choices_keep_each_choice_apart(server, client, model_name):
    kwargs = {"model": model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "n": 2, "temperature": 1.0,
              "seed": 7, "extra_body": {"ignore_eos": True, "return_token_ids": True}}
    full = sorted(client.completions.create(**kwargs).choices, key=lambda c: c.index)
    events = [c.choices[0] for c in with_backlog(server, lambda: client.completions.create(**kwargs, stream=True))]
    assert max(len(token_ids(e)) for e in events) > 1
    for i in (0, 1):
        mine = [e for e in events if e.index == i]
        assert [t for e in mine for t in token_ids(e)] == token_ids(full[i])
        assert "".join(e.text for e in mine) == full[i].text
        assert mine[-1].finish_reason == "length"


def test_a_stop_string_inside_merged_tokens_ends_the_stream_before_it(server, client, model_name):
    base = {"model": model_name, "prompt": PROMPT, "max_tokens": MAX_TOKENS, **GREEDY,
            "extra_body": {"ignore_eos": True}}
    text = client.completions.create(**base).choices[0].text
    stop = text[2 * len(text) // 3 : 2 * len(text) // 3 + 2]
    full = client.completions.create(**base, stop=[stop]).choices[0]
    events = [c.choices[0] for c in with_backlog(server, lambda: client.completions.create(
        **base, stop=[stop], stream=True))]
    assert full.finish_reason == "stop" and events[-1].finish_reason == "stop"
    assert "".join(e.text for e in events) == full.text == text[: text.index(stop)]


def test_merged_chat_deltas_give_the_same_message_logprobs_and_usage(server, client, model_name):
    kwargs = {"model": model_name, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "logprobs": True,
              "top_logprobs": 2, **GREEDY, "extra_body": {"ignore_eos": True}}
    full = client.chat.completions.create(**kwargs)
    chunks = with_backlog(server, lambda: client.chat.completions.create(
        **kwargs, stream=True, stream_options={"include_usage": True}))
    choices = [c.choices[0] for c in chunks if c.choices]
    assert choices[0].delta.role == "assistant"
    per_event = [len(c.logprobs.content) for c in choices if c.logprobs is not None]
    assert max(per_event) > 1 and sum(per_event) == MAX_TOKENS
    assert "".join(c.delta.content or "" for c in choices) == full.choices[0].message.content
    streamed = [(e.token, e.logprob) for c in choices if c.logprobs for e in c.logprobs.content]
    assert [t for t, _ in streamed] == [e.token for e in full.choices[0].logprobs.content]
    assert [v for _, v in streamed] == pytest.approx([e.logprob for e in full.choices[0].logprobs.content], abs=1e-5)
    assert [c.finish_reason for c in choices if c.finish_reason] == ["length"]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens == MAX_TOKENS
