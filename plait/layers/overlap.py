"""Two micro-batches through one layer with one's collectives in flight while the other computes
(two-batch overlap).

A layer's forward for overlap is a generator (``LayerOps``, a ``CollectiveOps``): it runs up to a
collective, yields the collective to launch (a tensor-parallel sum; under DP attention the gather of
every rank's rows before the MLP and the reduce-scatter after it), and is sent back its result; its
return value is the layer's output. ``run_overlapped`` drives two of them alternately: A computes to
its first collective and launches it, B computes to its first (while A's is in flight) and launches
it, A waits for its result and computes on, and so on. Every rank drives the same sequence, so the
collectives are issued in the same order on every rank (an empty micro-batch yields the same
collectives on zero rows).
"""

from __future__ import annotations

from typing import TypeVar

from plait.distributed.parallel_state import CollectiveOps, PendingReduce

R = TypeVar("R")
LayerOps = CollectiveOps[R]


def run_overlapped(ops_a: LayerOps[R], ops_b: LayerOps[R]) -> tuple[R, R]:
    ops = (ops_a, ops_b)
    results: list[R | None] = [None, None]
    pending: list[PendingReduce | None] = [None, None]
    done = [False, False]

    def advance(i: int) -> None:
        sent = pending[i].wait() if pending[i] is not None else None
        try:
            launch = ops[i].send(sent)  # type: ignore[arg-type]  # the first send must be None
        except StopIteration as stop:
            results[i], pending[i], done[i] = stop.value, None, True
            return
        pending[i] = launch()

    while not all(done):
        for i in (0, 1):
            if not done[i]:
                advance(i)
    return results[0], results[1]  # type: ignore[return-value]  # both set once done
