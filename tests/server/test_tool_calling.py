"""The request and output sides of tool calling without a server: the grammars that enforce
``tool_choice: required`` and named functions (checked on strings with xgrammar), the plan's
validation, and ChatOutput's OpenAI deltas and messages."""

from __future__ import annotations

import json

import pytest
import xgrammar as xgr
from xgrammar.testing import _is_grammar_accept_string

from plait.sampling import SamplingParams
from plait.server import protocol
from plait.server.errors import APIError
from plait.server.function_call import JsonArrayParser
from plait.server.reasoning import make_reasoning_parser
from plait.server.tool_calling import ChatOptions, ChatOutput, plan_tools

ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}
NOW = {"type": "function", "function": {"name": "now"}}  # no parameters: an empty object
HERMES = ChatOptions(tool_call_parser="hermes")


def plan(options: ChatOptions = HERMES, **fields):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return plan_tools(protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode()), options)


def accepts(schema: dict, text: str) -> bool:
    return _is_grammar_accept_string(xgr.Grammar.from_json_schema(json.dumps(schema)), text)


def test_required_grammar_is_an_array_of_named_calls_with_their_parameters():
    schema = plan(tools=[ADD, NOW], tool_choice="required").json_schema()
    assert accepts(schema, '[{"name": "add", "parameters": {"a": 1, "b": 2}}, {"name": "now", "parameters": {}}]')
    assert not accepts(schema, "[]")  # at least one call
    assert not accepts(schema, '[{"name": "sub", "parameters": {"a": 1, "b": 2}}]')
    assert not accepts(schema, '[{"name": "add", "parameters": {"a": 1}}]')
    SamplingParams(json_schema=json.dumps(schema))  # xgrammar compiles it


def test_required_without_parallel_calls_allows_one_item():
    schema = plan(tools=[ADD, NOW], tool_choice="required", parallel_tool_calls=False).json_schema()
    assert accepts(schema, '[{"name": "now", "parameters": {}}]')
    assert not accepts(schema, '[{"name": "now", "parameters": {}}, {"name": "now", "parameters": {}}]')


def test_named_grammar_is_that_functions_parameters():
    p = plan(tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "add"}})
    assert p.json_schema() == ADD["function"]["parameters"]
    assert accepts(p.json_schema(), '{"a": 1, "b": 2}')
    assert plan(tools=[ADD, NOW], tool_choice={"type": "function", "function": {"name": "now"}}).json_schema() == {
        "type": "object", "properties": {}}


def test_shared_defs_move_to_the_root_of_the_required_grammar():
    point = {"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]}
    tool = {"type": "function", "function": {"name": "move", "parameters": {
        "type": "object", "properties": {"to": {"$ref": "#/$defs/point"}}, "required": ["to"],
        "$defs": {"point": point}}}}
    schema = plan(tools=[tool], tool_choice="required").json_schema()
    assert schema["$defs"] == {"point": point}
    assert accepts(schema, '[{"name": "move", "parameters": {"to": {"x": 1.5}}}]')


def test_auto_and_none_add_no_grammar_and_none_hides_the_tools():
    auto = plan(tools=[ADD])
    assert auto.mode == "auto" and auto.json_schema() is None and auto.template_tools() == [ADD]
    none = plan(tools=[ADD], tool_choice="none")
    assert none.json_schema() is None and none.template_tools() is None and none.new_parser() is None


def test_auto_without_a_parser_names_the_flag():
    with pytest.raises(APIError, match="--tool-call-parser") as e:
        plan(ChatOptions(), tools=[ADD])
    assert e.value.status == 400


def test_unknown_parser_names_are_refused_at_startup():
    with pytest.raises(ValueError, match="--tool-call-parser"):
        ChatOptions(tool_call_parser="gpt5")
    with pytest.raises(ValueError, match="--reasoning-parser"):
        ChatOptions(reasoning_parser="o1")
    with pytest.raises(ValueError, match="--chat-template"):
        ChatOptions.from_flags(None, None, "/nonexistent/template.jinja")


def test_chat_output_streams_openai_tool_call_deltas():
    out = ChatOutput(None, JsonArrayParser(["add"]))
    text = '[{"name": "add", "parameters": {"a": 1, "b": 2}}]'
    deltas = [d for ch in text for d in out.feed(ch)] + out.finish()
    first, rest = deltas[0]["tool_calls"][0], [d["tool_calls"][0] for d in deltas[1:]]
    assert first["index"] == 0 and first["type"] == "function" and first["id"].startswith("call_")
    assert first["function"] == {"name": "add", "arguments": ""}
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert "".join(d["function"]["arguments"] for d in rest) == '{"a": 1, "b": 2}'
    assert out.finish_reason("stop") == "tool_calls"
    assert out.finish_reason("length") == "length"


def test_chat_output_message_has_reasoning_content_and_tool_calls():
    out = ChatOutput(make_reasoning_parser("qwen3"), plan(tools=[ADD]).new_parser())
    msg = out.message('<think>\nAdd them.\n</think>\n\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n'
                      "</tool_call>")
    assert msg["reasoning_content"] == "Add them."
    assert msg["content"] is None
    [call] = msg["tool_calls"]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}
    assert out.finish_reason("stop") == "tool_calls"


def test_chat_output_without_parsers_is_plain_content():
    out = ChatOutput(None, None)
    assert out.feed("Hello") == [{"content": "Hello"}]
    assert out.finish() == []
    assert out.finish_reason("stop") == "stop"
    assert ChatOutput(None, None).message("Hi") == {"role": "assistant", "content": "Hi"}


def test_a_history_call_with_null_content_reaches_the_template_with_empty_content():
    from plait.server.tool_calling import template_messages

    body = {"model": "m", "messages": [
        {"role": "user", "content": "Add."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"}]}
    messages = template_messages(protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode()))
    assert messages[1]["content"] == ""
    assert messages[1]["tool_calls"][0]["function"] == {"name": "add", "arguments": {"a": 1, "b": 2}}
