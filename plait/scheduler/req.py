"""Req: one generation request and its progress through the scheduler."""

from __future__ import annotations

import enum
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from plait.sampling import SamplingParams
from plait.scheduler.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from plait.sampling.grammar import GrammarMatcherState


class FinishReason(enum.StrEnum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


# A request is an identity, not a value: batch lists find and remove it by identity (eq=False), and
# comparing two requests' fields (token lists included) would be both wrong and slow.
@dataclass(eq=False)
class Req:
    rid: str
    origin_input_ids: list[int]
    sampling_params: SamplingParams
    seed: int  # every request has one: its own, or drawn at creation (draws never depend on the batch)
    # None: a front end makes the text from the token ids (a request without stop strings), so the
    # scheduler decodes nothing for it.
    detokenizer: IncrementalDetokenizer | None
    output_ids: list[int] = field(default_factory=list)
    # Memory: the request-pool row and how many positions of fill_ids have KV in req_to_token.
    req_pool_idx: int | None = None
    kv_len: int = 0
    # Radix-cache prefix matched at admission: its length and the locked tree node.
    prefix_len: int = 0
    last_node: Any = None
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    finish_reason: FinishReason | None = None
    finish_message: str | None = None
    to_abort: bool = False
    num_retractions: int = 0
    # logprobs of each output token (and top-n), filled when sampling_params.logprobs
    output_logprobs: list[float] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    # Prompt-token logprobs (sampling_params.logprob_start_len >= 0 with logprobs): one entry per
    # prompt token from logprob_start_len on; the first prompt token has no logprob (None).
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    # Overlap scheduling: tokens sampled on the device whose values the host has not read yet, and
    # where the newest one lives (the in-flight batch's next_token_ids, row index). A decode step
    # scheduled meanwhile takes its input token from there, on the device.
    pending: int = 0
    future_token: tuple[torch.Tensor, int] | None = None
    # Speculative decoding: verify steps this request took part in, and the tokens they gained
    # (accepted drafts + the bonus token); meta_info reports their ratio as spec_accept_length.
    spec_verify_ct: int = 0
    spec_accepted_tokens: int = 0
    # Constrained decoding: the matcher of the request's grammar (None when unconstrained), which has
    # accepted exactly ``output_ids`` (see plait.sampling.grammar); until the grammar is compiled,
    # ``grammar_future`` is set and admission passes the request over.
    grammar: GrammarMatcherState | None = None
    grammar_future: Future[Any] | None = None

    @property
    def next_scored_position(self) -> int | None:
        """The next prompt position whose logits score the token after it, or None when no more
        are wanted. Position q scores token q + 1; positions up to len(prompt) - 2 are scored (the
        last one's logits sample the first output token)."""
        sp = self.sampling_params
        if not sp.wants_input_logprobs:
            return None
        start = max(sp.logprob_start_len - 1, 0)
        scored = len(self.input_token_logprobs) - (1 if sp.logprob_start_len == 0 else 0)
        q = start + max(scored, 0)
        return q if q <= len(self.origin_input_ids) - 2 else None

    @property
    def fill_ids(self) -> list[int]:
        """Tokens whose KV this request needs: the prompt plus what it generated (after a
        retraction the generated tokens are re-prefilled)."""
        return self.origin_input_ids + self.output_ids

    @property
    def last_token(self) -> int:
        """The newest token of fill_ids (without building fill_ids)."""
        return self.output_ids[-1] if self.output_ids else self.origin_input_ids[-1]

    @property
    def fill_len(self) -> int:
        return len(self.origin_input_ids) + len(self.output_ids)

    @property
    def num_generated(self) -> int:
        """Tokens generated, including those still on the device."""
        return len(self.output_ids) + self.pending

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def row(self) -> int:
        """The request-pool row of an admitted request (``req_pool_idx``, checked)."""
        if self.req_pool_idx is None:
            raise RuntimeError(f"request {self.rid} holds no request-pool row (not admitted, or retired)")
        return self.req_pool_idx

    def kv_slots(self, req_to_token: torch.Tensor) -> torch.Tensor:
        return req_to_token[self.row, : self.kv_len].to(torch.int64)
