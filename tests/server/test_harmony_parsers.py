"""gpt-oss's harmony format (``--reasoning-parser gpt-oss``, ``--tool-call-parser gpt-oss``) on
output text as gpt-oss writes it after ``<|start|>assistant`` with the special tokens kept: each
parser alone and the two together (as the server chains them), whole and streamed split at every
chunk boundary and one character at a time, with the same result."""

from __future__ import annotations

import json
from typing import Any

import pytest

from plait.server import protocol
from plait.server.function_call import HarmonyToolParser, ToolCall, accumulate, make_tool_call_parser
from plait.server.function_call.harmony import Event, HarmonyStream, Kind
from plait.server.reasoning import make_reasoning_parser
from plait.server.tool_calling import ChatOptions, ChatOutput, plan_tools

TOOLS = ["get_weather", "get_time"]
PARIS = '{"location": "Paris, France", "unit": "celsius"}'
TOKYO = '{"location": "Tokyo"}'

# (output text, reasoning_content, content, tool calls)
SAMPLES: list[tuple[str, str, str, list[ToolCall]]] = [
    # Reasoning, then the final answer; <|return|> is the stop token, kept in the text.
    ("<|channel|>analysis<|message|>User asks: \"What is 2 + 2?\" Simple arithmetic. Provide answer.<|end|>"
     "<|start|>assistant<|channel|>final<|message|>2 + 2 = **4**.<|return|>",
     'User asks: "What is 2 + 2?" Simple arithmetic. Provide answer.', "2 + 2 = **4**.", []),
    # Reasoning, then one call; <|call|> is the stop token.
    ("<|channel|>analysis<|message|>Need to use function get_weather.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + PARIS
     + "<|call|>",
     "Need to use function get_weather.", "", [ToolCall("get_weather", PARIS)]),
    # Two calls (one with the recipient in the role header and content type "json"), a preamble.
    ("<|channel|>analysis<|message|>Two cities: call get_weather twice.<|end|>"
     "<|start|>assistant<|channel|>commentary<|message|>Checking both cities.<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>" + PARIS
     + "<|call|><|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>" + TOKYO
     + "<|call|>",
     "Two cities: call get_weather twice.", "Checking both cities.",
     [ToolCall("get_weather", PARIS), ToolCall("get_weather", TOKYO)]),
    # No harmony markup at all (e.g. a grammar-forced answer): all content, "<" and "to" included.
    ("Paris is sunny; a < b, and to go there take the train.", "",
     "Paris is sunny; a < b, and to go there take the train.", []),
    # The stop token stripped (a final answer cut at the end of the text), no reasoning.
    ("<|channel|>final<|message|>It is 21 °C in Paris.", "", "It is 21 °C in Paris.", []),
    # A call right away, its recipient continuing the prompt's <|start|>assistant; no arguments.
    (" to=functions.get_time<|channel|>commentary json<|message|><|call|>", "", "", [ToolCall("get_time", "{}")]),
    # Reasoning that runs into the next message without <|end|>, then <|endoftext|>.
    ("<|channel|>analysis<|message|>Thinking<|start|>assistant<|channel|>final<|message|>Done.<|endoftext|>",
     "Thinking", "Done.", []),
    # Cut by max_tokens inside the arguments: the partial call stands, as the other parsers do.
    ("<|channel|>analysis<|message|>Weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather"
     ' <|constrain|>json<|message|>{"location": "Par', "Weather.", "",
     [ToolCall("get_weather", '{"location": "Par')]),
]
IDS = ["final", "one-call", "two-calls", "no-markup", "no-stop-token", "role-recipient", "implicit-end", "cut"]


def splits(text: str) -> list[list[str]]:
    """The text whole, in two at every boundary, and one character at a time."""
    return [[text]] + [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]


def assemble(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """OpenAI stream deltas put together, checking the tool-call delta shapes on the way."""
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}}
    for d in deltas:
        out["reasoning"] += d.get("reasoning_content", "")
        out["content"] += d.get("content", "")
        for entry in d.get("tool_calls", ()):
            if "id" in entry:
                assert entry["index"] not in out["calls"]
                assert entry["type"] == "function" and entry["function"]["arguments"] == ""
                assert entry["id"].startswith("call_")
                out["calls"][entry["index"]] = ToolCall(entry["function"]["name"], "")
            else:
                assert set(entry) == {"index", "function"} and set(entry["function"]) == {"arguments"}
                call = out["calls"][entry["index"]]
                out["calls"][entry["index"]] = ToolCall(call.name, call.arguments + entry["function"]["arguments"])
    out["calls"] = [out["calls"][i] for i in sorted(out["calls"])]
    return out


def gpt_oss_output() -> ChatOutput:
    return ChatOutput(make_reasoning_parser("gpt-oss"), make_tool_call_parser("gpt-oss", TOOLS))


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), SAMPLES, ids=IDS)
def test_reasoning_and_tool_parsers_together_split_reasoning_content_and_calls_at_every_split(
        text, reasoning, content, calls):
    for chunks in splits(text):
        out = gpt_oss_output()
        got = assemble([d for c in chunks for d in out.feed(c)] + out.finish())
        assert got == {"reasoning": reasoning, "content": content, "calls": calls}, chunks
        assert out.finish_reason("stop") == ("tool_calls" if calls else "stop")
    msg = gpt_oss_output().message(text)
    assert msg["reasoning_content"] == (reasoning or None)
    assert msg["content"] == (content or None if calls else content)
    assert [ToolCall(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == calls


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), SAMPLES, ids=IDS)
def test_tool_parser_alone_finds_the_calls_and_drops_the_reasoning_at_every_split(text, reasoning, content, calls):
    for chunks in splits(text):
        p = make_tool_call_parser("gpt-oss", TOOLS)
        assert accumulate([p.feed(c) for c in chunks] + [p.finish()]) == (content, calls), chunks


@pytest.mark.parametrize(("text", "reasoning", "content", "calls"), SAMPLES, ids=IDS)
def test_reasoning_parser_alone_splits_the_reasoning_at_every_split(text, reasoning, content, calls):
    whole = make_reasoning_parser("gpt-oss").parse(text)
    assert whole[0] == reasoning
    assert "<|channel|>analysis" not in whole[1]
    for chunks in splits(text):
        p = make_reasoning_parser("gpt-oss")
        parts = [p.feed(c) for c in chunks] + [p.finish()]
        assert ("".join(r for r, _ in parts), "".join(c for _, c in parts)) == whole, chunks


def test_calls_stream_as_a_name_then_argument_fragments():
    text = SAMPLES[1][0]
    p = make_tool_call_parser("gpt-oss", TOOLS)
    deltas = [d for ch in text for d in p.feed(ch).calls] + p.finish().calls
    assert deltas[0].name == "get_weather" and deltas[0].arguments == "" and deltas[0].index == 0
    assert all(d.name is None for d in deltas[1:])
    assert len(deltas) > 5  # the arguments arrive as they are written, not at the end
    assert "".join(d.arguments for d in deltas) == PARIS


def content(text: str) -> Event:
    return Event(Kind.CONTENT, text)


def test_a_marker_prefix_is_held_back_until_decided():
    s = HarmonyStream()
    assert s.feed("<|channel|>final<|message|>a <") == [content("a ")]
    assert s.feed("|en") == []
    assert s.feed("d|>") == []  # the body's end: nothing more to say
    t = HarmonyStream()
    t.feed("<|channel|>final<|message|>a <")
    assert t.feed("b") == [content("<b")]


def test_calls_to_functions_not_in_tools_and_built_in_tools_are_dropped():
    text = ("<|channel|>analysis to=browser.search <|constrain|>json<|message|>{\"query\": \"x\"}<|call|>"
            "<|start|>assistant<|channel|>commentary to=functions.launch_rockets <|constrain|>json<|message|>{}<|call|>"
            "<|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{}<|call|>")
    assert HarmonyToolParser(TOOLS).parse(text) == ("", [ToolCall("get_time", "{}")])


def test_parallel_tool_calls_false_keeps_the_first_call():
    text = SAMPLES[2][0]
    p = make_tool_call_parser("gpt-oss", TOOLS, parallel_tool_calls=False)
    assert p.parse(text) == ("Checking both cities.", [ToolCall("get_weather", PARIS)])


def plan(options: ChatOptions, **fields: Any):
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    return plan_tools(protocol.parse_request(protocol.ChatCompletionRequest, json.dumps(body).encode()), options)


WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}


GPT_OSS_OPTIONS = [ChatOptions(reasoning_parser="gpt-oss"), ChatOptions(tool_call_parser="gpt-oss"),
                   ChatOptions(tool_call_parser="gpt-oss", reasoning_parser="gpt-oss")]
OPTION_IDS = ["reasoning", "tools", "both"]


@pytest.mark.parametrize("options", GPT_OSS_OPTIONS, ids=OPTION_IDS)
def test_without_tools_to_call_a_harmony_call_is_dropped_and_no_marker_reaches_the_content(options):
    text, reasoning = SAMPLES[2][0], SAMPLES[2][1]
    for p in (plan(options), plan(options, tools=[WEATHER], tool_choice="none")):
        msg = ChatOutput.for_request(p, options).message(text)
        assert msg["content"] == "Checking both cities."
        assert "tool_calls" not in msg
        # The analysis is reasoning_content with --reasoning-parser gpt-oss, else dropped.
        assert msg.get("reasoning_content", "absent") == (reasoning if options.reasoning_parser else "absent")


@pytest.mark.parametrize("options", GPT_OSS_OPTIONS, ids=OPTION_IDS)
def test_grammar_enforced_calls_leave_the_stop_token_out_of_the_content(options):
    required = plan(options, tools=[WEATHER], tool_choice="required")
    msg = ChatOutput.for_request(required, options).message(
        '[{"name": "get_weather", "parameters": ' + PARIS + "}]<|call|>")
    assert msg["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg["tool_calls"]] == [("get_weather", PARIS)]
    named = plan(options, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}})
    msg = ChatOutput.for_request(named, options).message(PARIS + "<|return|>")
    assert msg["content"] is None
    assert msg["tool_calls"][0]["function"]["arguments"] == PARIS


@pytest.mark.parametrize("options", GPT_OSS_OPTIONS, ids=OPTION_IDS)
def test_a_gpt_oss_parser_keeps_special_tokens_in_chat_outputs(options):
    for fields in ({}, {"tools": [WEATHER], "tool_choice": "none"}, {"tools": [WEATHER], "tool_choice": "required"}):
        sampling = plan(options, **fields).sampling_fields({"skip_special_tokens": True})
        assert sampling["skip_special_tokens"] is False


def test_other_parsers_leave_skip_special_tokens_to_the_request():
    options = ChatOptions(tool_call_parser="hermes", reasoning_parser="qwen3")
    assert plan(options).sampling_fields({"skip_special_tokens": None}) == {"skip_special_tokens": None}


@pytest.mark.parametrize(("tool_call_parser", "reasoning_parser"), [("hermes", "gpt-oss"), ("gpt-oss", "qwen3")])
def test_gpt_oss_parsers_paired_with_another_format_are_refused(tool_call_parser, reasoning_parser):
    with pytest.raises(ValueError, match="gpt-oss goes with gpt-oss"):
        ChatOptions(tool_call_parser=tool_call_parser, reasoning_parser=reasoning_parser)
