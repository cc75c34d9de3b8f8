"""What overlap scheduling holds between launching a batch and reading its results: the batch's
sampled entries and the asynchronous host copy of what it sampled."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.sampling import SampleOutput
from plait.scheduler.schedule_batch import BatchEntry


@dataclass
class HostCopy:
    """Sampled ids (and logprobs) copied to the host asynchronously: started right after the
    sampler, so reading them later waits for that batch only, not for a batch launched after it."""

    tensors: list[torch.Tensor | None]
    event: torch.cuda.Event | None

    @classmethod
    def start(cls, out: SampleOutput) -> HostCopy:
        raw = [out.next_token_ids, out.logprobs, out.top_logprobs_ids, out.top_logprobs_vals]
        if not out.next_token_ids.is_cuda:
            return cls(raw, None)
        host = []
        for t in raw:
            if t is None:
                host.append(None)
                continue
            buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            buf.copy_(t, non_blocking=True)
            host.append(buf)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def wait(self) -> tuple[list, list | None, list | None, list | None]:
        if self.event is not None:
            self.event.synchronize()
        ids, lp, top_ids, top_vals = (t.tolist() if t is not None else None for t in self.tensors)
        return ids, lp, top_ids, top_vals  # type: ignore[return-value]


@dataclass
class InFlight:
    sampled: list[BatchEntry]
    results: HostCopy | None  # None when the batch sampled nothing (non-final prefill chunks)
