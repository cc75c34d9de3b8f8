"""Starting tensor-parallel ranks: one process per rank, joined by torch.distributed.

``Engine(tp_size=N)`` (and ``plait generate --tp N``) runs rank 0 in the caller's process: it
tokenizes, schedules and samples. ``start_tensor_parallel`` starts the ranks of this node
(``rank_process_context``: spawn on CUDA, a preloaded forkserver on the CPU), builds the groups from
one explicit ``TCPStore`` and returns rank 0's ``TPLeaderRunner``. Every other rank runs
``worker_loop``: receive the step rank 0 broadcasts, mirror its request-pool writes, run the same
forward on its weight shard, drop the logits.

Groups (no ``init_process_group``, so nothing process-global is registered):
  tp       gloo on the CPU, NCCL on CUDA: the model's collectives and the step payload
  control  gloo: step headers and host lists (the same object as ``tp`` on the CPU)

Failure: a rank that dies or hangs ends the engine with ``TensorParallelError`` instead of a hang.
Rank 0 checks its spawned ranks before every step; collectives run under ``dist_timeout``; a worker
whose startup fails leaves its traceback in the store, and rank 0 reports it. Workers exit when
rank 0 goes away (parent-death signal, and their collectives fail).

Multi-node and torchrun forms: ``plait node`` (``plait.cli``) runs the ranks of the other nodes.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import time
import traceback
from collections.abc import Callable
from dataclasses import replace
from datetime import timedelta
from functools import partial
from multiprocessing.context import BaseContext
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from plait.config import EngineConfig
from plait.distributed.p2p_all_reduce import with_p2p_all_reduce
from plait.distributed.parallel_state import TPGroup
from plait.executor.model_runner import ModelRunner
from plait.executor.sizing import use_rank_device
from plait.forward_batch import ForwardBatch
from plait.models.llama import LogitsOutput
from plait.models.loader import ModelConfig, load_target_config
from plait.parallel.ranks import (
    ERROR_KEY,
    JOIN_POLL_S,
    JOINED_KEY,
    DistGroups,
    RankProcesses,
    SpawnedRanks,
    TensorParallelError,
    stop_processes,
    worker_error,
)
from plait.parallel.step_sync import (
    RecordingReqToTokenPool,
    StepKind,
    apply_step_writes,
    recv_step,
    send_shutdown,
    send_step,
)

if TYPE_CHECKING:
    from plait.parallel.dp_attention import DPAttentionLeader

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 600.0


# --- validation ------------------------------------------------------------------------------------
def validate_tp_size(mc: ModelConfig, tp_size: int, dp_attention: bool = False) -> None:
    """Fail before anything is spawned when the model cannot be split ``tp_size`` ways (under DP
    attention only the MLP is split: attention runs whole on every rank)."""
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    if tp_size == 1:
        return
    problems = []
    inter = getattr(mc.hf_config, "intermediate_size", None)
    if dp_attention:
        if inter is not None and inter % tp_size:
            raise ValueError(f"tp_size {tp_size} does not divide the model's MLP intermediate size ({inter})")
        return
    if mc.num_heads % tp_size:
        problems.append(f"attention heads ({mc.num_heads})")
    if mc.num_kv_heads >= tp_size and mc.num_kv_heads % tp_size:
        problems.append(f"KV heads ({mc.num_kv_heads})")
    if mc.num_kv_heads < tp_size and tp_size % mc.num_kv_heads:
        # Fewer KV heads than ranks: each is replicated on tp_size / num_kv_heads ranks.
        problems.append(f"KV heads ({mc.num_kv_heads}), which must divide tp_size when fewer than the ranks,")
    if inter is not None and inter % tp_size:
        problems.append(f"MLP intermediate size ({inter})")
    if problems:
        raise ValueError(f"tp_size {tp_size} does not divide the model's {', '.join(problems)}; choose a "
                         f"tp_size that divides {mc.num_heads} attention heads")


# --- groups ----------------------------------------------------------------------------------------
def build_groups(store: dist.Store, rank: int, world: int, device: str, timeout: timedelta) -> DistGroups:
    gloo = dist.ProcessGroupGloo(dist.PrefixStore("plait/gloo", store), rank, world, timeout)
    control = TPGroup(rank, world, gloo)
    if device != "cuda":
        return DistGroups(control, control, store)
    opts = dist.ProcessGroupNCCL.Options()
    opts._timeout = timeout
    nccl = dist.ProcessGroupNCCL(dist.PrefixStore("plait/nccl", store), rank, world, opts)
    return DistGroups(TPGroup(rank, world, nccl), control, store)


def tensor_parallel_groups(groups: DistGroups, config: EngineConfig, mc: ModelConfig) -> DistGroups:
    """``groups`` for a tensor-parallel runner: on CUDA its small all-reduces go through the custom
    kernel unless ``disable_custom_all_reduce`` (the rank's GPU is made current first: the kernel's
    buffers live there)."""
    device = use_rank_device(config, groups.tp)
    if config.disable_custom_all_reduce:
        return groups
    return replace(groups, tp=with_p2p_all_reduce(groups.tp, groups.store, mc.dtype, device))


def startup_timeout(config: EngineConfig) -> timedelta:
    """Collectives while the ranks build their runners wait for the slowest model load, not for
    ``dist_timeout``; ``set_collective_timeout`` tightens them once a rank is ready."""
    return timedelta(seconds=max(config.dist_timeout, STARTUP_TIMEOUT_S))


def set_collective_timeout(groups: DistGroups, timeout: timedelta) -> None:
    for group in {id(g.group): g.group for g in (groups.tp, groups.control)}.values():
        group.set_timeout(timeout)


def _backend_name(device: str) -> str:
    return "nccl" if device == "cuda" else "gloo"


# --- workers (ranks > 0) ---------------------------------------------------------------------------
def die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (even by SIGKILL), so no spawned rank,
    scheduler or HTTP process outlives the process that started it. Elsewhere: nothing (callers poll)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def worker_loop(runner: ModelRunner, groups: DistGroups) -> None:
    """Run rank 0's steps until it says shut down."""
    while True:
        msg = recv_step(groups.control, groups.tp, runner.device)
        if msg.kind == StepKind.SHUTDOWN:
            return
        assert msg.fb is not None
        apply_step_writes(runner.req_to_token_pool, msg.writes)
        runner.forward(msg.fb)  # logits are identical on every rank; only rank 0 samples


def run_worker(rank: int, world: int, config: EngineConfig, store: dist.Store, local_world: int) -> None:
    device = config.resolved_device()
    timeout = timedelta(seconds=config.dist_timeout)
    try:
        if device == "cpu" and "OMP_NUM_THREADS" not in os.environ:
            # Ranks of one node share its cores; oversubscribed OpenMP threads slow every op.
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_world))
        store.set(JOINED_KEY.format(rank=rank), "1")
        groups = build_groups(store, rank, world, device, startup_timeout(config))
        mc = load_target_config(config, device)
        runner: ModelRunner
        serve: Callable[[], None]
        if config.enable_dp_attention:
            from plait.parallel.dp_attention import DPAttentionRunner, dp_worker_loop

            dp_runner = DPAttentionRunner(config, mc, groups)
            runner, serve = dp_runner, partial(dp_worker_loop, config, dp_runner)
        else:
            groups = tensor_parallel_groups(groups, config, mc)
            runner = ModelRunner(config, mc, groups.tp)
            serve = partial(worker_loop, runner, groups)
        set_collective_timeout(groups, timeout)
    except BaseException:
        store.set(ERROR_KEY.format(rank=rank), traceback.format_exc())
        raise
    try:
        serve()
    finally:
        runner.close()


def _spawned_worker(rank: int, world: int, config: EngineConfig, host: str, port: int, local_world: int,
                    environ: dict[str, str]) -> None:
    """Entry of a rank spawned by ``start_tensor_parallel`` (module level: spawn pickles it);
    ``environ`` is the spawning process's environment at the spawn."""
    os.environ.clear()
    os.environ.update(environ)
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches rank 0, which shuts the ranks down
    logging.basicConfig(level=config.log_level.upper(), format=f"%(asctime)s tp{rank} %(name)s %(levelname)s "
                        "%(message)s")
    if os.environ.get("TRITON_INTERPRET") == "1":
        # Triton kernels on CPU tensors (tests): the same interpreter fixes as the parent process.
        from plait.triton_utils import patch_interpreter_for_numpy, patch_interpreter_nested_calls

        patch_interpreter_for_numpy()
        patch_interpreter_nested_calls()
    store = dist.TCPStore(host, port, world, is_master=False, timeout=startup_timeout(config))
    run_worker(rank, world, config, store, local_world)


# --- rank 0 ----------------------------------------------------------------------------------------
class TPLeaderRunner(ModelRunner):
    """Rank 0's ModelRunner: broadcasts each step to the other ranks before running it."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, groups: DistGroups, store: dist.Store,
                 procs: RankProcesses) -> None:
        super().__init__(config, mc, groups.tp)
        self.groups = groups
        self.store = store
        self.ranks = SpawnedRanks("tensor-parallel", procs, store)
        self.procs = procs  # rank -> process, for the ranks this process spawned
        # Radix-cache prefixes are written into the map at admission: record them for the workers.
        self.recording_pool = RecordingReqToTokenPool.adopt(self.req_to_token_pool)
        self.req_to_token_pool = self.recording_pool

    @property
    def failure(self) -> str | None:
        return self.ranks.failure

    def check_ranks(self) -> None:
        self.ranks.check()

    def forward(self, fb: ForwardBatch, skip_attn_backend_init: bool | None = None) -> LogitsOutput:
        self.check_ranks()
        try:
            send_step(self.groups.control, self.groups.tp, fb, self.recording_pool.take_pending())
            return super().forward(fb, skip_attn_backend_init)
        except TensorParallelError:
            raise
        except Exception as e:  # a collective failed: a peer died (closed socket) or timed out
            raise self.ranks.fail(e, self.config.dist_timeout) from e

    def close(self) -> None:
        if self.failure is None and not self.closed:
            try:
                send_shutdown(self.groups.control)
            except Exception:  # noqa: BLE001 (a dead rank cannot be told; it is killed below)
                logger.warning("could not tell the tensor-parallel ranks to shut down", exc_info=True)
        self.ranks.stop()
        super().close()


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ


def ranks_of_node(config: EngineConfig) -> range:
    per_node = config.tp_size // config.nnodes
    return range(config.node_rank * per_node, (config.node_rank + 1) * per_node)


def split_addr(addr: str) -> tuple[str, int]:
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"dist_init_addr must be HOST:PORT, got {addr!r}")
    return host, int(port)


def rank_process_context(device: str) -> BaseContext:
    """How rank processes start. On CUDA, ``spawn``: a fresh interpreter, since a process forked after
    the CUDA driver was initialised cannot use the GPU. On the CPU, ``forkserver`` with this module
    preloaded: ranks fork from one helper process that imported torch and plait once, instead of
    each paying the imports (about a second of CPU per rank)."""
    if device == "cuda":
        return torch.multiprocessing.get_context("spawn")
    ctx = torch.multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload([__name__])  # read when the helper starts (the first CPU rank)
    return ctx


def spawn_ranks(config: EngineConfig, ranks: range, host: str, port: int) -> RankProcesses:
    ctx = rank_process_context(config.resolved_device())
    procs: RankProcesses = {}
    for rank in ranks:
        if rank == 0:
            continue
        # The environment travels as an argument: a forkserver's children inherit the helper's
        # environment, fixed when it started, not the one the caller has now.
        proc = ctx.Process(target=_spawned_worker,
                           args=(rank, config.tp_size, config, host, port, len(ranks), dict(os.environ)),
                           daemon=True, name=f"plait-tp{rank}")
        proc.start()
        procs[rank] = proc
    return procs


def _wait_joined(store: dist.Store, procs: RankProcesses, world: int, timeout_s: float) -> None:
    """Wait for every rank to reach the store, failing fast when a spawned one dies on the way."""
    pending = [r for r in range(1, world)]
    deadline = time.monotonic() + timeout_s
    while pending:
        pending = [r for r in pending if not store.check([JOINED_KEY.format(rank=r)])]
        for rank, proc in procs.items():
            if not proc.is_alive() and rank in pending:
                raise TensorParallelError(f"tp rank {rank} exited with code {proc.exitcode} during startup")
        if time.monotonic() > deadline:
            raise TensorParallelError(f"tp ranks {pending} did not join within {timeout_s:.0f} s")
        time.sleep(JOIN_POLL_S)


def start_tensor_parallel(config: EngineConfig, mc: ModelConfig) -> TPLeaderRunner | DPAttentionLeader:
    """Rank 0: validate, start the other ranks of this node, join the groups, build the runner
    (``TPLeaderRunner``, or ``DPAttentionLeader`` under DP attention)."""
    validate_tp_size(mc, config.tp_size, dp_attention=config.enable_dp_attention)
    device = config.resolved_device()
    timeout = timedelta(seconds=config.dist_timeout)
    world = config.tp_size
    if launched_by_torchrun():
        store, _, _ = next(dist.rendezvous("env://", 0, world, timeout=startup_timeout(config)))
        host, port, procs = "", 0, {}
    else:
        host, port = split_addr(config.dist_init_addr) if config.dist_init_addr else ("127.0.0.1", 0)
        store = dist.TCPStore(host, port, world, is_master=True, timeout=startup_timeout(config),
                              wait_for_workers=False)
        port = store.port
        procs = spawn_ranks(config, ranks_of_node(config), host, port)
    try:
        # Model loading on a busy node can be slow: joining gets a startup allowance of its own.
        _wait_joined(store, procs, world, startup_timeout(config).total_seconds())
        groups = build_groups(store, 0, world, device, startup_timeout(config))
        if config.enable_dp_attention:
            from plait.parallel.dp_attention import DPAttentionLeader

            runner: TPLeaderRunner | DPAttentionLeader = DPAttentionLeader(config, mc, groups, store, procs)
        else:
            groups = tensor_parallel_groups(groups, config, mc)
            runner = TPLeaderRunner(config, mc, groups, store, procs)
        set_collective_timeout(groups, timeout)
    except BaseException as e:
        details = [d for r in procs if (d := worker_error(store, r))]
        stop_processes(procs, grace_s=0.0)
        if details:
            raise TensorParallelError("a tensor-parallel rank failed to start:\n" + "\n".join(details)) from e
        raise
    logger.info("tensor parallel: %d ranks (%s), %d spawned here", world, _backend_name(device), len(procs))
    return runner


# --- the other nodes, and torchrun (``plait node`` in plait.cli) -------------------------------------
def run_torchrun_rank(config: EngineConfig) -> None:
    """Under torchrun: serve one rank other than 0 (rank 0 runs the engine)."""
    rank = int(os.environ["RANK"])
    store, _, _ = next(dist.rendezvous("env://", rank, config.tp_size, timeout=startup_timeout(config)))
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if config.resolved_device() == "cuda":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    run_worker(rank, config.tp_size, config, store, per_node)


def run_node_ranks(config: EngineConfig) -> int:
    """Spawn the ranks of a node other than node 0 and wait for them; the exit code is the worst rank's."""
    if config.node_rank == 0:
        raise ValueError("node 0 runs the engine: use `plait generate` / `plait serve` / `plait.Engine` with the "
                         "same flags")
    if not config.dist_init_addr:
        raise ValueError("--dist-init-addr HOST:PORT (node 0's address) is required on the other nodes")
    host, port = split_addr(config.dist_init_addr)
    procs = spawn_ranks(config, ranks_of_node(config), host, port)
    for proc in procs.values():
        proc.join()
    return max((abs(p.exitcode or 0) for p in procs.values()), default=0)
