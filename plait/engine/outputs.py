"""What the Engine returns (a finished request, a streamed piece of one, the engine's load) and the
SGLang layout of a result, shared by the offline Engine and the server's native ``/generate``.

SGLang's layout::

    {"text": ..., "output_ids": [...], "meta_info": {"id", "finish_reason": {"type": "stop",
     "matched": <token id or string>} | {"type": "length", "length": N} | {"type": "abort",
     "message": ...}, "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency",
     and with logprobs "input_token_logprobs", "output_token_logprobs" ([logprob, token id, text or
     None] per token), "input_top_logprobs", "output_top_logprobs" (a list of such per token)}}

``RequestOutput`` and ``StreamChunk`` read as that dict (``out["text"]``, ``out["meta_info"]``) and
by attribute alike.
"""

from __future__ import annotations

import abc
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

# (token id, logprob) pairs of the best tokens at one position, best first.
TopPairs = Sequence[tuple[int, float]]
# Names a token id for logprobs (SGLang's return_text_in_logprobs); None leaves the text out.
TokenText = Callable[[int], str] | None


def finish_reason_dict(reason: str | None, message: str | None, matched: int | str | None,
                       completion_tokens: int) -> dict[str, Any] | None:
    """SGLang's finish_reason object for plait's finish reason string (None while running)."""
    if reason is None:
        return None
    if reason == "stop":
        return {"type": "stop", "matched": matched}
    if reason == "length":
        return {"type": "length", "length": completion_tokens}
    return {"type": "abort", "message": message}


def logprob_entries(logprobs: Sequence[float | None], ids: Sequence[int], text: TokenText) -> list[list[Any]]:
    """[logprob, token id, text or None] per token (SGLang's input/output_token_logprobs)."""
    return [[lp, tid, text(tid) if text else None] for lp, tid in zip(logprobs, ids, strict=True)]


def top_logprob_entries(tops: Sequence[TopPairs | None], text: TokenText) -> list[list[list[Any]] | None]:
    """Per token, its best [logprob, token id, text or None] entries (None where there are none: the
    first prompt token)."""
    return [None if pairs is None else [[lp, tid, text(tid) if text else None] for tid, lp in pairs]
            for pairs in tops]


@dataclass(frozen=True)
class LogprobLists:
    """One request's logprobs as plait keeps them, turned into SGLang's layout by ``entries``."""

    output: Sequence[float]
    output_top: Sequence[TopPairs]
    input: Sequence[float | None] = ()
    input_top: Sequence[TopPairs | None] = ()
    input_ids: Sequence[int] = ()  # the prompt tokens ``input`` scores (from logprob_start_len)
    with_top: bool = False

    def entries(self, output_ids: Sequence[int], text: TokenText) -> dict[str, Any]:
        """The four logprob fields of meta_info (the top ones only when asked for); the input ones
        are empty unless logprob_start_len asked for prompt scoring."""
        out: dict[str, Any] = {
            "input_token_logprobs": logprob_entries(self.input, self.input_ids[: len(self.input)], text),
            "output_token_logprobs": logprob_entries(self.output, output_ids, text)}
        if self.with_top:
            out["input_top_logprobs"] = top_logprob_entries(self.input_top, text)
            out["output_top_logprobs"] = top_logprob_entries(self.output_top, text)
        return out


class _DictView(abc.ABC):
    """Read a result as SGLang's dict: ``out["text"]``, ``"meta_info" in out``, ``dict(out)``."""

    @abc.abstractmethod
    def to_dict(self) -> dict[str, Any]: ...

    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def get(self, key: str, default: Any = None) -> Any:
        return self.to_dict().get(key, default)

    def keys(self) -> Any:
        return self.to_dict().keys()

    def __contains__(self, key: object) -> bool:
        return key in self.to_dict()

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())


@dataclass
class RequestOutput(_DictView):
    rid: str
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str | None  # "stop", "length", "abort"; None while streaming
    # prompt_tokens, completion_tokens, cached_tokens, SGLang's finish_reason object, logprobs, ...
    meta_info: dict[str, Any] = field(default_factory=dict)

    @property
    def output_ids(self) -> list[int]:
        """SGLang's name of ``token_ids``."""
        return self.token_ids

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": self.token_ids, "meta_info": self.meta_info}


@dataclass
class StreamChunk(_DictView):
    """One streamed piece. Attributes hold the delta; the dict view (SGLang's stream) holds the text
    and tokens so far."""

    rid: str
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    meta_info: dict[str, Any] = field(default_factory=dict)
    text: str = ""  # everything streamed so far, this chunk included
    output_ids: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"text": self.text, "output_ids": self.output_ids, "meta_info": self.meta_info}


@dataclass(frozen=True)
class EngineLoad:
    """The engine's load at one moment (``Engine.load()``)."""

    num_running: int  # admitted requests (prefilling or decoding)
    num_waiting: int  # queued, not admitted yet
    kv_tokens_in_use: int  # KV slots held by live requests (neither free nor evictable prefix cache)
    max_total_tokens: int  # KV slots in all

    @property
    def token_usage(self) -> float:
        """Fraction of the KV pool held by live requests (SGLang's token_usage)."""
        return self.kv_tokens_in_use / self.max_total_tokens if self.max_total_tokens else 0.0
