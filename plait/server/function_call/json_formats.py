"""Tool-call formats whose calls are JSON objects ``{"name": ..., "arguments": {...}}`` (or
``"parameters"``), each a ``scan`` for plait.server.function_call.core.ToolCallParser.

* ``hermes`` / ``qwen25``: ``<tool_call>{...}</tool_call>``, one call per tag, normal text around;
* ``llama3``: ``<|python_tag|>`` or a ``{`` that opens the output, then objects separated by ``;``;
* ``mistral``: ``[TOOL_CALLS] [{...}, {...}]``;
* the grammar-enforced forms of ``tool_choice``: ``required`` is a JSON array of
  ``{"name", "parameters"}`` objects (``JsonArrayParser``), a named function is its arguments object
  alone (``NamedFunctionParser``).
"""

from __future__ import annotations

from collections.abc import Collection

from plait.server.function_call.core import (
    Incomplete,
    Malformed,
    PartialCall,
    Scan,
    ToolCallParser,
    block_result,
    holds_prefix,
    leading_whitespace,
    need,
    read_block,
    scan_call_object,
    skip_json_value,
    skip_ws,
)


def text_until(buf: str, marker: str, final: bool) -> Scan | None:
    """The normal text before ``marker``; None when ``buf`` starts with it. A tail of ``buf`` that
    may be the start of the marker is held back unless the output is complete."""
    idx = buf.find(marker)
    if idx == 0:
        return None
    if idx > 0:
        return Scan(text=buf[:idx], consumed=idx)
    keep = 0 if final else holds_prefix(buf, marker)
    return Scan(text=buf[: len(buf) - keep], consumed=len(buf) - keep)


class TaggedJsonParser(ToolCallParser):
    """``<tool_call>`` JSON object ``</tool_call>`` (Hermes and Qwen 2.5 use this exact form)."""

    start = "<tool_call>"
    end = "</tool_call>"

    def scan(self, buf: str, at_start: bool, final: bool) -> Scan:
        text = text_until(buf, self.start, final)
        if text is not None:
            return text

        def read(calls: list[PartialCall]) -> int:
            calls.append(call := PartialCall())
            obj_end = scan_call_object(buf, skip_ws(buf, len(self.start)), call, final)
            i = skip_ws(buf, obj_end)
            tail = buf[i : i + len(self.end)]
            if tail == self.end:
                return i + len(self.end)
            if self.end.startswith(tail) and not final:
                raise Incomplete
            return obj_end  # no closing tag: the call stands

        return read_block(buf, final, read)


class Llama3Parser(ToolCallParser):
    """Llama 3.1/3.2 JSON calls: after ``<|python_tag|>`` (a special token: the client keeps it with
    ``skip_special_tokens: false``), or a ``{`` that opens the output; ``;`` separates calls."""

    tag = "<|python_tag|>"
    separator = ";"

    def scan(self, buf: str, at_start: bool, final: bool) -> Scan:
        if at_start:
            ws = leading_whitespace(buf, final)
            if ws is not None:
                return ws
            if buf.startswith("{"):
                return self._scan_block(buf, 0, final)
        text = text_until(buf, self.tag, final)
        if text is not None:
            return text
        return self._scan_block(buf, len(self.tag), final)

    def _scan_block(self, buf: str, i: int, final: bool) -> Scan:
        def read(calls: list[PartialCall]) -> int:
            j = i
            while True:
                calls.append(call := PartialCall())
                end = scan_call_object(buf, skip_ws(buf, j), call, final)
                j = skip_ws(buf, end)
                if j == len(buf) and not final:
                    raise Incomplete  # a separator may follow
                if j == len(buf) or buf[j] != self.separator:
                    return end
                j += 1

        return read_block(buf, final, read)


def scan_call_array(buf: str, i: int, final: bool) -> Scan:
    """A JSON array of call objects starting at ``buf[i]`` (a block that began at ``buf[0]``)."""

    def read(calls: list[PartialCall]) -> int:
        need(buf, i)
        if buf[i] != "[":
            raise Malformed(i)
        j = skip_ws(buf, i + 1)
        need(buf, j)
        if buf[j] == "]":
            return j + 1
        while True:
            calls.append(call := PartialCall())
            j = skip_ws(buf, scan_call_object(buf, j, call, final))
            need(buf, j)
            if buf[j] == "]":
                return j + 1
            if buf[j] != ",":
                raise Malformed(j)
            j = skip_ws(buf, j + 1)

    return read_block(buf, final, read)


class MistralParser(ToolCallParser):
    """``[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]`` (``[TOOL_CALLS]`` is a special
    token of Mistral's tokenizers: the client keeps it with ``skip_special_tokens: false``)."""

    tag = "[TOOL_CALLS]"

    def scan(self, buf: str, at_start: bool, final: bool) -> Scan:
        text = text_until(buf, self.tag, final)
        if text is not None:
            return text
        return scan_call_array(buf, skip_ws(buf, len(self.tag)), final)


class JsonArrayParser(ToolCallParser):
    """``tool_choice: "required"``: the output is a JSON array of ``{"name", "parameters"}``
    objects (the grammar guarantees it); anything else is normal text."""

    def scan(self, buf: str, at_start: bool, final: bool) -> Scan:
        if at_start:
            ws = leading_whitespace(buf, final)
            if ws is not None:
                return ws
            if buf.startswith("["):
                return scan_call_array(buf, 0, final)
        return Scan(text=buf, consumed=len(buf))


class NamedFunctionParser(ToolCallParser):
    """A named ``tool_choice``: the whole output is the arguments of that one function (its
    parameters schema is the grammar), so the call opens with the first character."""

    def __init__(self, name: str) -> None:
        super().__init__([name], max_calls=1)
        self.name = name

    def scan(self, buf: str, at_start: bool, final: bool) -> Scan:
        if not at_start:
            return Scan(text=buf, consumed=len(buf))
        i = skip_ws(buf, 0)
        call = PartialCall(self.name)
        try:
            end = skip_json_value(buf, i, final)
            call.arguments = buf[i:end]
            return block_result(buf, [call], end, None)
        except Incomplete:
            call.arguments = buf[i:]
            return block_result(buf, [call], len(buf) if final else None, None)
        except Malformed as e:
            call.arguments = buf[i : e.at]
            return block_result(buf, [call], None, max(e.at, 1))


def make_named_parser(name: str) -> ToolCallParser:
    return NamedFunctionParser(name)


def make_required_parser(tool_names: Collection[str], parallel_tool_calls: bool) -> ToolCallParser:
    return JsonArrayParser(tool_names, max_calls=None if parallel_tool_calls else 1)
