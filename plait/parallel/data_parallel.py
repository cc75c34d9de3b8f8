"""Plain data parallelism (``dp_size > 1`` without ``enable_dp_attention``): independent replicas.

Each of the ``dp_size`` replicas is a whole engine minus the front end: a full model (or, with
``tp_size > 1``, its own tensor-parallel group of ``tp_size`` ranks), its own KV cache, prefix cache
and ``Scheduler``. Nothing is shared between replicas and no collective spans them. The engine's
process holds every replica's runner (rank 0 of each TP group) and scheduler:

  ``DataParallelRunner``     the replicas' runners, with the sizes the front end validates against
  ``DataParallelScheduler``  the Scheduler interface the Engine and the server's scheduler process
                             use; ``add_request`` sends each new request to the replica with the
                             fewest live requests (waiting + prefilling + running; ties go to the
                             lowest index) and every later call about it goes to that replica

One engine step steps every replica that has work, one after the other, in this process. On CUDA the
forwards are launched asynchronously (overlap scheduling), so the GPUs of different replicas still
work at the same time; on the CPU the replicas take turns.

Devices: on CUDA replica ``i`` owns GPUs ``[base + i*tp, base + (i+1)*tp)`` (``base_gpu_id``): its
rank 0 lives in this process and every call into it runs under that GPU's device context; its other
ranks set their GPU to ``base_gpu_id + tp_rank``. With ``tp_size > 1`` each replica starts its own TP
group through ``start_tensor_parallel`` (its own store on a free port, its own spawned ranks). The
CUDA placement is written but has not run on several GPUs yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import Counter
from collections.abc import Iterator
from typing import Any, NoReturn

from plait.attention.base import AttentionBackend
from plait.config import EngineConfig
from plait.executor.cuda_graph_runner import CudaGraphRunner
from plait.executor.model_runner import ModelRunner
from plait.models.loader import ModelConfig
from plait.parallel.roles import LogitsObserver
from plait.scheduler.interface import SpecWorker
from plait.scheduler.req import Req
from plait.scheduler.scheduler import Scheduler, SchedulerStats
from plait.speculative.factory import create_spec_worker
from plait.speculative.worker import SpecStats

logger = logging.getLogger(__name__)



class PerReplica:
    """State that belongs to one replica: the facade does not hand out replica 0's as if it were
    all. Reading it raises AttributeError naming ``runner.replicas[i]``."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, obj: object, owner: type | None = None) -> NoReturn:
        raise AttributeError(f"{self.name!r} is per replica under data parallelism: read "
                             f"runner.replicas[i].{self.name}")


def is_plain_data_parallel(config: EngineConfig) -> bool:
    return config.dp_size > 1 and not config.enable_dp_attention


class DataParallelRunner:
    """The replicas' runners. Sizes are per replica: a request must fit one replica's KV pool.

    Introspection (the attention backend, the decode graphs) is replica 0's: every replica is built
    from the same config. Per-replica state must be read from ``replicas``."""

    req_to_token_pool = PerReplica()
    allocator = PerReplica()
    kv_pool = PerReplica()
    tp = PerReplica()
    groups = PerReplica()
    model = PerReplica()

    def __init__(self, config: EngineConfig, mc: ModelConfig) -> None:
        import os

        import torch

        self.config = config
        self.dp_size = config.dp_size
        self.device = config.resolved_device()
        self.model_config = mc
        if config.tp_size > 1 and "TORCHELASTIC_RUN_ID" in os.environ:
            raise ValueError("dp_size > 1 without enable_dp_attention cannot run under torchrun: start "
                             "plait directly, it spawns every replica's ranks itself")
        if self.device == "cuda" and torch.cuda.device_count() < config.base_gpu_id + config.dp_size * config.tp_size:
            raise ValueError(f"dp_size {config.dp_size} x tp_size {config.tp_size} from base_gpu_id "
                             f"{config.base_gpu_id} needs {config.base_gpu_id + config.dp_size * config.tp_size} "
                             f"GPUs, {torch.cuda.device_count()} visible")
        # Replica i owns GPUs [base + i*tp, base + (i+1)*tp): its ranks offset their TP rank by that base.
        replica_configs = [config.replace(dp_size=1, base_gpu_id=config.base_gpu_id + i * config.tp_size)
                           for i in range(config.dp_size)]
        # The GPU of replica i's rank 0 (it lives in this process); None: no device context (CPU).
        self.gpus: list[int | None] = [c.base_gpu_id if self.device == "cuda" else None for c in replica_configs]
        self.replicas: list[ModelRunner] = []
        try:
            for i in range(config.dp_size):
                with self.on_replica(i):
                    self.replicas.append(_start_replica(replica_configs[i], mc))
        except BaseException:
            self.close()
            raise
        self.max_context_len = min(r.max_context_len for r in self.replicas)
        self.max_total_tokens = min(r.max_total_tokens for r in self.replicas)  # what one request may use
        logger.info("data parallel: %d replicas x tp %d, KV pools of %s tokens", config.dp_size, config.tp_size,
                    [r.max_total_tokens for r in self.replicas])

    @property
    def total_kv_tokens(self) -> int:
        """Every replica's pool together."""
        return sum(r.max_total_tokens for r in self.replicas)

    def on_replica(self, i: int) -> contextlib.AbstractContextManager[Any]:
        """The device context every call into replica ``i`` runs under."""
        gpu = self.gpus[i]
        if gpu is None:
            return contextlib.nullcontext()
        import torch

        return torch.cuda.device(gpu)

    def info(self) -> dict[str, Any]:
        info = self.replicas[0].info()
        info.update(dp_size=self.dp_size, max_total_tokens=self.max_total_tokens,
                    total_kv_tokens=self.total_kv_tokens)
        return info

    def close(self) -> None:
        for i, runner in enumerate(self.replicas):
            with self.on_replica(i):
                runner.close()

    @property
    def attn_backend(self) -> AttentionBackend:
        return self.replicas[0].attn_backend

    @property
    def graph_runner(self) -> CudaGraphRunner | None:
        return self.replicas[0].graph_runner


def _start_replica(config: EngineConfig, mc: ModelConfig) -> ModelRunner:
    if config.tp_size > 1:
        from plait.parallel.launch import start_tensor_parallel

        return start_tensor_parallel(config, mc)  # its own store (free port) and spawned ranks
    return ModelRunner(config, mc)


class AggregateCache:
    """The sizes of every replica's prefix cache, summed (what metrics and leak checks read)."""

    def __init__(self, schedulers: list[Scheduler]) -> None:
        self.schedulers = schedulers

    def evictable_size(self) -> int:
        return sum(s.tree_cache.evictable_size() for s in self.schedulers)

    def protected_size(self) -> int:
        return sum(s.tree_cache.protected_size() for s in self.schedulers)

    def total_size(self) -> int:
        return sum(s.tree_cache.total_size() for s in self.schedulers)

    def reset(self) -> None:
        """Empty every replica's prefix cache (benchmarks: a warm-up must not serve the timed run)."""
        for s in self.schedulers:
            s.tree_cache.reset()


class ReplicaSpecWorkers:
    """The replicas' speculative workers as one (what the engine and benchmarks read): their
    statistics summed, their logs one per replica. Driving a worker stays with its replica's
    scheduler."""

    def __init__(self, workers: list[SpecWorker]) -> None:
        self.workers = workers

    @property
    def stats(self) -> SpecStats:
        total = SpecStats()
        for w in self.workers:
            ws = w.stats  # type: ignore[attr-defined]  (BaseSpecWorker's counters)
            total.verify_steps += ws.verify_steps
            total.verified_requests += ws.verified_requests
            total.accept_histogram.update(ws.accept_histogram)
        return total

    def log_stats(self) -> None:
        for w in self.workers:
            w.log_stats()

    def reset(self) -> None:
        for w in self.workers:
            w.reset()


class DataParallelScheduler:
    """The Scheduler interface over the replicas' schedulers, with a shortest-queue balancer."""

    def __init__(self, config: EngineConfig, runner: DataParallelRunner) -> None:
        self.config = config
        self.runner = runner
        self.replicas: list[Scheduler] = []
        for i, r in enumerate(runner.replicas):
            with runner.on_replica(i):
                self.replicas.append(Scheduler(r.config, r, create_spec_worker(r.config, r)))
        self.owner: dict[str, tuple[int, Req]] = {}  # rid -> (replica, request), live requests only
        self.assigned: Counter[int] = Counter()  # requests sent to each replica (tests, metrics)
        self.aggregate_cache = AggregateCache(self.replicas)

    @property
    def spec_worker(self) -> ReplicaSpecWorkers | None:
        """Every replica's speculative worker (each drafts and verifies for its own requests), as the
        engine reads them: statistics summed. None when speculation is off."""
        workers = [s.spec_worker for s in self.replicas if s.spec_worker is not None]
        return ReplicaSpecWorkers(workers) if workers else None

    @property
    def tree_cache(self) -> AggregateCache:
        return self.aggregate_cache

    # --- balancing --------------------------------------------------------------------------------
    def loads(self) -> list[int]:
        """Live requests per replica: the balancer's queue lengths."""
        return [len(s.waiting) + s.num_running() for s in self.replicas]

    def add_request(self, req: Req) -> None:
        loads = self.loads()
        i = loads.index(min(loads))  # shortest queue; ties go to the lowest index
        self.assigned[i] += 1
        self.owner[req.rid] = (i, req)
        self.replicas[i].add_request(req)

    def replica_of(self, rid: str) -> int | None:
        entry = self.owner.get(rid)
        return entry[0] if entry is not None else None

    def _each(self) -> Iterator[tuple[int, Scheduler]]:
        for i, sched in enumerate(self.replicas):
            with self.runner.on_replica(i):
                yield i, sched

    def _forget_finished(self) -> None:
        for rid in [rid for rid, (_, req) in self.owner.items() if req.finished]:
            del self.owner[rid]

    # --- the Scheduler interface ------------------------------------------------------------------
    def abort(self, rid: str) -> bool:
        i = self.replica_of(rid)
        if i is None:
            return False
        with self.runner.on_replica(i):
            return self.replicas[i].abort(rid)

    def has_work(self) -> bool:
        return any(s.has_work() for s in self.replicas)

    def step(self) -> list[Req]:
        updated: list[Req] = []
        for _, sched in self._each():
            if sched.has_work():
                updated += sched.step()
        self._forget_finished()
        return updated

    def flush(self) -> list[Req]:
        updated: list[Req] = []
        for _, sched in self._each():
            updated += sched.flush()
        self._forget_finished()
        return updated

    def close(self) -> None:
        for _, sched in self._each():
            sched.close()

    @property
    def waiting(self) -> list[Req]:
        return [r for s in self.replicas for r in s.waiting]

    @property
    def prefilling(self) -> list[Req]:
        return [r for s in self.replicas for r in s.prefilling]

    @property
    def running(self) -> list[Req]:
        return [r for s in self.replicas for r in s.running]

    def num_running(self) -> int:
        return sum(s.num_running() for s in self.replicas)

    @property
    def max_request_tokens(self) -> int:
        return min(s.max_request_tokens for s in self.replicas)

    @property
    def stats(self) -> SchedulerStats:
        """Every replica's counters summed (forward_steps: forwards over all replicas)."""
        total = SchedulerStats()
        for s in self.replicas:
            for f in dataclasses.fields(SchedulerStats):
                setattr(total, f.name, getattr(total, f.name) + getattr(s.stats, f.name))
        return total

    def kv_tokens_in_use(self) -> int:
        return sum(s.kv_tokens_in_use() for s in self.replicas)

    @property
    def on_logits(self) -> LogitsObserver | None:
        return self.replicas[0].on_logits

    @on_logits.setter
    def on_logits(self, hook: LogitsObserver | None) -> None:
        for s in self.replicas:  # the logits observer sees every replica's sampled steps
            s.on_logits = hook
