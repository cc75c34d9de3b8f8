"""Tool-call parsers of ``plait serve --tool-call-parser`` (SGLang's names), and the parsers of the
grammar-enforced ``tool_choice`` forms. Each parses a complete output or streams it delta by delta
with the same result (plait.server.function_call.core)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from plait.server.function_call.core import (
    ParseDelta,
    ToolCall,
    ToolCallDelta,
    ToolCallParser,
    ToolParser,
    accumulate,
)
from plait.server.function_call.harmony import HarmonyToolParser
from plait.server.function_call.json_formats import (
    JsonArrayParser,
    Llama3Parser,
    MistralParser,
    NamedFunctionParser,
    TaggedJsonParser,
)
from plait.server.function_call.pythonic import PythonicParser
from plait.server.function_call.xml_formats import Qwen3CoderParser, parameter_schemas

# --tool-call-parser NAME -> the parser class; hermes and qwen25 share the <tool_call> format.
TOOL_CALL_PARSERS: dict[str, Callable[..., ToolParser]] = {
    "llama3": Llama3Parser,
    "hermes": TaggedJsonParser,
    "qwen25": TaggedJsonParser,
    "mistral": MistralParser,
    "pythonic": PythonicParser,
    "gpt-oss": HarmonyToolParser,
    "qwen3_coder": Qwen3CoderParser,
}


def make_tool_call_parser(name: str, tool_names: Collection[str], parallel_tool_calls: bool = True,
                          schemas: Mapping[str, Mapping[str, Any]] | None = None) -> ToolParser:
    """``schemas`` (function -> parameter -> JSON schema): the types of formats whose values are text."""
    if name not in TOOL_CALL_PARSERS:
        raise ValueError(f"tool call parser must be one of {', '.join(TOOL_CALL_PARSERS)}; got {name!r}")
    max_calls = None if parallel_tool_calls else 1
    if name == "qwen3_coder":
        return Qwen3CoderParser(tool_names, max_calls, schemas)
    return TOOL_CALL_PARSERS[name](tool_names, max_calls=max_calls)


__all__ = ["TOOL_CALL_PARSERS", "HarmonyToolParser", "JsonArrayParser", "NamedFunctionParser", "ParseDelta", "ToolCall",
           "ToolCallDelta", "ToolCallParser", "ToolParser", "accumulate", "make_tool_call_parser", "parameter_schemas"]
