"""Qwen3-Coder's XML tool calls (``--tool-call-parser qwen3_coder``)::

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    <parameter=days>
    3
    </parameter>
    </function>
    </tool_call>

A parameter's value is raw text; it becomes JSON by the type its tool's schema declares (integer,
number, boolean, object / array; anything else, or no schema, stays a string). A call's
``arguments`` grows one parameter at a time: ``{``, then ``"city": "Paris"``, ``, "days": 3`` and
``}`` at ``</function>``. A value missing its ``</parameter>`` ends at the next ``<parameter=`` or
``</function>``, as the model sometimes writes it.
"""

from __future__ import annotations

import ast
import json
from collections.abc import Collection, Mapping
from typing import Any

from plait.server.function_call.core import (
    Incomplete,
    Malformed,
    PartialCall,
    Scan,
    ToolCallParser,
    need,
    read_block,
    skip_ws,
)
from plait.server.function_call.json_formats import text_until

# function name -> parameter name -> that parameter's JSON schema
ParameterSchemas = Mapping[str, Mapping[str, Any]]


def parameter_schemas(tools: Collection[Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """The request's tools as ``ParameterSchemas``."""
    return {t["function"]["name"]: dict((t["function"].get("parameters") or {}).get("properties") or {})
            for t in tools}


def _typed(raw: str, schema: Mapping[str, Any] | None) -> Any:
    """``raw`` as the JSON value its schema's type asks for (``null`` is None whatever the type); the
    text itself when there is no schema, the type is a string, or the text does not parse as it."""
    text = raw.strip()
    if text.lower() == "null":
        return None
    kind = (schema or {}).get("type", "string")
    kinds = set(kind) if isinstance(kind, list) else {kind}
    try:
        if "integer" in kinds and text.lstrip("+-").isdigit():
            return int(text)
        if "number" in kinds:
            value = float(text)
            return int(value) if value.is_integer() and not any(c in text for c in ".eE") else value
        if "boolean" in kinds and text.lower() in ("true", "false"):
            return text.lower() == "true"
        if kinds & {"object", "array"}:
            try:
                return json.loads(text)
            except ValueError:
                return ast.literal_eval(text)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        pass
    return raw


class Qwen3CoderParser(ToolCallParser):
    start = "<tool_call>"
    end = "</tool_call>"
    function_open = "<function="
    function_close = "</function>"
    parameter_open = "<parameter="
    parameter_close = "</parameter>"

    def __init__(self, tool_names: Collection[str], max_calls: int | None = None,
                 schemas: ParameterSchemas | None = None) -> None:
        super().__init__(tool_names, max_calls)
        self.schemas = schemas or {}

    def scan(self, buf: str, at_start: bool, final: bool) -> Scan:
        text = text_until(buf, self.start, final)
        if text is not None:
            return text

        def read(calls: list[PartialCall]) -> int:
            i = self._expect(buf, skip_ws(buf, len(self.start)), self.function_open, final)
            name_end = self._tag_end(buf, i, final)
            calls.append(call := PartialCall(buf[i:name_end].strip(), "{"))
            i = name_end + 1
            schemas = self.schemas.get(call.name or "", {})
            first = True
            while True:
                i = skip_ws(buf, i)
                need(buf, i)
                if buf.startswith(self.function_close, i):
                    call.arguments += "}"
                    i = skip_ws(buf, i + len(self.function_close))
                    return self._expect(buf, i, self.end, final)
                if buf.startswith(self.parameter_open, i):
                    i += len(self.parameter_open)
                    key_end = self._tag_end(buf, i, final)
                    key = buf[i:key_end].strip()
                    value, i = self._value(buf, key_end + 1, final)
                    call.arguments += ("" if first else ", ") + json.dumps(key) + ": " + json.dumps(
                        _typed(value, schemas.get(key)), ensure_ascii=False)
                    first = False
                    continue
                if not final and any(m.startswith(buf[i:]) for m in (self.function_close, self.parameter_open)):
                    raise Incomplete
                raise Malformed(i)

        return read_block(buf, final, read)

    @staticmethod
    def _expect(buf: str, i: int, marker: str, final: bool) -> int:
        """The index after ``marker`` at ``buf[i]``."""
        if buf.startswith(marker, i):
            return i + len(marker)
        if marker.startswith(buf[i:]) and not final:
            raise Incomplete
        raise Malformed(i)

    @staticmethod
    def _tag_end(buf: str, i: int, final: bool) -> int:
        """The index of the '>' closing a ``<function=NAME`` or ``<parameter=NAME`` tag."""
        j = i
        while j < len(buf) and buf[j] not in ">\n<":
            j += 1
        if j == len(buf):
            if final:
                raise Malformed(j)
            raise Incomplete
        if buf[j] != ">" or j == i:
            raise Malformed(j)
        return j

    def _value(self, buf: str, i: int, final: bool) -> tuple[str, int]:
        """A parameter's raw value from ``buf[i]`` (one newline trimmed at each end) and the index after
        its ``</parameter>`` (or at the ``<parameter=`` / ``</function>`` that ends it unclosed)."""
        ends = [(k, m) for m in (self.parameter_close, self.parameter_open, self.function_close)
                if (k := buf.find(m, i)) >= 0]
        if not ends:
            if final:
                raise Malformed(len(buf))
            raise Incomplete
        k, marker = min(ends)
        value = buf[i:k]
        value = value[1:] if value.startswith("\n") else value
        value = value[:-1] if value.endswith("\n") else value
        return value, k + len(self.parameter_close) if marker == self.parameter_close else k
