"""What overlap scheduling holds between launching a batch and reading its results: the batch's
sampled entries and the executor's asynchronous host copy of what it sampled.

A constrained batch is held first with its forward launched and sampling still to do
(``unsampled``): its vocabulary masks need the previous batch's tokens, so the scheduler samples it
after processing that batch (``Scheduler._sample``), which sets ``results``."""

from __future__ import annotations

from dataclasses import dataclass

from plait.executor.forward_output import ForwardOutput, HostCopy
from plait.forward_batch import ForwardBatch
from plait.scheduler.schedule_batch import BatchEntry


@dataclass
class InFlight:
    sampled: list[BatchEntry]
    results: HostCopy | None  # None when the batch sampled nothing (non-final prefill chunks) or not yet
    unsampled: tuple[ForwardBatch, ForwardOutput] | None = None  # forward done, sampler not run yet
