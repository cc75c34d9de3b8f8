"""The two narrow contracts between the scheduler and speculative decoding.

``SchedulerAPI`` is what a speculative worker may do to the scheduler: read the request lists, admit,
reserve and give back KV slots, map slots to request positions, and commit the tokens a verify step
accepted. ``SpecWorker`` is what the scheduler calls on a speculative worker. Both live on the
scheduler floor so that ``plait.scheduler`` never imports ``plait.speculative``: the worker is built by
``plait.speculative.factory.create_spec_worker`` and handed to the ``Scheduler`` by whoever builds it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from plait.config import EngineConfig
from plait.forward_batch import ForwardBatch
from plait.scheduler.req import Req
from plait.scheduler.stats import SchedulerStats


class SchedulerAPI(Protocol):
    """The scheduler as a speculative worker sees it (``plait.scheduler.scheduler.Scheduler``).

    Ownership stays with the scheduler: a worker reserves KV slots through it and either maps them
    to a request (``map_kv_slots``, then the request's release frees them) or gives them back
    (``free_kv_slots``) within the same step."""

    config: EngineConfig
    stats: SchedulerStats

    @property
    def waiting(self) -> Sequence[Req]:
        """Requests not admitted yet, in admission order."""
        ...

    @property
    def prefilling(self) -> Sequence[Req]:
        """Admitted requests whose prefill is not complete."""
        ...

    @property
    def running(self) -> Sequence[Req]:
        """Requests decoding."""
        ...

    def num_running(self) -> int:
        """Admitted requests (prefilling and decoding)."""
        ...

    def admit(self) -> None:
        """Move waiting requests to ``prefilling`` while request rows, the prefill budget and KV allow."""
        ...

    def available_kv_tokens(self) -> int:
        """KV slots free now or after evicting the prefix cache."""
        ...

    def alloc_kv_slots(self, n: int) -> torch.Tensor | None:
        """``n`` KV slots (int64 [n]), evicting the prefix cache when short; None when the pool cannot
        hold them."""
        ...

    def free_kv_slots(self, slots: torch.Tensor) -> None:
        """Give back slots from ``alloc_kv_slots`` that no request position maps to."""
        ...

    def map_kv_slots(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """``req_to_token[rows, positions] = slots`` (broadcast like tensor indexing; one scatter)."""
        ...

    def commit_tokens(self, req: Req, tokens: Sequence[int]) -> None:
        """Append ``tokens`` to ``req`` with the stop checks (tokens after a stop are dropped; their KV
        is freed when the request is released), retire it when finished, move it to ``running`` when
        these are its first tokens, and report it in this step's output."""
        ...


class SpecWorker(Protocol):
    """A speculative decoder, as the scheduler drives it (``plait.speculative.worker.BaseSpecWorker``)."""

    def should_speculate(self) -> bool:
        """Whether this step speculates (False: a plain, overlapped decode step)."""
        ...

    def decode_step(self, sched: SchedulerAPI) -> set[int]:
        """Speculate for the running requests (overlap drained); returns ``id()`` of the requests that
        advanced, which skip this step's plain decode."""
        ...

    def after_target_forward(self, fb: ForwardBatch) -> None:
        """The scheduler ran a plain target forward (a draft model mirrors the target's KV)."""
        ...

    def joins_next_verify(self, req: Req) -> bool:
        """Whether admitted ``req``, whose prompt is cached but for its last token, would join the
        next speculative step's verify forward as one of its rows (instead of needing a forward)."""
        ...

    def on_finish(self, req: Req) -> None:
        """``req`` finished, for any reason."""
        ...

    def on_idle(self, sched: SchedulerAPI) -> None:
        """The scheduler ran out of work."""
        ...

    def log_stats(self) -> None:
        """Log the acceptance statistics."""
        ...

    def reset(self) -> None:
        """Forget what the requests so far taught it (statistics, per-request state, caches of seen
        tokens): the scheduler is back to its initial state (after the engine's warm-up)."""
        ...

    def close(self) -> None:
        """The engine is shutting down: drop device memory."""
        ...
