"""Small helpers shared by tests (prompt sets, engine construction, leak checks, two-rank runs)."""

from __future__ import annotations

import multiprocessing as mp
import pathlib
import socket
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

import plait
from plait.distributed.parallel_state import TPGroup


def pid_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, exited but not reaped by its parent, does not)."""
    try:
        stat = pathlib.Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


# Eight prompts of different lengths (as token ids so they do not depend on the tokenizer).
def prompt_ids(n: int = 8, vocab_hi: int = 400, seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    lengths = [3, 7, 12, 5, 20, 9, 31, 16, 4, 11, 25, 6, 14, 8, 19, 10][:n]
    return [torch.randint(4, vocab_hi, (n_,), generator=gen).tolist() for n_ in lengths]


def make_engine(path: pathlib.Path, **options: Any) -> plait.Engine:
    options.setdefault("max_total_tokens", 8192)
    options.setdefault("device", "cpu")
    return plait.Engine(model=str(path), **options)


def single_rank_outputs(path: pathlib.Path, prompts: list[list[int]], params: dict[str, Any]
                        ) -> dict[tuple[int, ...], list[int]]:
    """Token ids one plain engine (one rank, no parallelism) generates, keyed by prompt: the reference
    a parallel layout's output must equal."""
    with make_engine(path) as single:
        return {tuple(p): o.token_ids for p, o in zip(prompts, single.generate(prompts, params), strict=True)}


def count_calls(obj: Any, name: str) -> list[int]:
    """Wrap ``obj.name`` to count its calls: the returned one-item list holds the count."""
    calls = [0]
    inner = getattr(obj, name)

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls[0] += 1
        return inner(*args, **kwargs)

    setattr(obj, name, counted)
    return calls


def assert_no_leaks(engine: plait.Engine) -> None:
    """After every request finished: no KV slot held outside the prefix cache, no pool row in use."""
    sched = engine.scheduler
    assert not sched.has_work()
    assert sched.kv_tokens_in_use() == 0, "KV slots leaked"
    assert sched.tree_cache.protected_size() == 0, "prefix-cache nodes still locked"
    pool = engine.runner.req_to_token_pool
    assert pool.available_size() == pool.size, "request-pool rows leaked"


def assert_no_leaks_on_every_dp_rank(engine: plait.Engine) -> None:
    """``assert_no_leaks`` on rank 0 of a DP-attention engine, and no KV slot in use on rank 1 (rank 1
    reports its KV use in the round exchange after the round that freed it: two more rounds run)."""
    assert_no_leaks(engine)
    sched = engine.scheduler
    for _ in range(2):
        sched.step()
    assert sched.remote_kv_tokens_in_use == {1: 0}, "rank 1: KV slots leaked"


class TwoRankControl:
    """Rank 0 of a two-rank DP-attention control group whose other rank sends ``other`` (a
    ``plait.parallel.dp_attention.RankCounts``) in the count exchange: ``MLPCountSync`` without a
    second process."""

    rank, size = 0, 2

    def __init__(self, other: Any) -> None:
        self.other = other

    def all_gather(self, t: torch.Tensor, timeout: timedelta | None = None) -> list[torch.Tensor]:
        return [t.clone(), self.other.to_tensor()]


GREEDY: dict[str, Any] = {"temperature": 0.0, "max_new_tokens": 32}


def two_rank_group(port: int, rank: int, nccl: bool = False) -> TPGroup:
    """Rank ``rank`` of a two-rank group over a TCP store at ``port`` (gloo, or NCCL on GPU ``rank``)."""
    if nccl:
        return two_rank_nccl(port, rank)[1]
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    return TPGroup(rank, 2, dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30)))


def two_rank_nccl(port: int, rank: int) -> tuple[Any, TPGroup]:
    """The TCP store at ``port`` and rank ``rank``'s NCCL group over it, on GPU ``rank`` (made current)."""
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    torch.cuda.set_device(rank)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=30)
    return store, TPGroup(rank, 2, dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, 2, opts))


def run_two_ranks(rank_fn: Callable[[int, int], None], timeout_s: float = 60, spawn_both: bool = False) -> None:
    """``rank_fn(port, rank)``: rank 1 in a spawned process, rank 0 here (a module-level function, or a
    partial of one, so that it pickles), or both spawned (``spawn_both``: for state that must start
    fresh in every rank's process, such as symmetric memory's rendezvous sequence). A spawned rank's
    assertions show in its exit code."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=rank_fn, args=(port, r)) for r in ((0, 1) if spawn_both else (1,))]
    for proc in procs:
        proc.start()
    try:
        if not spawn_both:
            rank_fn(port, 0)
        for proc in procs:
            proc.join(timeout_s)
        assert [proc.exitcode for proc in procs] == [0] * len(procs)  # the spawned ranks' assertions held
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()


class _RecordedCudaGraph:
    """Stands in for torch.cuda.CUDAGraph where there is no CUDA: records the calls made on it."""

    log: list[str] = []

    def __init__(self) -> None:
        self.index = sum(1 for e in self.log if e.startswith("begin"))

    def capture_begin(self, pool: Any = None) -> None:
        self.log.append(f"begin {self.index} pool={pool}")

    def capture_end(self) -> None:
        self.log.append(f"end {self.index}")

    def replay(self) -> None:
        self.log.append(f"replay {self.index}")


def record_cuda_graph_calls(monkeypatch: Any) -> list[str]:
    """Make torch.cuda.CUDAGraph a recorder (capture streams and synchronisation no-ops) for the graph
    classes built on plait.executor.graph_utils.CudaGraphSegments; returns the log their calls go to,
    into which a test's forward may write its own entries."""
    import contextlib

    from plait.executor import graph_utils

    _RecordedCudaGraph.log = []
    monkeypatch.setattr(torch.cuda, "CUDAGraph", _RecordedCudaGraph)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    monkeypatch.setattr(graph_utils, "capture_stream", lambda: None)
    return _RecordedCudaGraph.log
