"""Tool-call and reasoning parsers on model text in each format: the whole-text parse is what the
format means, and streaming the same text split at every chunk boundary (and one character at a
time) adds up to exactly the whole-text parse."""

from __future__ import annotations

import json
from collections.abc import Callable

import pytest

from plait.server.flags import REASONING_PARSER_NAMES, TOOL_CALL_PARSER_NAMES
from plait.server.function_call import (
    TOOL_CALL_PARSERS,
    JsonArrayParser,
    NamedFunctionParser,
    ToolCall,
    ToolCallParser,
    accumulate,
    make_tool_call_parser,
)
from plait.server.reasoning import REASONING_PARSERS, make_reasoning_parser

TOOLS = ["get_weather", "get_time"]

# Output text in each model family's format (as Qwen 2.5, Hermes 2/3, Llama 3.1/3.2, Mistral v0.3 and
# Llama 3.2's pythonic template produce it), with the calls it holds.
PARIS = '{"city": "Paris", "unit": "celsius"}'
ROME = '{"city": "Rome"}'
SMOLLM2_ANSWER = ("The weather in Paris is described as a warm and sunny day with a high of 28°C (82°F), a high of "
                  "29°C (84°F), and a low of 19°C (67°F).")
SAMPLES: dict[str, list[tuple[str, str, list[ToolCall]]]] = {
    "qwen25": [
        ('<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + '}\n</tool_call>', "",
         [ToolCall("get_weather", PARIS)]),
        ('I will look both up.\n<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + '}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": ' + ROME + '}\n</tool_call>', "I will look both up.",
         [ToolCall("get_weather", PARIS), ToolCall("get_weather", ROME)]),
    ],
    "hermes": [
        ('<tool_call>\n{"arguments": ' + PARIS + ', "name": "get_weather"}\n</tool_call>', "",
         [ToolCall("get_weather", PARIS)]),
        ("Paris is sunny today; no tool needed. Use <b>bold</b> < and >.", "Paris is sunny today; no tool needed. "
         "Use <b>bold</b> < and >.", []),
        # SmolLM2-135M-Instruct's greedy answer with the tools-aware ChatML template: no call.
        (SMOLLM2_ANSWER, SMOLLM2_ANSWER, []),
    ],
    "llama3": [
        ('{"name": "get_weather", "parameters": ' + PARIS + '}', "", [ToolCall("get_weather", PARIS)]),
        ('<|python_tag|>{"name": "get_weather", "parameters": ' + PARIS + '}; {"name": "get_time", "parameters": {}}',
         "", [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")]),
        ("The weather in Paris is {usually} mild.", "The weather in Paris is {usually} mild.", []),
    ],
    "mistral": [
        ('[TOOL_CALLS] [{"name": "get_weather", "arguments": ' + PARIS + '}, {"name": "get_time", "arguments": '
         '{"tz": "Europe/Paris"}}]', "",
         [ToolCall("get_weather", PARIS), ToolCall("get_time", '{"tz": "Europe/Paris"}')]),
        ("Sure, here you go: [1, 2, 3]", "Sure, here you go: [1, 2, 3]", []),
    ],
    "pythonic": [
        ('[get_weather(city="Paris", unit="celsius"), get_time()]', "",
         [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")]),
        ("Calling it now: [get_weather(city='Rome', days=[1, 2], extra={'a': None, 'b': True})]", "Calling it now:",
         [ToolCall("get_weather", '{"city": "Rome", "days": [1, 2], "extra": {"a": null, "b": true}}')]),
        ("A list [1, 2] and a [note] stay text.", "A list [1, 2] and a [note] stay text.", []),
    ],
    # Qwen3-Coder's XML: without schemas every value is a string.
    "qwen3_coder": [
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=unit>\ncelsius\n"
         "</parameter>\n</function>\n</tool_call>", "", [ToolCall("get_weather", PARIS)]),
        ("Both.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=get_time>\n</function>\n</tool_call>", "Both.",
         [ToolCall("get_weather", ROME), ToolCall("get_time", "{}")]),
        # An unclosed value ends at the next parameter or at </function>, as the model sometimes writes it.
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n<parameter=unit>\nK\n</function>\n</tool_call>",
         "", [ToolCall("get_weather", '{"city": "Rome", "unit": "K"}')]),
        ("Use <b>bold</b> and a <function=x> in prose.", "Use <b>bold</b> and a <function=x> in prose.", []),
    ],
}
CASES = [(name, *sample) for name, samples in SAMPLES.items() for sample in samples]


def streamed_every_way(make: Callable[[], ToolCallParser], text: str) -> tuple[str, list[ToolCall]]:
    """Whole-text parse, after checking that every split of ``text`` streams to the same result."""
    whole = make().parse(text)
    for i in range(len(text) + 1):
        p = make()
        assert accumulate([p.feed(text[:i]), p.feed(text[i:]), p.finish()]) == whole, f"split at {i}"
    p = make()
    assert accumulate([p.feed(ch) for ch in text] + [p.finish()]) == whole, "one character at a time"
    return whole


@pytest.mark.parametrize(("parser", "text", "normal", "calls"), CASES, ids=[f"{c[0]}-{i}" for i, c in enumerate(CASES)])
def test_parser_finds_the_calls_and_streams_them_identically_at_every_split(parser, text, normal, calls):
    got_normal, got_calls = streamed_every_way(lambda: make_tool_call_parser(parser, TOOLS), text)
    assert got_normal == normal
    assert got_calls == calls
    for call in got_calls:
        assert isinstance(json.loads(call.arguments), dict)


def test_qwen3_coder_values_take_the_type_their_tools_schema_declares():
    schemas = {"get_weather": {"city": {"type": "string"}, "days": {"type": "integer"}, "lat": {"type": "number"},
                               "hot": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
                               "note": {"type": ["string", "null"]}}}
    params = {"city": "007", "days": "3", "lat": "48.85", "hot": "True", "opts": '{"a": 1}', "tags": "['x', 2]",
              "note": "null"}
    text = "<tool_call>\n<function=get_weather>\n" + "".join(
        f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items()) + "</function>\n</tool_call>"
    normal, calls = streamed_every_way(lambda: make_tool_call_parser("qwen3_coder", TOOLS, schemas=schemas), text)
    assert normal == ""
    assert json.loads(calls[0].arguments) == {"city": "007", "days": 3, "lat": 48.85, "hot": True, "opts": {"a": 1},
                                              "tags": ["x", 2], "note": None}


def test_qwen3_coder_streams_each_parameter_once_complete():
    p = make_tool_call_parser("qwen3_coder", TOOLS)
    head = "<tool_call>\n<function=get_weather>\n<parameter=city>\nPar"
    first = p.feed(head)
    assert [(d.name, d.arguments) for d in first.calls] == [("get_weather", ""), (None, "{")]
    assert p.feed("is\n</parameter>\n").calls[0].arguments == '"city": "Paris"'
    assert p.feed("</function>\n</tool_call>").calls[0].arguments == "}"


def test_flag_choices_are_the_registered_parsers():
    assert set(TOOL_CALL_PARSER_NAMES) == set(TOOL_CALL_PARSERS)
    assert set(REASONING_PARSER_NAMES) == set(REASONING_PARSERS)


def test_stream_deltas_open_a_call_with_its_name_then_send_argument_fragments():
    p = make_tool_call_parser("hermes", TOOLS)
    text = '<tool_call>\n{"name": "get_weather", "arguments": ' + PARIS + '}\n</tool_call>'
    deltas = [d for ch in text for d in p.feed(ch).calls] + p.finish().calls
    assert deltas[0].name == "get_weather" and deltas[0].arguments == "" and deltas[0].index == 0
    assert all(d.name is None for d in deltas[1:])
    assert len(deltas) > 5  # the arguments arrive in pieces, not at the end
    assert "".join(d.arguments for d in deltas) == PARIS


def test_marker_prefix_is_held_back_until_decided():
    p = make_tool_call_parser("hermes", TOOLS)
    assert p.feed("Hello <tool").normal_text == "Hello"
    assert p.feed("s are great").normal_text == " <tools are great"


def test_calls_to_functions_not_in_tools_are_dropped():
    text = ('<tool_call>{"name": "launch_rockets", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')
    got = streamed_every_way(lambda: make_tool_call_parser("qwen25", TOOLS), text)
    assert got == ("", [ToolCall("get_time", "{}")])


def test_parallel_tool_calls_false_keeps_the_first_call_only():
    text = '{"name": "get_weather", "parameters": ' + PARIS + '}; {"name": "get_time", "parameters": {}}'
    got = streamed_every_way(lambda: make_tool_call_parser("llama3", TOOLS, parallel_tool_calls=False), text)
    assert got == ("", [ToolCall("get_weather", PARIS)])


def test_malformed_call_before_its_name_is_normal_text():
    text = "<tool_call>not json</tool_call> done"
    assert streamed_every_way(lambda: make_tool_call_parser("hermes", TOOLS), text) == (text, [])


def test_output_cut_inside_the_arguments_keeps_the_partial_call():
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par'
    got = streamed_every_way(lambda: make_tool_call_parser("hermes", TOOLS), text)
    assert got == ("", [ToolCall("get_weather", '{"city": "Par')])


def test_required_array_parser_reads_the_grammar_output():
    text = '[{"name": "get_weather", "parameters": ' + PARIS + '}, {"name": "get_time", "parameters": {}}]'
    got = streamed_every_way(lambda: JsonArrayParser(TOOLS), text)
    assert got == ("", [ToolCall("get_weather", PARIS), ToolCall("get_time", "{}")])
    one = streamed_every_way(lambda: JsonArrayParser(TOOLS, max_calls=1), text)
    assert one == ("", [ToolCall("get_weather", PARIS)])


def test_named_function_parser_takes_the_whole_output_as_its_arguments():
    assert streamed_every_way(lambda: NamedFunctionParser("get_weather"), " " + PARIS) == (
        "", [ToolCall("get_weather", PARIS)])


# --- reasoning ----------------------------------------------------------------------------------
REASONING_CASES = [
    ("qwen3", "<think>\nThe user wants 2+2. That is 4.\n</think>\n\nThe answer is 4.",
     "The user wants 2+2. That is 4.", "The answer is 4."),
    ("qwen3", "The answer is 4.", "", "The answer is 4."),  # enable_thinking: false
    ("qwen3", "<think>\nI should call the tool.\n<tool_call>\n{}\n</tool_call>", "I should call the tool.",
     "<tool_call>\n{}\n</tool_call>"),
    ("qwen3", "<think>\nStill thinking when the length limit hit", "Still thinking when the length limit hit", ""),
    ("deepseek-r1", "Okay, 2+2 is 4.\n</think>\n\n**4**", "Okay, 2+2 is 4.", "**4**"),
    ("deepseek-r1", "<think>\nOkay, 2+2 is 4.\n</think>\n\n**4**", "Okay, 2+2 is 4.", "**4**"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), REASONING_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(REASONING_CASES)])
def test_reasoning_split_streams_identically_at_every_split(parser, text, reasoning, content):
    whole = make_reasoning_parser(parser).parse(text)
    assert whole == (reasoning, content)

    def joined(parts: list[tuple[str, str]]) -> tuple[str, str]:
        return "".join(r for r, _ in parts), "".join(c for _, c in parts)

    for i in range(len(text) + 1):
        p = make_reasoning_parser(parser)
        assert joined([p.feed(text[:i]), p.feed(text[i:]), p.finish()]) == whole, f"split at {i}"
    p = make_reasoning_parser(parser)
    assert joined([p.feed(ch) for ch in text] + [p.finish()]) == whole
