"""Tokenization and chat templating of HTTP requests: off the event loop, with bounds on their input
and output, so that a huge prompt or a template that renders megabytes never stalls the server.

* Off the loop: the work runs on one worker thread (``PromptWork``). The Rust tokenizer releases the
  GIL while it encodes, so /health and the streams of other requests keep flowing; one thread because
  a Hugging Face tokenizer is not safe to call from several threads at once.
* Token-id prompts stay on the loop (``ids_only``): they need no tokenizer, only a conversion and a
  range check, pure Python that gains nothing from a thread. Sent there, each one costs two thread
  hops and competes with the loop for the GIL, which a burst of requests pays on every stream.
* Input bound: a text prompt longer than ``PREFIX_CHARS_PER_TOKEN`` characters per token of the
  request limit is first tokenized on that prefix only; when the prefix alone is over the limit the
  request is refused at once (400, context_length_exceeded) instead of tokenizing megabytes.
* Output bound: a rendered chat template longer than the request-body limit (``--max-payload-bytes``)
  is refused before it is tokenized: the messages came in a body under that limit, so a rendering
  beyond it was made by the template, not by the conversation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from plait.engine.frontend import Frontend

T = TypeVar("T")

# Characters per token beyond which a prompt is first tokenized on a prefix. Tokens of real text
# average about four characters; 16 leaves room for whitespace runs and long code tokens.
PREFIX_CHARS_PER_TOKEN = 16
# Tokens a prefix may gain or lose at its cut (the last word split differently).
CUT_MARGIN_TOKENS = 16
# Most ids (all prompts of a request together) checked on the event loop: a few ms at most.
INLINE_PROMPT_IDS = 1 << 16


class PromptTooLong(ValueError):
    """The prompt's prefix alone is over the request limit; ``min_tokens`` is a lower bound."""

    def __init__(self, min_tokens: int, chars: int, limit: int) -> None:
        self.min_tokens = min_tokens
        super().__init__(
            f"This model's maximum context length is {limit} tokens. However, the prompt alone is more than "
            f"{min_tokens} tokens (counted on its first {chars} characters). Please reduce the length of the "
            "prompt.")


def encode_bounded(frontend: Frontend, text: str, add_special_tokens: bool) -> list[int]:
    """``text``'s token ids; raises PromptTooLong early for a text far over the request limit."""
    limit = frontend.limits.max_request_tokens
    tok = frontend.tokenizer
    cut = limit * PREFIX_CHARS_PER_TOKEN
    if len(text) > cut and not frontend.auto_truncate:  # a truncated prompt keeps its end: encode it all
        head = tok.encode(text[:cut], add_special_tokens=add_special_tokens)
        if len(head) > limit + CUT_MARGIN_TOKENS:
            raise PromptTooLong(len(head) - CUT_MARGIN_TOKENS, cut, limit)
    return tok.encode(text, add_special_tokens=add_special_tokens)


def tokenize_prompt(frontend: Frontend, prompt: str | list[int]) -> list[int]:
    """Frontend.tokenize with the prefix bound for text prompts."""
    if isinstance(prompt, str) and prompt and frontend.tokenizer is not None:  # else tokenize says why not
        ids = encode_bounded(frontend, prompt, add_special_tokens=True)
        frontend.check_input_ids(ids)
        return ids
    return frontend.tokenize(prompt)


def ids_only(prompt: object) -> bool:
    """Whether a completions prompt, as the request model validated it (a string, a list of strings,
    of ints or of int lists: one kind throughout), is token ids, at most ``INLINE_PROMPT_IDS`` in all:
    cheap enough to check on the event loop. The first element tells the kind."""
    if not isinstance(prompt, list) or not prompt:
        return False
    if isinstance(prompt[0], int):
        return len(prompt) <= INLINE_PROMPT_IDS
    return isinstance(prompt[0], list) and sum(map(len, prompt)) <= INLINE_PROMPT_IDS


def check_rendered(text: str, max_chars: int) -> None:
    if len(text) > max_chars:
        raise ValueError(f"the chat template rendered {len(text)} characters, over the limit of {max_chars} "
                         "(--max-payload-bytes)")


class PromptWork:
    """The worker thread that tokenizes and renders chat templates for the HTTP process."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="plait-prompts")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
