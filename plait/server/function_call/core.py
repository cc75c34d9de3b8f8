"""The streaming machinery every tool-call format shares.

A format is a pure function ``scan(buf, at_start, final) -> Scan`` over the text not yet consumed.
``ToolCallParser`` feeds it the accumulated text, turns what grew since the last scan into deltas
(normal text, a call's opening with its name, argument fragments) and drops the consumed head of
the buffer. Because a scan depends only on the text it is given, and every scan of a prefix
describes a prefix of what the scan of the longer text describes, feeding the output in any
chunking, whole or one character at a time, yields the same concatenated result. ``parse`` (the
non-streaming path) is ``feed(text)`` plus ``finish()``: one code path for both.

A scan returns one of:

* normal text: ``text`` with ``consumed >= len(text)``; text that might be the start of a marker is
  held back (not consumed) until the next character decides;
* a block of calls starting at ``buf[0]``: ``calls`` as far as they are known (a call counts once
  its name is known) and ``consumed`` 0 while the block is open, its length once it closed.

A block that turns out malformed ends at the offending character: if no call of it was named yet,
its text so far is normal text; otherwise the named calls stand as scanned and the text from the
error on is scanned again as normal text.
"""

from __future__ import annotations

import abc
import json
import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from typing import Protocol

logger = logging.getLogger(__name__)

WHITESPACE = " \t\r\n"


@dataclass
class PartialCall:
    """One call as far as a scan has read it. ``arguments`` is the raw JSON text of the arguments
    (growing by appending only)."""

    name: str | None = None
    arguments: str = ""


@dataclass
class Scan:
    text: str = ""
    calls: list[PartialCall] = field(default_factory=list)
    consumed: int = 0


@dataclass(frozen=True)
class ToolCallDelta:
    """``name`` is set on a call's first delta (with ``arguments`` ""), None on argument fragments."""

    index: int
    name: str | None
    arguments: str


@dataclass
class ParseDelta:
    normal_text: str = ""
    calls: list[ToolCallDelta] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text


class Incomplete(Exception):
    """The text ends before the construct being read does."""


class Malformed(Exception):
    """The text cannot continue the construct being read; ``at`` is the offending index."""

    def __init__(self, at: int) -> None:
        super().__init__(at)
        self.at = at


def skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in WHITESPACE:
        i += 1
    return i


def need(s: str, i: int) -> None:
    if i >= len(s):
        raise Incomplete


def holds_prefix(s: str, marker: str) -> int:
    """Length of the longest suffix of ``s`` that is a proper prefix of ``marker`` (0 if none)."""
    for k in range(min(len(s), len(marker) - 1), 0, -1):
        if marker.startswith(s[-k:]):
            return k
    return 0


def skip_json_string(s: str, i: int) -> int:
    """``s[i]`` is '"': the index after the closing quote."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        if c < " ":
            raise Malformed(j)
        j += 1
    raise Incomplete


_SCALAR_CHARS = frozenset("0123456789+-.eEtrufalsn")
_STRUCTURE_CHARS = frozenset(WHITESPACE + ",:") | _SCALAR_CHARS


def skip_json_value(s: str, i: int, final: bool) -> int:
    """The index after the JSON value starting at ``s[i]`` (no leading whitespace). Strings and
    brackets are matched exactly; scalars are checked with ``json.loads`` once they end."""
    need(s, i)
    c = s[i]
    if c == '"':
        return skip_json_string(s, i)
    if c in "{[":
        stack = [c]
        j = i + 1
        while j < len(s):
            c = s[j]
            if c == '"':
                j = skip_json_string(s, j)
                continue
            if c in "{[":
                stack.append(c)
            elif c in "}]":
                if stack.pop() != ("{" if c == "}" else "["):
                    raise Malformed(j)
                if not stack:
                    return j + 1
            elif c not in _STRUCTURE_CHARS:
                raise Malformed(j)
            j += 1
        raise Incomplete
    j = i
    while j < len(s) and s[j] in _SCALAR_CHARS:
        j += 1
    if j == i:
        raise Malformed(i)
    if j == len(s) and not final:
        raise Incomplete  # the scalar may go on
    try:
        json.loads(s[i:j])
    except ValueError:
        raise Malformed(i) from None
    return j


NAME_KEYS = ("name",)
ARGUMENT_KEYS = ("arguments", "parameters")


def scan_call_object(s: str, i: int, call: PartialCall, final: bool) -> int:
    """Read ``{"name": ..., "arguments" | "parameters": ...}`` at ``s[i]`` into ``call``; the index
    after its '}'. On Incomplete or Malformed, ``call`` holds what was read (the raw text of a
    partial arguments value included). Other keys are skipped; a call without arguments has "{}"."""
    need(s, i)
    if s[i] != "{":
        raise Malformed(i)
    i = skip_ws(s, i + 1)
    need(s, i)
    seen: set[str] = set()
    if s[i] != "}":
        while True:
            need(s, i)
            if s[i] != '"':
                raise Malformed(i)
            end = skip_json_string(s, i)
            key = json.loads(s[i:end])
            i = skip_ws(s, end)
            need(s, i)
            if s[i] != ":":
                raise Malformed(i)
            i = skip_ws(s, i + 1)
            need(s, i)
            if key in NAME_KEYS or key in ARGUMENT_KEYS:
                kind = "name" if key in NAME_KEYS else "arguments"
                if kind in seen:
                    raise Malformed(i)  # a second value would rewrite what was streamed
                seen.add(kind)
                if kind == "arguments":
                    try:
                        end = skip_json_value(s, i, final)
                    except Incomplete:
                        call.arguments = s[i:]
                        raise
                    except Malformed as e:
                        call.arguments = s[i : e.at]  # what was streamed stands
                        raise
                    call.arguments = s[i:end]
                else:
                    end = skip_json_value(s, i, final)
                    name = json.loads(s[i:end])
                    if not isinstance(name, str):
                        raise Malformed(i)
                    call.name = name
            else:
                end = skip_json_value(s, i, final)
            i = skip_ws(s, end)
            need(s, i)
            if s[i] == ",":
                i = skip_ws(s, i + 1)
                continue
            if s[i] == "}":
                break
            raise Malformed(i)
    if call.name is None:
        raise Malformed(i)
    if "arguments" not in seen:
        call.arguments = "{}"
    return i + 1


def read_block(buf: str, final: bool, read: Callable[[list[PartialCall]], int]) -> Scan:
    """The Scan of a block that begins at ``buf[0]``: ``read`` appends the calls as it meets them
    and returns the block's end, or raises Incomplete or Malformed."""
    calls: list[PartialCall] = []
    try:
        end = read(calls)
    except Incomplete:
        return block_result(buf, calls, None, len(buf) if final else None)
    except Malformed as e:
        return block_result(buf, calls, None, e.at)
    return block_result(buf, calls, end, None)


def leading_whitespace(buf: str, final: bool) -> Scan | None:
    """At the output's start: whitespace is consumed on its own (held while nothing else came, so
    a format that must open the output sees its first real character at ``buf[0]``); None when
    ``buf[0]`` is that character."""
    i = skip_ws(buf, 0)
    if i == len(buf) and not final:
        return Scan()
    if i > 0:
        return Scan(text=buf[:i], consumed=i)
    return None


def block_result(buf: str, calls: list[PartialCall], end: int | None, error_at: int | None) -> Scan:
    """The Scan of a block that began at ``buf[0]``: open (``end`` None), closed at ``end``, or
    malformed at ``error_at``."""
    if error_at is not None:
        named = [c for c in calls if c.name is not None]
        if not named:
            return Scan(text=buf[: max(error_at, 1)], consumed=max(error_at, 1))
        return Scan(calls=named, consumed=error_at)
    if end is None:
        return Scan(calls=calls)
    return Scan(calls=calls, consumed=end)


class ToolParser(Protocol):
    """What the server feeds one choice's output to: every ``--tool-call-parser`` (scan formats
    subclass ``ToolCallParser``; gpt-oss's harmony format is a state machine of its own)."""

    def feed(self, text: str) -> ParseDelta: ...

    def finish(self) -> ParseDelta: ...

    def parse(self, text: str) -> tuple[str, list[ToolCall]]: ...


class CallNumbering:
    """Turns the calls of one output, as far as they are read, into deltas: a call gets the next
    OpenAI index when its name is known, unless it is dropped (a function not in ``tool_names``,
    with a warning, as SGLang does; or past ``max_calls``); its arguments go out as what grew."""

    def __init__(self, tool_names: Collection[str], max_calls: int | None) -> None:
        self.tool_names = frozenset(tool_names)
        self.max_calls = max_calls
        self.num_calls = 0
        # Per call of the open block: its index (None: dropped), and argument characters sent.
        self._block: list[tuple[int | None, int]] = []

    def emit(self, k: int, call: PartialCall, out: ParseDelta) -> None:
        """Call ``k`` of the open block (0, 1, ... in order; each seen again as it grows)."""
        if call.name is None:
            return
        if k == len(self._block):
            index: int | None = None
            if call.name not in self.tool_names:
                logger.warning("dropping a call to %r, which is not among the request's tools", call.name)
            elif self.max_calls is not None and self.num_calls >= self.max_calls:
                logger.info("dropping call %d to %r: parallel_tool_calls is false", self.num_calls, call.name)
            else:
                index = self.num_calls
                self.num_calls += 1
                out.calls.append(ToolCallDelta(index, call.name, ""))
            self._block.append((index, 0))
        index, sent = self._block[k]
        if index is not None and len(call.arguments) > sent:
            out.calls.append(ToolCallDelta(index, None, call.arguments[sent:]))
            self._block[k] = (index, len(call.arguments))

    def close_block(self) -> None:
        self._block = []


class ToolCallParser(abc.ABC):
    """Streaming parser of one choice's output. Subclasses implement ``scan``.

    ``tool_names``: calls to other functions are dropped (with a warning), as SGLang does.
    ``max_calls``: calls past this many are dropped (``parallel_tool_calls: false`` is 1)."""

    def __init__(self, tool_names: Collection[str], max_calls: int | None = None) -> None:
        self.tool_names = frozenset(tool_names)
        self.max_calls = max_calls
        self._buf = ""
        self._only_ws_consumed = True  # nothing but whitespace consumed: the output's start
        self._calls = CallNumbering(tool_names, max_calls)
        # Trailing whitespace of the normal text so far: sent with the next text, dropped when a
        # call follows (or ends the output).
        self._held_ws = ""
        self._saw_call = False

    @abc.abstractmethod
    def scan(self, buf: str, at_start: bool, final: bool) -> Scan: ...

    def feed(self, text: str) -> ParseDelta:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> ParseDelta:
        return self._advance(final=True)

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """Non-streaming: the normal text and the calls of a complete output."""
        return accumulate([self.feed(text), self.finish()])

    def _advance(self, final: bool) -> ParseDelta:
        out = ParseDelta()
        texts: list[str] = []
        while self._buf:
            sc = self.scan(self._buf, self._only_ws_consumed, final)
            if any(c.name is not None for c in sc.calls):
                self._saw_call = True
                self._held_ws = ""  # whitespace that only separated calls is not content
            for k, call in enumerate(sc.calls):
                self._calls.emit(k, call, out)
            if sc.consumed == 0:
                assert not final, "a final scan consumes"
                break
            body = sc.text.rstrip(WHITESPACE)
            if body:
                texts.append(self._held_ws + body)
                self._held_ws = sc.text[len(body) :]
                self._only_ws_consumed = False
            else:
                self._held_ws += sc.text
            if sc.calls:
                self._only_ws_consumed = False
            self._buf = self._buf[sc.consumed :]
            self._calls.close_block()
        if final and self._held_ws and not self._saw_call:
            texts.append(self._held_ws)
        if final:
            self._held_ws = ""
        out.normal_text = "".join(texts)
        return out


def accumulate(deltas: list[ParseDelta]) -> tuple[str, list[ToolCall]]:
    """The normal text and the complete calls a sequence of deltas adds up to."""
    names: dict[int, str] = {}
    args: dict[int, list[str]] = {}
    for d in deltas:
        for c in d.calls:
            if c.name is not None:
                names[c.index] = c.name
                args[c.index] = []
            args[c.index].append(c.arguments)
    text = "".join(d.normal_text for d in deltas)
    return text, [ToolCall(names[i], "".join(args[i])) for i in sorted(names)]
