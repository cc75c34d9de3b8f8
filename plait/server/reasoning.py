"""Reasoning parsers of ``plait serve --reasoning-parser`` (SGLang's names): they move the thinking
span of an output into ``reasoning_content``.

* ``deepseek-r1``: the output starts in reasoning (R1's template opens ``<think>`` in the prompt;
  a leading ``<think>`` in the output is dropped) until ``</think>``;
* ``qwen3``: reasoning only when the output opens with ``<think>`` (``enable_thinking: false``
  templates make the model answer directly), until ``</think>``; a ``<tool_call>`` inside the
  thinking also ends it (and stays in the content, for the tool-call parser);
* ``gpt-oss``: OpenAI's harmony format (plait.server.function_call.harmony): the ``analysis``
  channel is the reasoning, the ``final`` channel (and text without markup) the content, markers
  dropped; a tool-call message stays in the content in canonical harmony form, for
  ``--tool-call-parser gpt-oss`` (plait.server.tool_calling.ChatOutput drops it when the request
  has no tools to call).

Streaming and whole outputs give the same split: text that may be the start of a marker is held
back until the next characters decide. Leading whitespace of both parts is dropped, and so is the
whitespace just before ``</think>``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import Enum
from functools import partial
from typing import Protocol

from plait.server.function_call.core import WHITESPACE, holds_prefix
from plait.server.function_call.harmony import CALL, Event, HarmonyStream, Kind, call_header

THINK_START = "<think>"
THINK_END = "</think>"


@dataclass(frozen=True)
class ReasoningFormat:
    forced: bool  # the output begins inside the reasoning
    implicit_ends: tuple[str, ...] = ()  # markers that end the reasoning and stay in the content


THINK_FORMATS: dict[str, ReasoningFormat] = {
    "deepseek-r1": ReasoningFormat(forced=True),
    "qwen3": ReasoningFormat(forced=False, implicit_ends=("<tool_call>",)),
}


class Reasoner(Protocol):
    """One choice's reasoning split: ``feed`` / ``finish`` give (reasoning delta, content delta)."""

    def feed(self, text: str) -> tuple[str, str]: ...

    def finish(self) -> tuple[str, str]: ...

    def parse(self, text: str) -> tuple[str, str]: ...


def make_reasoning_parser(name: str) -> Reasoner:
    if name not in REASONING_PARSERS:
        raise ValueError(f"reasoning parser must be one of {', '.join(REASONING_PARSERS)}; got {name!r}")
    return REASONING_PARSERS[name]()


class _State(Enum):
    START = "start"
    REASONING = "reasoning"
    CONTENT = "content"


class ReasoningParser:
    def __init__(self, fmt: ReasoningFormat) -> None:
        self.fmt = fmt
        self._state = _State.START
        self._buf = ""
        self._strip = True  # drop whitespace at the start of the current part
        self._held_ws = ""  # trailing whitespace of the reasoning so far

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning delta, content delta)"""
        self._buf += text
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def parse(self, text: str) -> tuple[str, str]:
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    def _advance(self, final: bool) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        while True:
            if self._strip:
                self._buf = self._buf.lstrip(WHITESPACE)
                if not self._buf:
                    break
                self._strip = False
            if self._state is _State.START:
                if self._buf.startswith(THINK_START):
                    self._buf = self._buf[len(THINK_START) :]
                    self._state, self._strip = _State.REASONING, True
                    continue
                if THINK_START.startswith(self._buf) and not final:
                    break
                self._state = _State.REASONING if self.fmt.forced else _State.CONTENT
                continue
            if self._state is _State.REASONING:
                ends = [(self._buf.find(m), m) for m in (THINK_END, *self.fmt.implicit_ends)]
                hits = [(i, m) for i, m in ends if i >= 0]
                if hits:
                    i, marker = min(hits)
                    self._emit_reasoning(self._buf[:i], reasoning)
                    self._held_ws = ""
                    self._buf = self._buf[i + len(marker) :] if marker == THINK_END else self._buf[i:]
                    self._state, self._strip = _State.CONTENT, True
                    continue
                keep = 0 if final else max(holds_prefix(self._buf, m) for m in (THINK_END, *self.fmt.implicit_ends))
                self._emit_reasoning(self._buf[: len(self._buf) - keep], reasoning)
                self._buf = self._buf[len(self._buf) - keep :]
                break
            content.append(self._buf)
            self._buf = ""
            break
        return "".join(reasoning), "".join(content)

    def _emit_reasoning(self, text: str, out: list[str]) -> None:
        body = text.rstrip(WHITESPACE)
        if body:
            out.append(self._held_ws + body)
            self._held_ws = text[len(body) :]
        else:
            self._held_ws += text


class HarmonyReasoningParser:
    """``--reasoning-parser gpt-oss``: analysis to reasoning, the rest to content; a tool call goes
    on in the content as ``call_header(recipient) + arguments + <|call|>``."""

    def __init__(self) -> None:
        self._stream = HarmonyStream()

    def feed(self, text: str) -> tuple[str, str]:
        return self._split(self._stream.feed(text))

    def finish(self) -> tuple[str, str]:
        return self._split(self._stream.finish())

    def parse(self, text: str) -> tuple[str, str]:
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2

    @staticmethod
    def _split(events: list[Event]) -> tuple[str, str]:
        reasoning: list[str] = []
        content: list[str] = []
        for e in events:
            if e.kind is Kind.REASONING:
                reasoning.append(e.text)
            elif e.kind is Kind.CONTENT:
                content.append(e.text)
            else:
                content.append(call_header(e.recipient) if e.recipient is not None else e.text)
                if e.closes:
                    content.append(CALL)
        return "".join(reasoning), "".join(content)


REASONING_PARSERS: dict[str, Callable[[], Reasoner]] = {
    **{name: partial(ReasoningParser, fmt) for name, fmt in THINK_FORMATS.items()},
    "gpt-oss": HarmonyReasoningParser,
}
