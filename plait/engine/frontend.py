"""The front end shared by the offline Engine and the HTTP server: tokenize and validate a request.

Everything here runs before a request reaches the scheduler, in the caller's process (the Engine's
thread, or the HTTP server process), so a bad request is rejected alone and nothing is scheduled for
it. The checks need only the tokenizer and a few numbers of the running engine (``RequestLimits``);
the HTTP server gets those from the scheduler process once it has sized its KV pool.
"""

from __future__ import annotations

import dataclasses
import logging
import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from plait.sampling.params import SamplingParams

Prompt = str | Sequence[int]
ParamsLike = SamplingParams | Mapping[str, Any] | None


logger = logging.getLogger(__name__)


def to_sampling_params(params: ParamsLike) -> SamplingParams:
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    return SamplingParams.from_dict(params)


@dataclass(frozen=True)
class RequestLimits:
    """What a request is checked against: the vocabulary and the token capacity of the engine."""

    vocab_size: int
    max_context_len: int
    max_total_tokens: int  # KV pool size in tokens

    @property
    def max_request_tokens(self) -> int:
        """prompt + max_new_tokens must fit both the context and the whole KV pool."""
        return min(self.max_context_len, self.max_total_tokens)


class ContextLengthError(ValueError):
    """prompt + max_new_tokens is over the limit. The message is the Engine's wording (naming
    max_new_tokens); ``openai_message`` is the wording OpenAI clients know."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, limits: RequestLimits) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.limit = limits.max_request_tokens
        total = prompt_tokens + max_new_tokens
        super().__init__(
            f"prompt tokens ({prompt_tokens}) + max_new_tokens ({max_new_tokens}) = {total} exceeds the "
            f"limit of {self.limit} tokens (context length {limits.max_context_len}, "
            f"KV pool {limits.max_total_tokens})"
        )

    def openai_message(self, prompt_noun: str = "prompt") -> str:
        total = self.prompt_tokens + self.max_new_tokens
        return (
            f"This model's maximum context length is {self.limit} tokens. However, you requested {total} "
            f"tokens ({self.prompt_tokens} in the {prompt_noun}, {self.max_new_tokens} in the completion). "
            f"Please reduce the length of the {prompt_noun} or completion."
        )


@dataclass(frozen=True)
class PreparedRequest:
    """A validated request, ready for the scheduler (in this process or over ZMQ)."""

    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int


# Why a request that needs text is refused by an engine without a tokenizer.
NO_TOKENIZER = "which this engine does not load (skip_tokenizer_init)"


class Frontend:
    """Tokenization and validation; raises ``ValueError`` naming the field and the limit. ``tokenizer``
    None (EngineConfig.skip_tokenizer_init): prompts are token ids, and what needs text is refused."""

    def __init__(self, tokenizer: Any, limits: RequestLimits, seed: int = 0,
                 sampling_defaults: Mapping[str, Any] | None = None, constrained: bool = True,
                 auto_truncate: bool = False) -> None:
        self.tokenizer = tokenizer
        self.limits = limits
        self.constrained = constrained  # False: a grammar request is refused (EngineConfig.grammar_backend none)
        self.auto_truncate = auto_truncate  # EngineConfig.allow_auto_truncate: see fit
        # What unset sampling parameters of a mapping (or of no params) default to: the checkpoint's
        # generation_config.json values (plait.engine.generation_config). A SamplingParams is taken as is.
        self.sampling_defaults: dict[str, Any] = dict(sampling_defaults or {})
        # Seeds of unseeded requests come from one engine-seeded stream, so a run is reproducible
        # from EngineConfig.seed while the sampler never touches a global generator.
        self._seed_rng = random.Random(seed)

    def tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must not be empty")
            if self.tokenizer is None:
                raise ValueError(f"prompt: a text prompt needs the tokenizer, {NO_TOKENIZER}; send token ids "
                                 "(input_ids)")
            ids = self.tokenizer.encode(prompt, add_special_tokens=True)
        else:
            ids = list(map(int, prompt))
        self.check_input_ids(ids)
        return ids

    def check_input_ids(self, ids: Sequence[int]) -> None:
        if not ids:
            raise ValueError("prompt must not be empty (0 tokens)")
        vocab = self.limits.vocab_size
        if 0 <= min(ids) and max(ids) < vocab:  # the common case, without a Python loop over the ids
            return
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"input_ids must be in [0, {vocab}) (the vocabulary size); got {bad[:5]}")

    def sampling_params(self, params: ParamsLike) -> SamplingParams:
        if self.sampling_defaults and not isinstance(params, SamplingParams):
            if params is not None and not isinstance(params, Mapping):
                raise ValueError(f"sampling params must be a mapping, got {type(params).__name__}")
            given = {k: v for k, v in (params or {}).items() if v is not None}
            params = {**self.sampling_defaults, **given}
        sp = to_sampling_params(params)
        sp.validate_against(self.limits.vocab_size)
        if self.tokenizer is None:
            if sp.stop:
                raise ValueError(f"stop: stop strings are matched on the text, which needs the tokenizer, "
                                 f"{NO_TOKENIZER}; use stop_token_ids")
            if sp.grammar is not None:
                raise ValueError(f"{sp.grammar[0]}: constrained decoding needs the tokenizer, {NO_TOKENIZER}")
        if sp.grammar is not None and not self.constrained:
            raise ValueError(f"{sp.grammar[0]}: constrained decoding is off in this engine (grammar_backend none)")
        return sp

    def fit(self, ids: list[int], sp: SamplingParams) -> tuple[list[int], SamplingParams]:
        """The prompt and parameters a request runs with: as given when prompt + max_new_tokens fit
        the limit; else ContextLengthError, or with ``auto_truncate`` (SGLang's --allow-auto-truncate)
        a prompt over the limit keeps its last ``limit - 1`` tokens (the end holds the question and a
        chat template's assistant header) and max_new_tokens (min_new_tokens with it) shrinks to the
        room left."""
        limit = self.limits.max_request_tokens
        if len(ids) + sp.max_new_tokens <= limit:
            return ids, sp
        if not self.auto_truncate:
            raise ContextLengthError(len(ids), sp.max_new_tokens, self.limits)
        if len(ids) >= limit:
            logger.warning("a prompt of %d tokens is over the limit of %d: keeping its last %d", len(ids), limit,
                           limit - 1)
            ids = ids[len(ids) - (limit - 1):]
        room = limit - len(ids)
        return ids, dataclasses.replace(sp, max_new_tokens=room, min_new_tokens=min(sp.min_new_tokens, room))

    @staticmethod
    def check_logprob_start(num_prompt_tokens: int, sp: SamplingParams) -> None:
        """Prompt scoring starts inside the prompt."""
        if sp.wants_input_logprobs and sp.logprob_start_len >= num_prompt_tokens:
            raise ValueError(f"logprob_start_len ({sp.logprob_start_len}) must be < the prompt length "
                             f"({num_prompt_tokens} tokens)")

    def draw_seed(self, sp: SamplingParams) -> int:
        return sp.seed if sp.seed is not None else self._seed_rng.getrandbits(63)

    def prepare(self, prompt: Prompt, params: ParamsLike = None) -> PreparedRequest:
        """Validate parameters, tokenize, check the length and pick the seed, in that order."""
        sp = self.sampling_params(params)
        ids = self.tokenize(prompt)
        ids, sp = self.fit(ids, sp)
        self.check_logprob_start(len(ids), sp)
        return PreparedRequest(ids, sp, self.draw_seed(sp))
