"""Two micro-batches through one layer with one's tensor-parallel sums in flight while the other
computes (two-batch overlap).

A layer's forward for overlap is a generator (``LayerOps``): it runs up to a collective, yields the
unreduced partial sum, and is sent back the reduced tensor; its return value is the layer's output.
``run_overlapped`` drives two of them alternately: A computes to its first sum and launches it, B
computes to its first sum (while A's is in flight) and launches it, A waits for its sum and computes
on, and so on. Every rank drives the same sequence, so the collectives are issued in the same order
on every rank.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TypeVar

import torch

from plait.distributed.parallel_state import PendingReduce, TPGroup

R = TypeVar("R")
# yields: a partial sum to reduce; is sent: the reduced tensor; returns: the layer's output
LayerOps = Generator[torch.Tensor, torch.Tensor, R]


def run_overlapped(ops_a: LayerOps[R], ops_b: LayerOps[R], tp: TPGroup) -> tuple[R, R]:
    ops = (ops_a, ops_b)
    results: list[R | None] = [None, None]
    pending: list[PendingReduce | None] = [None, None]
    done = [False, False]

    def advance(i: int) -> None:
        sent = pending[i].wait() if pending[i] is not None else None
        try:
            partial = ops[i].send(sent)  # type: ignore[arg-type]  # the first send must be None
        except StopIteration as stop:
            results[i], pending[i], done[i] = stop.value, None, True
            return
        pending[i] = tp.all_reduce_start(partial)

    while not all(done):
        for i in (0, 1):
            if not done[i]:
                advance(i)
    return results[0], results[1]  # type: ignore[return-value]  # both set once done

