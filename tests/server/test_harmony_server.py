"""gpt-oss's harmony format end to end: the openai client against a real `plait serve` of a tiny
gpt-oss checkpoint whose tokenizer has the harmony special tokens (plait.testing.harmony), with
--reasoning-parser gpt-oss, --tool-call-parser gpt-oss and the harmony chat template. A regex makes
the random model write a harmony message and logit_bias makes it pick the markers' special tokens
(not their spelling in plain bytes) and the stop token: the parsers run on generated special tokens
that the default skip_special_tokens would have dropped."""

from __future__ import annotations

import json
import pathlib
import re
from typing import Any

import pytest

import plait.server
from plait.testing.harmony import HARMONY_TOKENS, make_tiny_harmony_model
from tests.server.conftest import Server
from tests.server.test_server_tools import collect, create, pairs

TEMPLATE = pathlib.Path(plait.server.__file__).parent / "templates" / "harmony_tools.jinja"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
ARGS = '{"city": "Paris"}'
CALL = ("<|channel|>analysis<|message|>Need the weather tool.<|end|>"
        "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + ARGS)
ANSWER = ("<|channel|>analysis<|message|>The tool said sunny.<|end|>"
          "<|start|>assistant<|channel|>final<|message|>It is sunny in Paris.")


@pytest.fixture(scope="module")
def harmony_model(tmp_path_factory) -> pathlib.Path:
    return make_tiny_harmony_model(tmp_path_factory.mktemp("tiny-harmony"))


@pytest.fixture(scope="module")
def harmony_server(harmony_model, tmp_path_factory):
    srv = Server(harmony_model, tmp_path_factory.mktemp("harmony-server"), "harmony", tool_call_parser="gpt-oss",
                 reasoning_parser="gpt-oss", chat_template=str(TEMPLATE), max_total_tokens=4096,
                 context_length=1024, max_running_requests=8)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def token_ids(harmony_model) -> dict[str, int]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(harmony_model)
    return {t: tok.convert_tokens_to_ids(t) for t in (*HARMONY_TOKENS, "<|endoftext|>")}


def forced(token_ids: dict[str, int], text: str, stop: str) -> dict[str, Any]:
    """Request fields that make the model write ``text`` with the markers as special tokens, then
    ``stop`` (one of the checkpoint's stop tokens)."""
    markers = [m for m in HARMONY_TOKENS if m in text] + [stop]
    return {"regex": re.escape(text), "logit_bias": {str(token_ids[m]): 100 for m in markers},
            "return_token_ids": True}


def test_a_generated_harmony_tool_call_gives_reasoning_and_a_tool_call(harmony_server, token_ids):
    client, model = harmony_server.openai(), harmony_server.model
    body = forced(token_ids, CALL, "<|call|>")
    r = create(client, model, tools=[WEATHER], extra_body=body)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls"
    assert ch.message.model_extra["reasoning_content"] == "Need the weather tool."
    assert pairs(ch.message.tool_calls) == [["get_weather", ARGS]]
    assert ch.message.content is None
    generated = ch.model_extra["token_ids"]
    # The markers were generated as special tokens, and the output stopped at <|call|>.
    assert {token_ids["<|channel|>"], token_ids["<|message|>"], token_ids["<|constrain|>"]} <= set(generated)
    assert generated[-1] == token_ids["<|call|>"]

    got = collect(create(client, model, stream=True, tools=[WEATHER], extra_body=body))
    assert got["finish"] == "tool_calls"
    assert got["reasoning"] == "Need the weather tool."
    assert got["calls"] == {0: ["get_weather", ARGS]}
    assert got["content"] == ""


def test_a_generated_harmony_answer_splits_reasoning_from_content(harmony_server, token_ids):
    client, model = harmony_server.openai(), harmony_server.model
    # skip_special_tokens true from the client does not strip the markers the parsers need.
    body = forced(token_ids, ANSWER, "<|return|>") | {"skip_special_tokens": True}
    r = create(client, model, extra_body=body)
    ch = r.choices[0]
    assert ch.finish_reason == "stop"
    assert ch.message.model_extra["reasoning_content"] == "The tool said sunny."
    assert ch.message.content == "It is sunny in Paris."
    assert ch.message.tool_calls is None
    assert ch.model_extra["token_ids"][-1] == token_ids["<|return|>"]

    got = collect(create(client, model, stream=True, extra_body=body))
    assert (got["reasoning"], got["content"], got["calls"], got["finish"]) == (
        "The tool said sunny.", "It is sunny in Paris.", {}, "stop")


def test_history_with_a_call_and_its_result_renders_in_harmony(harmony_server, harmony_model):
    from transformers import AutoTokenizer

    history = ASK + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": ARGS}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    r = create(harmony_server.openai(), harmony_server.model, messages=history, tools=[WEATHER], max_tokens=1)
    tok = AutoTokenizer.from_pretrained(harmony_model)
    decoded = [dict(m, tool_calls=[{**c, "function": {**c["function"], "arguments": json.loads(ARGS)}}
                                   for c in m["tool_calls"]]) if "tool_calls" in m else m for m in history]
    rendered = tok.apply_chat_template(decoded, chat_template=TEMPLATE.read_text(), tools=[WEATHER], tokenize=False,
                                       add_generation_prompt=True)
    assert r.usage.prompt_tokens == len(tok.encode(rendered, add_special_tokens=False))
    assert ("<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" + ARGS + "<|call|>"
            "<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>sunny, 21 C<|end|>"
            "<|start|>assistant") in rendered
    assert "type get_weather = (_: " in rendered


def test_reasoning_effort_reaches_the_harmony_template(harmony_server, harmony_model):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(harmony_model)

    def rendered_ids(effort: str) -> list[int]:
        text = tok.apply_chat_template(ASK, chat_template=TEMPLATE.read_text(), tokenize=False,
                                       add_generation_prompt=True, reasoning_effort=effort)
        assert f"Reasoning: {effort}" in text
        return tok.encode(text, add_special_tokens=False)

    def prompt_ids(**fields: Any) -> list[int]:
        r = create(harmony_server.openai(), harmony_server.model, max_tokens=1,
                   extra_body={"return_token_ids": True}, **fields)
        return r.choices[0].model_extra["prompt_token_ids"]

    assert prompt_ids(reasoning_effort="high") == rendered_ids("high") != rendered_ids("medium")
    assert prompt_ids() == rendered_ids("medium")  # the template's default
