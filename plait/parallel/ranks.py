"""The ranks an engine process spawned: their failure reports, liveness and shutdown.

Shared by both leaders (``TPLeaderRunner`` in ``launch`` and ``DPAttentionLeader`` in
``dp_attention``), which is why it is a module of its own: neither of those imports the other for it.

``DistGroups`` (the groups every rank builds) lives here for the same reason.

A spawned rank whose startup fails writes its traceback under ``ERROR_KEY`` in the rendezvous store;
a rank that reached the store sets ``JOINED_KEY``. Rank 0 reads both.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing.process import BaseProcess

import torch.distributed as dist

from plait.distributed.parallel_state import TPGroup

ERROR_KEY = "plait/error/{rank}"
JOINED_KEY = "plait/joined/{rank}"
JOIN_POLL_S = 0.05  # how often rank 0 polls the store and its processes

RankProcesses = dict[int, BaseProcess]  # rank -> the process this engine process started for it


@dataclass(frozen=True)
class DistGroups:
    """The process groups of one engine's ranks."""

    tp: TPGroup  # model collectives and the device payload of each step
    control: TPGroup  # gloo, host tensors: step headers (may be ``tp`` itself on the CPU)
    store: dist.Store | None = None  # the rendezvous store (DP attention's symmetric buffers rendezvous through it)


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank died, hung past the collective timeout, or failed to start."""


def worker_error(store: dist.Store, rank: int) -> str | None:
    """The startup traceback rank ``rank`` left in the store, if any."""
    key = ERROR_KEY.format(rank=rank)
    try:
        if store.check([key]):
            return store.get(key).decode()
    except Exception:  # noqa: BLE001 (the store lives in this process; best effort anyway)
        return None
    return None


def dead_rank(procs: RankProcesses, store: dist.Store) -> str | None:
    """A message naming the first spawned rank that is no longer alive (None: all alive)."""
    for rank, proc in procs.items():
        if not proc.is_alive():
            detail = worker_error(store, rank)
            return f"tp rank {rank} (pid {proc.pid}) exited with code {proc.exitcode}" + (
                f":\n{detail}" if detail else "")
    return None


def stop_processes(procs: RankProcesses, grace_s: float = 10.0) -> None:
    """Join every process within ``grace_s`` in all, then kill the ones still alive."""
    deadline = time.monotonic() + grace_s
    for proc in procs.values():
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs.values():
        if proc.is_alive():
            proc.kill()
            proc.join(5)


class SpawnedRanks:
    """A leader's view of the ranks it spawned (``procs``: rank -> process) and of the engine's
    failure: once a rank is found dead or a collective fails, every later step raises at once."""

    def __init__(self, what: str, procs: RankProcesses, store: dist.Store) -> None:
        self.what = what  # "tensor-parallel" / "DP-attention": how errors name the engine
        self.procs = procs
        self.store = store
        self.failure: str | None = None

    def check(self) -> None:
        """Raise TensorParallelError when the engine failed earlier or a spawned rank is gone."""
        if self.failure is not None:
            raise TensorParallelError(f"the {self.what} engine failed earlier: {self.failure}")
        dead = dead_rank(self.procs, self.store)
        if dead is not None:
            self.failure = dead
            raise TensorParallelError(dead)

    def fail(self, e: Exception, timeout_s: float) -> TensorParallelError:
        """Record the failure behind a failed collective (a peer died, closed its socket or timed
        out) and return the error to raise."""
        time.sleep(JOIN_POLL_S)  # a peer whose socket just closed is usually reaped by now
        self.failure = dead_rank(self.procs, self.store) or (
            f"a {self.what} collective failed (a rank died or exceeded dist_timeout={timeout_s:g}s): "
            f"{type(e).__name__}: {e}")
        return TensorParallelError(self.failure)

    def stop(self) -> None:
        """Wait for the ranks to exit; a failed engine's ranks may be stuck in a collective, so they
        are killed without a grace period."""
        stop_processes(self.procs, grace_s=10.0 if self.failure is None else 0.0)
