"""What overlap scheduling holds between launching a batch and reading its results: the batch's
sampled entries and the executor's asynchronous host copy of what it sampled."""

from __future__ import annotations

from dataclasses import dataclass

from plait.executor.forward_output import HostCopy
from plait.scheduler.schedule_batch import BatchEntry


@dataclass
class InFlight:
    sampled: list[BatchEntry]
    results: HostCopy | None  # None when the batch sampled nothing (non-final prefill chunks)
