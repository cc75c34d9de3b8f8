"""What one executor step returns: the logits, the sampled ids on the device, and their host copy.

The host copy starts right after the sampler, on the same stream, and records an event: reading it
later waits for that step only, never for a step launched after it. This is what lets the scheduler
launch step N+1 before it reads step N's tokens (overlap scheduling) without a device sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import NamedTuple

import torch

from plait.forward_batch import InputLogprobRows
from plait.models.llama import LogitsOutput
from plait.sampling import SampleOutput
from plait.transfer import pinned_copy


class HostResults(NamedTuple):
    """One step's sampled results as host lists (row i: the batch's i-th sampled request)."""

    next_token_ids: list[int]
    logprobs: list[float] | None
    top_logprobs_ids: list[list[int]] | None
    top_logprobs_vals: list[list[float]] | None


class InputLogprobs(NamedTuple):
    """Prompt-token logprobs of one forward as host lists, one entry per scored position (in the
    order of ``InputLogprobRows.rows``): the logprob of the prompt token that follows the position
    under the model's raw distribution (no penalties, no temperature), and the best ``top_k``."""

    logprobs: list[float]
    top_ids: list[list[int]] | None
    top_vals: list[list[float]] | None


def score_prompt_rows(logits: LogitsOutput, plan: InputLogprobRows) -> tuple[InputLogprobs, LogitsOutput]:
    """Split a forward's logits into the prompt positions it scores (read to the host here: a
    synchronisation, paid only by batches that score prompts) and the rows the sampler reads."""
    rows = logits.next_token_logits
    logp = torch.log_softmax(rows[plan.rows].float(), dim=-1)
    chosen = logp.gather(1, plan.next_ids[:, None]).squeeze(1).tolist()
    top_ids = top_vals = None
    if plan.top_k > 0:
        vals, ids = logp.topk(min(plan.top_k, logp.shape[1]), dim=-1, sorted=True)
        top_ids, top_vals = ids.tolist(), vals.tolist()
    return InputLogprobs(chosen, top_ids, top_vals), dataclasses.replace(
        logits, next_token_logits=rows[plan.sample_rows])


@dataclass
class HostCopy:
    """Sampled ids (and logprobs) copied to pinned host memory asynchronously. On the CPU the
    tensors are the sampler's own and ``event`` is None."""

    tensors: list[torch.Tensor | None]  # next_token_ids, logprobs, top ids, top values
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, out: SampleOutput) -> HostCopy:
        raw = [out.next_token_ids, out.logprobs, out.top_logprobs_ids, out.top_logprobs_vals]
        if not out.next_token_ids.is_cuda:
            return cls(raw, None)
        host: list[torch.Tensor | None] = []
        for t in raw:
            if t is None:
                host.append(None)
                continue
            host.append(pinned_copy(t))
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def wait(self) -> HostResults:
        """Block until this step's copy landed (this step only) and return it as lists."""
        if self.event is not None:
            self.event.synchronize()
        ids, lp, top_ids, top_vals = (t.tolist() if t is not None else None for t in self.tensors)
        assert ids is not None
        return HostResults(ids, lp, top_ids, top_vals)


@dataclass(frozen=True)
class ForwardOutput:
    """The result of ``ModelRunner.forward_batch``. ``sample`` and ``host_copy`` are None when the
    batch samples nothing (``fb.sampling_info`` is None: a non-final prefill chunk)."""

    logits: LogitsOutput
    sample: SampleOutput | None = None
    host_copy: HostCopy | None = None
    input_logprobs: InputLogprobs | None = None  # when the batch scores prompt positions
