"""Per-request sampling parameters, validated once at the front end.

`SamplingParams` is read by the server (parsing), the scheduler (stop checks, token budgets) and
the sampler (device tensors), so it lives on the ground floor and imports nothing from plait but the
grammar validation of its sibling ``plait.sampling.grammar`` (loaded only when a grammar is given).
Every rejection is a `ValueError` naming the field and its limit, so a bad request fails alone at
admission instead of poisoning a batch later.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

# OpenAI caps top_logprobs at 20; larger values would also make the per-step top-k costly.
MAX_TOP_LOGPROBS = 20
# Temperatures this small turn logits into +-inf after scaling (softmax NaNs in top_p); sampling at
# them is argmax anyway, so such rows take the greedy path.
GREEDY_TEMPERATURE_EPS = 1e-5
# OpenAI's range for a logit_bias value (added to the logit before sampling).
MAX_LOGIT_BIAS = 100.0
# Seeds are hashed as 64-bit words on the device; any value that fits in 64 bits (signed or not) is
# accepted and wrapped to int64 by `seed_to_int64`.
_SEED_MIN = -(1 << 63)
_SEED_MAX = (1 << 64) - 1


def _is_int(value: Any) -> bool:
    # bool is a subclass of int, but `top_k=True` is almost certainly a client bug.
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: Any) -> bool:
    return (isinstance(value, int | float)) and not isinstance(value, bool)


def _check_int(name: str, value: Any) -> int:
    if not _is_int(value):
        raise ValueError(f"{name} must be an int, got {type(value).__name__} {value!r}")
    return value


def _check_float(name: str, value: Any) -> float:
    if not _is_real(value):
        raise ValueError(f"{name} must be a number, got {type(value).__name__} {value!r}")
    value = float(value)
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")
    return value


def _check_bool(name: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a bool, got {type(value).__name__} {value!r}")
    return value


def seed_to_int64(seed: int) -> int:
    """Wrap a 64-bit seed (signed or unsigned) to the signed int64 the device hash consumes."""
    seed &= (1 << 64) - 1
    return seed - (1 << 64) if seed >= (1 << 63) else seed


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next tokens of one request, and when to stop.

    temperature 0 (or top_k 1) means greedy. `seed=None` asks the engine for a random seed at request
    creation; the sampler itself never touches a global generator.
    """

    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # SGLang's no_stop_trim (vLLM's include_stop_str_in_output): the text keeps the stop string that
    # ended it instead of ending before it.
    no_stop_trim: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    # (token id, bias) pairs added to the logits before sampling (OpenAI's logit_bias); a mapping
    # (JSON object: string keys) is accepted and normalised to sorted pairs.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # SGLang's logprob_start_len: with logprobs, also return the logprobs of the prompt tokens from
    # this index on (prompt scoring). -1: output tokens only.
    logprob_start_len: int = -1
    # Constrained decoding (SGLang's fields; at most one). json_schema may be given as a dict; it is
    # stored as its JSON text. structural_tag is xgrammar's structural-tag JSON (str or dict).
    json_schema: str | None = None
    regex: str | None = None
    ebnf: str | None = None
    structural_tag: str | None = None

    def __post_init__(self) -> None:
        # Frozen: normalised values (int -> float, list -> tuple) are written with object.__setattr__.
        set_ = lambda name, value: object.__setattr__(self, name, value)

        max_new = _check_int("max_new_tokens", self.max_new_tokens)
        if max_new < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {max_new}")
        min_new = _check_int("min_new_tokens", self.min_new_tokens)
        if min_new < 0:
            raise ValueError(f"min_new_tokens must be >= 0, got {min_new}")
        if min_new > max_new:
            raise ValueError(f"min_new_tokens must be <= max_new_tokens ({max_new}), got {min_new}")

        temperature = _check_float("temperature", self.temperature)
        if temperature < 0:
            raise ValueError(f"temperature must be >= 0 (0 means greedy), got {temperature}")
        set_("temperature", temperature)

        top_p = _check_float("top_p", self.top_p)
        if not 0.0 < top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {top_p}")
        set_("top_p", top_p)

        top_k = _check_int("top_k", self.top_k)
        if top_k != -1 and top_k < 1:
            raise ValueError(f"top_k must be -1 (disabled) or >= 1, got {top_k}")

        min_p = _check_float("min_p", self.min_p)
        if not 0.0 <= min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {min_p}")
        set_("min_p", min_p)

        rep = _check_float("repetition_penalty", self.repetition_penalty)
        if rep <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 disables it), got {rep}")
        set_("repetition_penalty", rep)

        for name in ("frequency_penalty", "presence_penalty"):
            value = _check_float(name, getattr(self, name))
            if not -2.0 <= value <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2], got {value}")
            set_(name, value)

        if self.seed is not None:
            seed = _check_int("seed", self.seed)
            if not _SEED_MIN <= seed <= _SEED_MAX:
                raise ValueError(f"seed must fit in 64 bits ([-2**63, 2**64 - 1]), got {seed}")

        set_("stop", _normalize_stop(self.stop))
        set_("stop_token_ids", _normalize_stop_token_ids(self.stop_token_ids))

        for name in ("ignore_eos", "no_stop_trim", "logprobs", "skip_special_tokens"):
            _check_bool(name, getattr(self, name))

        set_("logit_bias", _normalize_logit_bias(self.logit_bias))
        start = _check_int("logprob_start_len", self.logprob_start_len)
        if start < -1:
            raise ValueError(f"logprob_start_len must be -1 (output tokens only) or >= 0, got {start}")

        top_logprobs = _check_int("top_logprobs", self.top_logprobs)
        if not 0 <= top_logprobs <= MAX_TOP_LOGPROBS:
            raise ValueError(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {top_logprobs}")

        if any(getattr(self, name) is not None for name in ("json_schema", "regex", "ebnf", "structural_tag")):
            # Imported here: xgrammar loads only in processes that see a constrained request.
            from plait.sampling.grammar import grammar_spec, validate_grammar

            key = grammar_spec(self.json_schema, self.regex, self.ebnf, self.structural_tag)
            assert key is not None
            set_(key[0], key[1])
            validate_grammar(key)

    # ----------------------------------------------------------------------------------------------
    @classmethod
    def field_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in dataclasses.fields(cls))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> SamplingParams:
        """Build from a plain mapping (JSON body, CLI options).

        Unknown keys are rejected rather than ignored, so a misspelt `top-p` cannot silently fall back
        to the default. A value of None means "use the default", as JSON clients send null for unset
        optional fields.
        """
        if not isinstance(d, Mapping):
            raise ValueError(f"sampling params must be a mapping, got {type(d).__name__}")
        accepted = cls.field_names()
        unknown = [k for k in d if k not in accepted]
        if unknown:
            raise ValueError(
                f"unknown sampling parameter(s) {', '.join(map(repr, unknown))}; accepted keys: {', '.join(accepted)}"
            )
        return cls(**{k: v for k, v in d.items() if v is not None})

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def samples_argmax(self) -> bool:
        """The sampler's rule for a greedy row: greedy, or a temperature too small to sample at."""
        return self.is_greedy or self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def grammar(self) -> tuple[str, str] | None:
        """The grammar constraint as (field name, text), or None: the key grammars are cached by."""
        for name in ("json_schema", "regex", "ebnf", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                return name, value
        return None

    @property
    def wants_input_logprobs(self) -> bool:
        """Prompt-token logprobs are computed (SGLang: return_logprob with logprob_start_len >= 0)."""
        return self.logprobs and self.logprob_start_len >= 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    def validate_against(self, vocab_size: int) -> None:
        """Checks that need the model: token ids must index the vocabulary."""
        if not _is_int(vocab_size) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        for tid in self.stop_token_ids:
            if not 0 <= tid < vocab_size:
                raise ValueError(f"stop_token_ids must be in [0, {vocab_size}), got {tid}")
        bad = [tid for tid, _ in self.logit_bias if not tid < vocab_size]
        if bad:
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab_size}) (the vocabulary size), "
                             f"got {bad[:5]}")


def _normalize_stop(stop: Any) -> tuple[str, ...]:
    if isinstance(stop, str):
        stop = (stop,)
    if not isinstance(stop, list | tuple):
        raise ValueError(f"stop must be a str or a list of str, got {type(stop).__name__}")
    for s in stop:
        if not isinstance(s, str):
            raise ValueError(f"stop must contain only str, got {type(s).__name__} {s!r}")
        if not s:
            raise ValueError("stop must not contain empty strings")
    return tuple(stop)


def _normalize_stop_token_ids(ids: Any) -> tuple[int, ...]:
    if not isinstance(ids, list | tuple):
        raise ValueError(f"stop_token_ids must be a list of int, got {type(ids).__name__}")
    for tid in ids:
        if not _is_int(tid):
            raise ValueError(f"stop_token_ids must contain only int, got {type(tid).__name__} {tid!r}")
        if tid < 0:
            raise ValueError(f"stop_token_ids must be >= 0, got {tid}")
    return tuple(ids)


def _normalize_logit_bias(bias: Any) -> tuple[tuple[int, float], ...]:
    if isinstance(bias, Mapping):
        items = list(bias.items())
    elif isinstance(bias, list | tuple):
        items = [tuple(pair) for pair in bias]
        if any(len(pair) != 2 for pair in items):
            raise ValueError("logit_bias must map token ids to numbers (an object, or (id, bias) pairs)")
    else:
        raise ValueError(f"logit_bias must map token ids to numbers, got {type(bias).__name__}")
    out: dict[int, float] = {}
    for key, value in items:
        if isinstance(key, str) and key.strip().lstrip("-").isdigit():
            tid = int(key)
        elif _is_int(key):
            tid = key
        else:
            raise ValueError(f"logit_bias keys must be token ids (integers), got {key!r}")
        if tid < 0:
            raise ValueError(f"logit_bias keys must be token ids >= 0, got {tid}")
        v = _check_float(f"logit_bias[{key!r}]", value)
        if not -MAX_LOGIT_BIAS <= v <= MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}], "
                             f"got {v:g} for token {tid}")
        out[tid] = v
    return tuple(sorted(out.items()))
