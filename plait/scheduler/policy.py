"""The order in which admission takes waiting requests (SGLang's ``--schedule-policy``).

``fcfs`` keeps arrival order (a retracted request goes back to the front). The others sort the
queue before each admission round; the sort is stable, so ties stay in arrival order:

* ``lpm``: longest cached prefix first, so requests sharing a prefix run while it is cached. Each
  waiting request is matched against the radix cache, which costs a tree walk per request: over
  ``LPM_MAX_QUEUE`` waiting requests it falls back to arrival order, as SGLang does.
* ``lof``: longest output (``max_new_tokens``) first.
* ``random``: a shuffle from the engine's seed.

The order decides only when a request starts, never its tokens.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from typing import Protocol

from plait.scheduler.req import Req

# Over this many waiting requests lpm keeps arrival order (SGLang's limit): matching every request
# against the tree each round would cost more than the cache hits it finds.
LPM_MAX_QUEUE = 128


class PrefixMatcher(Protocol):
    def cached_prefix_len(self, ids: list[int]) -> int: ...


class SchedulePolicy:
    def __init__(self, name: str, seed: int) -> None:
        self.name = name
        self._rng = random.Random(seed)

    def order(self, waiting: Sequence[Req], cache: PrefixMatcher) -> list[Req] | None:
        """``waiting`` in the order admission should take it, or None to keep the queue as it is."""
        if self.name == "fcfs" or len(waiting) < 2:
            return None
        key: Callable[[Req], int]
        if self.name == "lpm":
            if len(waiting) > LPM_MAX_QUEUE:
                return None
            lengths = {id(r): cache.cached_prefix_len(r.fill_ids) for r in waiting}
            key = lambda r: -lengths[id(r)]  # noqa: E731
        elif self.name == "lof":
            key = lambda r: -r.sampling_params.max_new_tokens  # noqa: E731
        elif self.name == "random":
            shuffled = list(waiting)
            self._rng.shuffle(shuffled)
            return shuffled
        else:
            raise ValueError(f"unknown schedule policy {self.name!r}")
        return sorted(waiting, key=key)
