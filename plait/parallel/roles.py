"""The two front objects of every engine layout, as the engine core holds them.

A layout (one device, a tensor-parallel leader, data-parallel replicas, DP attention) is built as a
runner and a scheduler. The classes differ per layout; these Protocols are the calls an engine core
and its front ends make on them, and every layout's classes answer them explicitly (no attribute
forwarding):

  EngineRunner     ModelRunner (and its TPLeaderRunner / DPAttentionLeader subclasses),
                   DataParallelRunner
  EngineScheduler  Scheduler, DataParallelScheduler, DPAttentionScheduler

What a Scheduler itself drives is one rank's ``ModelRunner`` (or a subclass): that class is the
contract there.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch

from plait.models.loader import ModelConfig
from plait.scheduler.interface import SpecWorker
from plait.scheduler.req import Req
from plait.scheduler.stats import SchedulerStats

# Observer of every sampled step: (the requests, their float32 logits rows).
LogitsObserver = Callable[[list[Req], torch.Tensor], None]


class EngineRunner(Protocol):
    """What an engine core and its front ends read from a layout's runner."""

    device: str
    model_config: ModelConfig
    max_context_len: int
    max_total_tokens: int  # KV slots one request may use (one replica's pool)

    @property
    def total_kv_tokens(self) -> int:
        """KV slots over every pool of the layout (the replicas' sum; one pool otherwise)."""
        ...

    def info(self) -> dict[str, Any]: ...
    def close(self) -> None: ...


class PrefixCacheSizes(Protocol):
    """The prefix-cache view front ends read (metrics, leak checks, benchmark resets)."""

    def evictable_size(self) -> int: ...
    def protected_size(self) -> int: ...
    def total_size(self) -> int: ...
    def reset(self) -> None: ...


class EngineScheduler(Protocol):
    """What an engine core and its front ends call on a layout's scheduler."""

    on_logits: LogitsObserver | None

    @property
    def spec_worker(self) -> SpecWorker | None: ...
    @property
    def waiting(self) -> Any: ...  # a sequence of Req (the plain scheduler keeps a deque)
    @property
    def prefilling(self) -> list[Req]: ...
    @property
    def running(self) -> list[Req]: ...
    @property
    def stats(self) -> SchedulerStats: ...
    @property
    def tree_cache(self) -> PrefixCacheSizes: ...
    @property
    def max_request_tokens(self) -> int: ...

    def add_request(self, req: Req) -> None: ...
    def abort(self, rid: str) -> bool: ...
    def has_work(self) -> bool: ...
    def step(self) -> list[Req]: ...
    def flush(self) -> list[Req]: ...
    def num_running(self) -> int: ...
    def kv_tokens_in_use(self) -> int: ...
    def close(self) -> None: ...
