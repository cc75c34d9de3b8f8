"""Tensor-parallel group handle, passed to layers (never looked up from a global).

A ``TPGroup`` wraps one torch.distributed backend object (``ProcessGroupGloo`` on the CPU,
``ProcessGroupNCCL`` on CUDA) built from an explicit store by ``plait.parallel.launch``. The
collectives are called on that object directly instead of through ``torch.distributed``'s default
group: nothing here registers process-global state, so a process can hold several groups (or build
and drop engines one after another, as the tests do) without ``init_process_group``.
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions


@dataclass
class PendingReduce:
    """A collective in flight (``TPGroup.all_reduce_start``, ``all_gather_rows_start``,
    ``reduce_scatter_rows_start``): ``wait()`` for its result."""

    tensor: torch.Tensor
    work: Any  # the torch.distributed Work object; None when the collective is already done
    # What turns the collective's buffer into the result (drop a gather's padding, slice this rank's
    # rows); applied once, after the wait. None: the buffer is the result.
    finish: Callable[[torch.Tensor], torch.Tensor] | None = None

    def wait(self) -> torch.Tensor:
        if self.work is not None:
            self.work.wait()
            self.work = None
        if self.finish is not None:
            self.tensor, self.finish = self.finish(self.tensor), None
        return self.tensor


R = TypeVar("R")
# A collective to launch: called once, it starts the collective and returns it in flight.
Launch = Callable[[], PendingReduce]
# A computation cut at its collectives (two-batch overlap): yields each collective to launch, is sent
# its result, and returns the computation's result. ``run_serially`` drives one alone;
# plait.layers.overlap drives two interleaved.
CollectiveOps = Generator[Launch, torch.Tensor, R]


def run_serially(ops: CollectiveOps[R]) -> R:
    """Drive ``ops`` to its end, each collective waited for as soon as it is launched."""
    sent: torch.Tensor | None = None
    while True:
        try:
            launch = ops.send(sent)  # type: ignore[arg-type]  # the first send must be None
        except StopIteration as stop:
            return stop.value
        sent = launch().wait()


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed Backend (ProcessGroupGloo / ProcessGroupNCCL) when size > 1
    # CUDA: small in-place sums in one kernel over symmetric memory (plait.distributed.p2p_all_reduce).
    p2p_all_reduce: Any = None

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank must be in [0, {self.size}), got {self.rank}")
        if self.size > 1 and self.group is None:
            raise ValueError("a TPGroup of size > 1 needs its torch.distributed process group")

    def all_reduce(self, x: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> torch.Tensor:
        """In place: every rank ends with the reduction of ``x`` over the group."""
        if self.size == 1:
            return x
        if self.p2p_all_reduce is not None and op == dist.ReduceOp.SUM and self.p2p_all_reduce.fits(x):
            return self.p2p_all_reduce(x)
        self.group.allreduce([x], op).wait()
        return x

    def all_reduce_start(self, x: torch.Tensor) -> PendingReduce:
        """Launch an in-place sum of ``x`` over the group and return at once; ``wait()`` on the
        result gives the reduced tensor. Between the two the caller may launch other work, which
        then runs while the reduction is in flight (two-batch overlap). The one-kernel p2p path is
        synchronous: it finishes here."""
        if self.size == 1:
            return PendingReduce(x, None)
        if self.p2p_all_reduce is not None and self.p2p_all_reduce.fits(x):
            return PendingReduce(self.p2p_all_reduce(x), None)
        return PendingReduce(x, self.group.allreduce([x], dist.ReduceOp.SUM))

    def all_gather(self, x: torch.Tensor, timeout: timedelta | None = None) -> list[torch.Tensor]:
        """Every rank's ``x`` (same shape everywhere), in rank order. ``timeout`` overrides the
        group's collective timeout for this call."""
        if self.size == 1:
            return [x]
        parts = [torch.empty_like(x) for _ in range(self.size)]
        opts = AllgatherOptions()
        if timeout is not None:
            opts.timeout = timeout
        self.group.allgather([parts], [x.contiguous()], opts).wait()
        return parts

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        return torch.cat(self.all_gather(x), dim=-1)

    def all_gather_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """Every rank's rows stacked in rank order (rank r contributes ``counts[r]`` rows, its ``x``):
        ``[sum(counts), ...]``, rank r's rows at offset ``sum(counts[:r])``."""
        return self.all_gather_rows_start(x, counts).wait()

    def all_gather_rows_start(self, x: torch.Tensor, counts: list[int]) -> PendingReduce:
        """``all_gather_rows`` launched: returns at once, ``wait()`` gives the rows. Equal counts
        gather straight into the output; NCCL gathers uneven counts into views of it (grouped
        broadcasts); otherwise (gloo, or a rank with no rows) every rank pads to the longest and the
        padding is dropped after the gather."""
        if self.size == 1:
            return PendingReduce(x, None)
        if x.shape[0] != counts[self.rank]:
            raise ValueError(f"rank {self.rank} passes {x.shape[0]} rows but its count is {counts[self.rank]}")
        x = x.contiguous()
        out = x.new_empty(sum(counts), *x.shape[1:])
        if len(set(counts)) == 1:
            return PendingReduce(out, self.group._allgather_base(out, x))
        if _is_nccl(self.group) and min(counts) > 0:
            return PendingReduce(out, self.group.allgather([list(out.split(counts))], [x]))
        longest = max(counts)
        padded = x.new_zeros(longest, *x.shape[1:])
        padded[: x.shape[0]] = x
        full = x.new_empty(self.size * longest, *x.shape[1:])

        def unpad(full: torch.Tensor) -> torch.Tensor:
            return torch.cat([full[r * longest : r * longest + c] for r, c in enumerate(counts)])

        return PendingReduce(full, self.group._allgather_base(full, padded), unpad)

    def reduce_scatter_rows(self, x: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's rows (``counts[rank]`` of them, at offset ``sum(counts[:rank])``) of the sum
        of every rank's ``x`` (``[sum(counts), ...]``): the inverse layout of ``all_gather_rows``."""
        return self.reduce_scatter_rows_start(x, counts).wait()

    def reduce_scatter_rows_start(self, x: torch.Tensor, counts: list[int]) -> PendingReduce:
        """``reduce_scatter_rows`` launched: returns at once, ``wait()`` gives this rank's rows. A
        reduce-scatter moves half the bytes of an all-reduce; gloo with uneven counts, or a rank
        with no rows, all-reduces and slices (the same numbers)."""
        if self.size == 1:
            return PendingReduce(x, None)
        x = x.contiguous()
        out = x.new_empty(counts[self.rank], *x.shape[1:])
        if len(set(counts)) == 1:
            return PendingReduce(out, self.group._reduce_scatter_base(out, x))
        if _is_nccl(self.group) and min(counts) > 0:
            return PendingReduce(out, self.group.reduce_scatter([out], [list(x.split(counts))]))
        offset = sum(counts[: self.rank])

        def own_rows(summed: torch.Tensor) -> torch.Tensor:
            return summed[offset : offset + counts[self.rank]]

        if self.p2p_all_reduce is not None and self.p2p_all_reduce.fits(x):
            return PendingReduce(self.p2p_all_reduce(x), None, own_rows)
        return PendingReduce(x, self.group.allreduce([x], dist.ReduceOp.SUM), own_rows)

    def broadcast(self, x: torch.Tensor, src: int = 0, timeout: timedelta | None = None) -> torch.Tensor:
        """In place from ``src``. ``timeout`` overrides the group's collective timeout for this call
        (the worker's wait for the next step may last as long as the engine sits idle)."""
        if self.size == 1:
            return x
        opts = dist.BroadcastOptions()
        opts.rootRank = src
        if timeout is not None:
            opts.timeout = timeout
        self.group.broadcast([x], opts).wait()
        return x

    def min_across_ranks(self, value: int) -> int:
        """The smallest of every rank's ``value`` (e.g. KV capacities sized from each GPU's memory)."""
        if self.size == 1:
            return value
        t = torch.tensor([value], dtype=torch.int64)
        if _is_nccl(self.group):
            t = t.cuda()
        return int(self.all_reduce(t, dist.ReduceOp.MIN).item())


def _is_nccl(group: Any) -> bool:
    return type(group).__name__ == "ProcessGroupNCCL"


SINGLE = TPGroup()
