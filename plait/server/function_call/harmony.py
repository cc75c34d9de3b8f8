"""OpenAI's harmony format, as gpt-oss writes it after a prompt that ends in ``<|start|>assistant``:

    <|channel|>analysis<|message|>The user wants the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_time <|constrain|>json<|message|>{"tz": "CET"}<|call|>

(no line break between the messages). A message is a header (the role after ``<|start|>``, the
channel after ``<|channel|>``, a recipient ``to=...`` in either part, a content type such as
``<|constrain|>json``), ``<|message|>``, the body, and an end: ``<|end|>``, ``<|call|>`` (a tool
call), ``<|return|>`` (the final answer), ``<|endoftext|>``, or a ``<|start|>`` / ``<|channel|>``
that opens the next message without one. The first message's role is in the prompt.

``HarmonyStream`` cuts an output into events, fed in any chunking with the same result (a tail
that may be the start of a marker is held back until the next characters decide):

* the body of an ``analysis`` message is reasoning;
* a message with a recipient is a tool call: the name is the recipient without ``functions.``, the
  arguments the body with its surrounding whitespace dropped (``{}`` when empty);
* every other body (``final``, a ``commentary`` preamble without recipient) and text outside any
  message (an output with no harmony markup at all) is content.

Headers and markers are never content. The markers are special tokens of gpt-oss's tokenizer:
the server keeps them in the output text when a gpt-oss parser is configured
(``skip_special_tokens`` false), and the parsers here take them out again.

``HarmonyToolParser`` is ``--tool-call-parser gpt-oss``: content is normal text, calls are calls,
the reasoning is dropped (as SGLang's gpt-oss detector does). ``--reasoning-parser gpt-oss``
(plait.server.reasoning) takes the reasoning and passes calls on in canonical harmony form, so
the two together give reasoning_content, content and tool_calls of one output.
"""

from __future__ import annotations

import re
from collections.abc import Collection
from dataclasses import dataclass
from enum import Enum

from plait.server.function_call.core import (
    WHITESPACE,
    CallNumbering,
    ParseDelta,
    PartialCall,
    ToolCall,
    accumulate,
    holds_prefix,
)

START = "<|start|>"
END = "<|end|>"
MESSAGE = "<|message|>"
CHANNEL = "<|channel|>"
CONSTRAIN = "<|constrain|>"
RETURN = "<|return|>"
CALL = "<|call|>"
END_OF_TEXT = "<|endoftext|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, END_OF_TEXT)
# Markers that end a message's body.
MESSAGE_ENDS = (END, CALL, RETURN, END_OF_TEXT)
# A recipient at the very start of the output continues the prompt's ``<|start|>assistant``.
ROLE_RECIPIENTS = (" to=", "to=")
FUNCTIONS = "functions."

_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")


def call_header(recipient: str) -> str:
    """The canonical opening of a tool-call message to ``recipient`` (as the model writes it)."""
    return f"{START}assistant{CHANNEL}commentary to={recipient} {CONSTRAIN}json{MESSAGE}"


class Kind(Enum):
    REASONING = "reasoning"
    CONTENT = "content"
    CALL = "call"  # a call's arguments (the first event of a call carries its recipient)


@dataclass(frozen=True)
class Event:
    """``text`` of ``kind``; a CALL event with ``recipient`` set opens a call (text ""), one with
    ``closes`` ends it."""

    kind: Kind
    text: str = ""
    recipient: str | None = None
    closes: bool = False


class _State(Enum):
    OUTSIDE = "outside"  # between messages (or an output without markup)
    HEADER = "header"  # after <|start|> or <|channel|>, before <|message|>
    BODY = "body"


def _earliest_marker(buf: str) -> tuple[int, str] | None:
    hits = [(i, m) for m in MARKERS if (i := buf.find(m)) >= 0]
    return min(hits) if hits else None


class HarmonyStream:
    """One output's events as its text arrives (``feed``), then ``finish`` at its end. State moves
    only on consumed text, so the events depend on the text, not on its chunking."""

    def __init__(self) -> None:
        self._buf = ""
        self._state = _State.OUTSIDE
        self._at_start = True  # nothing consumed yet
        self._header = ""  # the open header's text, markers included
        self._kind = Kind.CONTENT  # the open body's
        self._args_sent = False  # the open call sent argument text
        self._held_ws = ""  # the open call's trailing whitespace

    def feed(self, text: str) -> list[Event]:
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> list[Event]:
        out = self._advance(final=True)
        if self._state is _State.BODY:
            self._close(out)
        self._state, self._header = _State.OUTSIDE, ""
        return out

    def _advance(self, final: bool) -> list[Event]:
        out: list[Event] = []
        while self._buf:
            if self._at_start and self._state is _State.OUTSIDE:
                if any(r.startswith(self._buf) for r in ROLE_RECIPIENTS) and not final:
                    break  # " to" may yet be a recipient
                if self._buf.startswith(ROLE_RECIPIENTS):
                    self._state, self._header = _State.HEADER, ""
            self._at_start = False
            hit = _earliest_marker(self._buf)
            if hit is None:
                keep = 0 if final else max(holds_prefix(self._buf, m) for m in MARKERS)
                self._take(self._buf[: len(self._buf) - keep], out)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            i, marker = hit
            self._take(self._buf[:i], out)
            self._buf = self._buf[i:]
            self._marker(marker, out)
        return out

    def _take(self, text: str, out: list[Event]) -> None:
        """Text between markers, in the current state."""
        if not text:
            return
        if self._state is _State.HEADER:
            self._header += text
        elif self._state is _State.OUTSIDE:
            out.append(Event(Kind.CONTENT, text))
        elif self._kind is Kind.CALL:
            body = text.rstrip(WHITESPACE)
            if not self._args_sent:
                body = body.lstrip(WHITESPACE)
                if not body:
                    return
            if body:
                out.append(Event(Kind.CALL, self._held_ws + body))
                self._args_sent = True
                self._held_ws = text[len(text.rstrip(WHITESPACE)) :]
            else:
                self._held_ws += text
        else:
            out.append(Event(self._kind, text))

    def _marker(self, marker: str, out: list[Event]) -> None:
        """``self._buf`` starts with ``marker``: consume it (unless it opens the next message)."""
        state = self._state
        if state is _State.BODY:
            if marker in (START, CHANNEL):  # the next message, without an end marker
                self._close(out)
                self._state = _State.OUTSIDE
                return
            self._buf = self._buf[len(marker) :]
            if marker in MESSAGE_ENDS:
                self._close(out)
                self._state = _State.OUTSIDE
            else:  # <|message|> or <|constrain|> inside a body: its text
                self._take(marker, out)
            return
        self._buf = self._buf[len(marker) :]
        if marker == START:
            self._state, self._header = _State.HEADER, ""
        elif marker in (CHANNEL, CONSTRAIN):
            if state is _State.OUTSIDE:
                self._state, self._header = _State.HEADER, ""
            self._header += marker
        elif marker == MESSAGE:
            self._open(self._header if state is _State.HEADER else "", out)
        else:  # a message end outside a body: nothing to end
            self._state, self._header = _State.OUTSIDE, ""

    def _open(self, header: str, out: list[Event]) -> None:
        self._state, self._header = _State.BODY, ""
        recipient = _RECIPIENT.search(header)
        channel = _CHANNEL.search(header)
        if recipient is not None:
            self._kind, self._args_sent, self._held_ws = Kind.CALL, False, ""
            out.append(Event(Kind.CALL, recipient=recipient.group(1)))
        elif channel is not None and channel.group(1) == "analysis":
            self._kind = Kind.REASONING
        else:
            self._kind = Kind.CONTENT

    def _close(self, out: list[Event]) -> None:
        if self._kind is Kind.CALL:
            out.append(Event(Kind.CALL, "" if self._args_sent else "{}", closes=True))
        self._kind = Kind.CONTENT


class HarmonyToolParser:
    """``--tool-call-parser gpt-oss`` (plait.server.function_call.core.ToolParser): calls to
    ``functions.NAME`` for the request's tools; content as normal text; reasoning dropped."""

    def __init__(self, tool_names: Collection[str], max_calls: int | None = None) -> None:
        self._stream = HarmonyStream()
        self._calls = CallNumbering(tool_names, max_calls)
        self._open: PartialCall | None = None
        self._k = 0  # calls opened so far: the numbering's ordinal of the open one

    def feed(self, text: str) -> ParseDelta:
        return self._deltas(self._stream.feed(text))

    def finish(self) -> ParseDelta:
        return self._deltas(self._stream.finish())

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        return accumulate([self.feed(text), self.finish()])

    def _deltas(self, events: list[Event]) -> ParseDelta:
        out = ParseDelta()
        texts: list[str] = []
        for e in events:
            if e.kind is Kind.CONTENT:
                texts.append(e.text)
            elif e.kind is Kind.CALL:
                if e.recipient is not None:
                    name = e.recipient[len(FUNCTIONS):] if e.recipient.startswith(FUNCTIONS) else e.recipient
                    self._open = PartialCall(name)
                else:
                    assert self._open is not None
                    self._open.arguments += e.text
                self._calls.emit(self._k, self._open, out)
                if e.closes:
                    self._open = None
                    self._k += 1
        out.normal_text = "".join(texts)
        return out
