"""SGLang launch flags that change what `plait serve` does with a request or writes to its log, on a
server of their own: --allow-auto-truncate, --decode-log-interval, --schedule-policy lpm and
--incremental-streaming-output; and vLLM's --response-role."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.server.conftest import HTTP_TIMEOUT

CONTEXT = 64


@pytest.fixture(scope="module")
def srv(start_server):
    return start_server("sglang-flags", allow_auto_truncate=True, context_length=CONTEXT, decode_log_interval=2,
                        schedule_policy="lpm", watchdog_timeout=120, incremental_streaming_output=True,
                        served_model_name=["plait-tiny", "tiny-alias"], response_role="bot")


def completion(srv, prompt, max_tokens: int) -> dict:
    r = httpx.post(srv.url + "/v1/completions", json={"model": "plait-tiny", "prompt": prompt, "max_tokens": max_tokens,
                                                      "temperature": 0}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_prompt_over_the_context_keeps_its_last_tokens_and_gets_one(srv, offline_engine):
    prompt = [(7 * i) % 400 + 4 for i in range(100)]
    out = completion(srv, prompt, 5)
    assert out["usage"]["prompt_tokens"] == CONTEXT - 1
    assert out["usage"]["completion_tokens"] == 1
    assert out["choices"][0]["finish_reason"] == "length"
    expected = offline_engine.generate(prompt[-(CONTEXT - 1):], {"max_new_tokens": 1, "temperature": 0}).text
    assert out["choices"][0]["text"] == expected


def test_max_tokens_over_the_room_left_shrinks_to_it(srv):
    out = completion(srv, list(range(4, 14)), 500)
    assert out["usage"]["completion_tokens"] == CONTEXT - 10


def test_native_generate_truncates_too(srv):
    r = httpx.post(srv.url + "/generate", json={"input_ids": list(range(4, 104)),
                                                "sampling_params": {"max_new_tokens": 3}}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert (r.json()["meta_info"]["prompt_tokens"], r.json()["meta_info"]["completion_tokens"]) == (CONTEXT - 1, 1)


def test_the_scheduler_process_logs_its_load_and_throughput(srv):
    completion(srv, "Hello there", 8)
    assert "gen throughput" in srv.log()
    assert "tok/s" in srv.log().split("gen throughput", 1)[1].splitlines()[0]


def test_incremental_streaming_events_carry_only_the_new_text_and_ids(srv):
    body = {"input_ids": list(range(4, 14)), "sampling_params": {"max_new_tokens": 48, "temperature": 0,
                                                                 "ignore_eos": True}}
    whole = httpx.post(srv.url + "/generate", json=body, timeout=HTTP_TIMEOUT).json()
    for _ in range(3):  # a lagging reader gets its updates merged: take a stream of several events
        with httpx.stream("POST", srv.url + "/generate", json={**body, "stream": True}, timeout=HTTP_TIMEOUT) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        if len(events) > 1:
            break
    assert len(events) > 1
    assert "".join(e["text"] for e in events) == whole["text"]
    assert [t for e in events for t in e["output_ids"]] == whole["output_ids"]



@pytest.mark.parametrize("name", ["plait-tiny", "tiny-alias", None])
def test_every_served_name_is_accepted_and_responses_carry_the_first(srv, name):
    body = {"prompt": [5, 6], "max_tokens": 1, **({"model": name} if name else {})}
    r = httpx.post(srv.url + "/v1/completions", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "plait-tiny"
    assert httpx.get(srv.url + "/v1/models", timeout=HTTP_TIMEOUT).json()["data"][0]["id"] == "plait-tiny"
    other = httpx.post(srv.url + "/v1/completions", json={**body, "model": "gpt-4"}, timeout=HTTP_TIMEOUT)
    assert other.status_code == 404


def test_echo_of_a_cut_prompt_is_the_text_the_model_saw(srv, offline_engine):
    long_text = " ".join(["word"] * 200)
    r = httpx.post(srv.url + "/v1/completions", json={"model": "plait-tiny", "prompt": long_text, "max_tokens": 2,
                                                      "echo": True, "temperature": 0}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    kept = offline_engine.tokenizer.encode(long_text)[-(CONTEXT - 1):]
    assert r.json()["choices"][0]["text"].startswith(offline_engine.tokenizer.decode(kept))


def _chat(srv, **fields) -> httpx.Response:
    body = {"model": "plait-tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, **fields}
    return httpx.post(srv.url + "/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT)


def test_a_chat_reply_takes_the_response_role(srv):
    r = _chat(srv)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "bot"


def test_a_streamed_chat_reply_opens_with_the_response_role(srv):
    r = _chat(srv, stream=True)
    first = json.loads(next(line for line in r.text.splitlines() if line.startswith("data: {")).removeprefix("data: "))
    assert first["choices"][0]["delta"]["role"] == "bot"


def test_a_chat_without_a_generation_prompt_replies_in_the_last_messages_role(srv):
    r = _chat(srv, add_generation_prompt=False)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "user"
