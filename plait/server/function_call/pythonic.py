"""The pythonic tool-call format (Llama 3.2 / 4 with a pythonic template): a Python list of calls
with keyword arguments, ``[get_weather(city="Paris", days=3), get_time()]``. Argument values are
Python literals, converted to JSON once each is complete, so a call's ``arguments`` grows one
argument at a time: ``{`` then ``"city": "Paris"``, ``, "days": 3``, and ``}`` at its ``)``."""

from __future__ import annotations

import ast
import json

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

_CLOSERS = {")": "(", "]": "[", "}": "{"}


def _identifier(s: str, i: int) -> int:
    """The index after the (possibly dotted) identifier at ``s[i]``; ``i`` if there is none."""
    j = i
    while j < len(s) and (s[j].isalnum() or s[j] in "_.") and not (j == i and s[j].isdigit()):
        j += 1
    return j


def _skip_py_string(s: str, i: int, final: bool) -> int:
    q = s[i]
    if s.startswith(q * 3, i):
        close, j = q * 3, i + 3
    elif len(s) - i < 3 and s.startswith(q * (len(s) - i), i) and not final:
        raise Incomplete  # "" or '' so far: an empty string or the start of a triple quote
    else:
        close, j = q, i + 1
    while j < len(s):
        if s[j] == "\\":
            j += 2
            continue
        if s.startswith(close, j):
            return j + len(close)
        if s[j] == "\n" and len(close) == 1:
            raise Malformed(j)
        j += 1
    raise Incomplete


def _skip_py_value(s: str, i: int, final: bool) -> int:
    """The index of the ',' or ')' that ends the argument value starting at ``s[i]``."""
    stack: list[str] = []
    j = i
    while j < len(s):
        c = s[j]
        if c in "\"'":
            j = _skip_py_string(s, j, final)
            continue
        if c in "([{":
            stack.append(c)
        elif c in _CLOSERS:
            if not stack:
                if c != ")":
                    raise Malformed(j)
                return j
            if stack.pop() != _CLOSERS[c]:
                raise Malformed(j)
        elif c == "," and not stack:
            return j
        j += 1
    raise Incomplete


def _literal_json(text: str, at: int) -> str:
    try:
        return json.dumps(ast.literal_eval(text.strip()), ensure_ascii=False)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        raise Malformed(at) from None


class PythonicParser(ToolCallParser):
    def scan(self, buf: str, at_start: bool, final: bool) -> Scan:
        idx = buf.find("[")
        if idx < 0:
            return Scan(text=buf, consumed=len(buf))
        if idx > 0:
            return Scan(text=buf[:idx], consumed=idx)
        # "[" opens a call list only when an identifier and "(" follow.
        i = skip_ws(buf, 1)
        j = _identifier(buf, i)
        k = skip_ws(buf, j)
        if k == len(buf) and not final:
            return Scan()
        if j == i or k == len(buf) or buf[k] != "(":
            return Scan(text="[", consumed=1)
        return self._scan_block(buf, final)

    def _scan_block(self, buf: str, final: bool) -> Scan:
        def read(calls: list[PartialCall]) -> int:
            i = skip_ws(buf, 1)
            while True:
                need(buf, i)
                j = _identifier(buf, i)
                if j == i:
                    raise Malformed(i)
                k = skip_ws(buf, j)
                need(buf, k)
                if buf[k] != "(":
                    raise Malformed(k)
                calls.append(call := PartialCall(buf[i:j], "{"))
                i = skip_ws(buf, self._arguments(buf, skip_ws(buf, k + 1), call, final))
                need(buf, i)
                if buf[i] == "]":
                    return i + 1
                if buf[i] != ",":
                    raise Malformed(i)
                i = skip_ws(buf, i + 1)

        return read_block(buf, final, read)

    def _arguments(self, buf: str, i: int, call: PartialCall, final: bool) -> int:
        """Keyword arguments up to the call's ')' into ``call.arguments``; the index after it."""
        first = True
        while True:
            need(buf, i)
            if buf[i] == ")":
                call.arguments += "}"
                return i + 1
            j = _identifier(buf, i)
            if j == i or "." in buf[i:j]:
                raise Malformed(i)
            k = skip_ws(buf, j)
            need(buf, k)
            if buf[k] != "=":
                raise Malformed(k)
            v = skip_ws(buf, k + 1)
            end = _skip_py_value(buf, v, final)
            value = _literal_json(buf[v:end], v)
            call.arguments += ("" if first else ", ") + json.dumps(buf[i:j]) + ": " + value
            first = False
            if buf[end] == ",":
                end = skip_ws(buf, end + 1)
            i = end
