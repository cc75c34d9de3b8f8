"""What the Engine returns: a finished request, or a streamed piece of one."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class RequestOutput:
    rid: str
    text: str
    token_ids: list[int]  # generated tokens only
    finish_reason: str | None  # "stop", "length", "abort"; None while streaming
    meta_info: dict[str, Any] = field(default_factory=dict)  # prompt_tokens, completion_tokens, cached_tokens, ...


@dataclass
class StreamChunk:
    rid: str
    delta_text: str
    delta_token_ids: list[int]
    finish_reason: str | None
    meta_info: dict[str, Any] = field(default_factory=dict)
