"""The scheduler process: one per GPU rank (one on the CPU), driven over ZMQ by the HTTP server.
It runs an engine core (plait.engine.core) built for the server's config.

Wire protocol (the pickled dataclasses of plait.engine.messages, two one-way sockets per HTTP process,
both bound by that process; ``--tokenizer-worker-num`` HTTP processes share this scheduler, each request's
updates going back to the process that sent it):

    HTTP process --PUSH--> requests socket --PULL--> scheduler process
        GenerateRequest (tokenized, validated), AbortRequest, ShutdownRequest
    scheduler process --PUSH--> outputs socket --PULL--> HTTP process
        Ready (once, after the model and KV pool exist: the limits the front end validates against)
        UpdateBatch (after every loop iteration that changed something: per-request increments
                     plus a SchedulerSnapshot for /metrics)
        Fatal (the loop raised; the process exits right after)

Detokenization and stop-string checks stay here, next to the scheduler: a stop string ends a
request at the step that completes it, so the scheduler must see the text, and sending text deltas
saves the HTTP process a second incremental decode of every request. The HTTP process only
tokenizes, validates, and decodes single tokens for logprobs.

The loop never blocks while there is work: it drains every queued message, runs one
``Scheduler.step()``, and sends what changed. Idle, it waits on the requests socket (100 ms at a
time, to notice a dead parent).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import signal
import time
import traceback

from plait import envs
from plait.config import EngineConfig
from plait.engine.core import EngineCore, LiveRequest, adaptive_stream_interval, build_engine_core
from plait.engine.heap import freeze_startup_heap, gc_pauses, paused_seconds
from plait.engine.loop_monitor import DecodeLog, StepWatchdog
from plait.engine.messages import (
    AbortRequest,
    Fatal,
    FlushCacheReply,
    FlushCacheRequest,
    GenerateRequest,
    LoopSeconds,
    PlainRow,
    Ready,
    RequestUpdate,
    SchedulerSnapshot,
    ShutdownRequest,
    UpdateBatch,
)
from plait.engine.step_timing import StepTimes, step_timing
from plait.parallel.launch import die_with_parent

logger = logging.getLogger(__name__)

IDLE_POLL_MS = 100

# PLAIT_LOOP_TRACE's record of one busy loop iteration, TRACE_FIELDS in order (gc_s: the seconds the
# garbage collector stalled the process inside the iteration).
TRACE_FIELDS = ("t0", "t1", "t2", "t3", "t4", "messages", "stepped", "prefills", "waiting", "running", "gc_s")
TraceRow = tuple[float, float, float, float, float, int, bool, bool, int, int, float]


# --- the loop -------------------------------------------------------------------------------------
class SchedulerProcess:
    def __init__(self, config: EngineConfig, requests_addrs: list[str], outputs_addrs: list[str],
                 max_queued_requests: int | None) -> None:
        import zmq

        assert len(requests_addrs) == len(outputs_addrs) >= 1
        self.config = config
        self.max_queued_requests = max_queued_requests
        self.ctx = zmq.Context()
        # One PULL fair-queues every HTTP process's requests; one PUSH per HTTP process (index = worker).
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        for addr in requests_addrs:
            self.pull.connect(addr)
        self.pushes = []
        for addr in outputs_addrs:
            push = self.ctx.socket(zmq.PUSH)
            push.setsockopt(zmq.SNDHWM, 0)
            push.setsockopt(zmq.LINGER, 2000)
            push.connect(addr)
            self.pushes.append(push)
        self.push = self.pushes[0]
        self.parent_pid = os.getppid()
        self.live: dict[str, LiveRequest] = {}
        self.owner: dict[str, int] = {}  # rid -> the HTTP process it came from (several processes only)
        self.group: dict[str, str] = {}  # rid -> the client's request id it belongs to, where given
        self.last_stats: SchedulerSnapshot | None = None
        # The test hook of the "internal error, server keeps serving" path (plait.envs).
        self.fault_token = envs.FAULT_INJECT_TOKEN.get()
        self.running = True
        # LoopSeconds' fields, accumulated here: iterations, then recv, step, collect, send seconds.
        self.loop_iterations = 0
        self.loop_seconds = [0.0, 0.0, 0.0, 0.0]
        self.prefill_iterations, self.prefill_step_s = 0, 0.0  # LoopSeconds' prefill share
        self.decode_log = DecodeLog(config.decode_log_interval)
        self.watchdog: StepWatchdog | None = None  # started once loaded: loading is not a step
        # PLAIT_LOOP_TRACE: per busy iteration (t0..t4, messages, stepped, prefills, waiting, running),
        # written at close.
        self.trace_path = envs.LOOP_TRACE.get()
        self.trace: list[TraceRow] = []
        # Under the trace also each step's wall and (on a GPU) device time by kind, written beside the
        # trace at close (``steps_path``): whether the loop's steps waited for the device or the host.
        # The collector's pauses too (per iteration in the trace). Both are left at close (``traced``).
        self.step_times: StepTimes | None = None
        self.gc_pauses: dict[str, dict[str, float]] = {}
        self.traced = contextlib.ExitStack()
        self.run_started = 0.0

    def load(self) -> None:
        """Build the engine core (this process is rank 0 of its layout), then tell the server the
        limits requests are validated against."""
        self.core: EngineCore = build_engine_core(self.config)
        self.runner = self.core.runner
        self.scheduler = self.core.scheduler
        limits, mc = self.core.limits, self.core.model_config
        freeze_startup_heap()
        if self.trace_path is not None:
            self.step_times = self.traced.enter_context(step_timing(self.scheduler))
            self.gc_pauses = self.traced.enter_context(gc_pauses())
            self.run_started = time.perf_counter()
        self.broadcast(Ready(
            pid=os.getpid(), vocab_size=limits.vocab_size, max_context_len=limits.max_context_len,
            max_total_tokens=limits.max_total_tokens, max_running_requests=self.config.max_running_requests,
            eos_token_ids=tuple(mc.eos_token_ids), runner_info=self.runner.info(),
            device_name=_device_name(self.runner.device)))

    def broadcast(self, msg: object) -> None:
        for push in self.pushes:
            push.send_pyobj(msg)

    def run(self) -> None:
        import zmq

        clock = time.perf_counter
        if self.config.watchdog_timeout is not None:
            self.watchdog = StepWatchdog(self.config.watchdog_timeout)
        while self.running:
            busy = self.scheduler.has_work()
            t0 = clock()
            gc_before = paused_seconds(self.gc_pauses) if self.trace_path is not None else 0.0
            updates: list[RequestUpdate] = []
            taken = 0
            if self.pull.poll(0 if busy else IDLE_POLL_MS, zmq.POLLIN):
                if not busy:  # the wait for this message was idle time
                    t0 = clock()
                while True:
                    try:
                        msg = self.pull.recv_pyobj(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    taken += 1
                    self._handle(msg, updates)
            elif os.getppid() != self.parent_pid:
                logger.error("the server process is gone; scheduler exiting")
                return
            t1 = clock()
            stepped = self.scheduler.has_work()
            prefills = stepped and bool(self.scheduler.waiting or self.scheduler.prefilling)
            if stepped:
                if self.watchdog is not None:
                    self.watchdog.begin()
                self.scheduler.step()
                if self.watchdog is not None:
                    self.watchdog.end()
            t2 = clock()
            rows: list[PlainRow] = []
            updates += self._collect(rows)
            t3 = clock()
            stats = self._snapshot()
            if stepped and (line := self.decode_log.after_step(stats)) is not None:
                logger.info(line)
            if updates or rows or stats != self.last_stats:
                # rows after updates: a request's acknowledgement (in updates) precedes its tokens. The
                # loop times change every busy iteration, so they are not part of the comparison: they
                # ride along with what is sent (a loop that steps without output, e.g. waiting for a
                # grammar, would otherwise send a snapshot per spin).
                loop = LoopSeconds(self.loop_iterations, *self.loop_seconds, self.prefill_iterations,
                                   self.prefill_step_s)
                self._send_updates(updates, dataclasses.replace(stats, loop=loop), rows)
                self.last_stats = stats
            if stepped or updates or rows:  # idle polls are not the loop's work
                t4 = clock()
                self._account(t0, t1, t2, t3, t4, stepped, prefills)
                if self.trace_path is not None:
                    self.trace.append((t0, t1, t2, t3, t4, taken, stepped, prefills, stats.num_waiting,
                                       stats.num_running, paused_seconds(self.gc_pauses) - gc_before))

    def _send_updates(self, updates: list[RequestUpdate], stats: SchedulerSnapshot, rows: list[PlainRow]) -> None:
        """One UpdateBatch per HTTP process, each with the updates of the requests it sent (in order)
        and the snapshot (every process answers /metrics)."""
        if len(self.pushes) == 1:
            self.push.send_pyobj(UpdateBatch(updates, stats, rows))
            return
        per_updates: list[list[RequestUpdate]] = [[] for _ in self.pushes]
        per_rows: list[list[PlainRow]] = [[] for _ in self.pushes]
        for upd in updates:
            per_updates[self.owner.get(upd.rid, 0)].append(upd)
            if upd.finished:
                self.owner.pop(upd.rid, None)
        for row in rows:  # PlainRow: the rid first; never a finish
            per_rows[self.owner.get(row[0], 0)].append(row)
        for push, ups, rs in zip(self.pushes, per_updates, per_rows, strict=True):
            push.send_pyobj(UpdateBatch(ups, stats, rs))

    def _account(self, t0: float, t1: float, t2: float, t3: float, t4: float, stepped: bool,
                 prefills: bool) -> None:
        """Add one loop iteration's phases (perf_counter stamps) to the loop times the next snapshot
        carries."""
        self.loop_iterations += stepped
        if prefills:
            self.prefill_iterations += 1
            self.prefill_step_s += t2 - t1
        self.loop_seconds[0] += t1 - t0
        self.loop_seconds[1] += t2 - t1
        self.loop_seconds[2] += t3 - t2
        self.loop_seconds[3] += t4 - t3

    def _handle(self, msg: object, updates: list[RequestUpdate]) -> None:
        if isinstance(msg, GenerateRequest):
            updates.extend(self._add(msg))
        elif isinstance(msg, AbortRequest):
            groups = set(msg.groups)
            rids = list(self.live) if msg.everything else [
                *msg.rids, *(rid for rid, group in self.group.items() if group in groups)]
            for rid in rids:
                # A waiting request finishes inside abort(); a running one at the next step. Either
                # way _collect reports it.
                self.scheduler.abort(rid)
        elif isinstance(msg, FlushCacheRequest):
            self.pushes[msg.worker].send_pyobj(self._flush_cache())
        elif isinstance(msg, ShutdownRequest):
            self.running = False
        else:
            logger.error("unknown message %r", type(msg).__name__)

    def _flush_cache(self) -> FlushCacheReply:
        if not self.core.flush_cache():
            return FlushCacheReply(False, "requests are running or waiting; the prefix cache was not flushed")
        return FlushCacheReply(True, "Cache flushed.")

    def _add(self, msg: GenerateRequest) -> list[RequestUpdate]:
        if len(self.pushes) > 1:
            self.owner[msg.rid] = msg.worker  # its refusal below, too, goes back to its process
        if self.max_queued_requests is not None and len(self.scheduler.waiting) >= self.max_queued_requests:
            return [RequestUpdate(msg.rid, prompt_tokens=len(msg.input_ids), error_status=503,
                                  error=f"the request queue is full ({self.max_queued_requests} waiting "
                                        "requests, --max-queued-requests); retry later")]
        try:
            if self.fault_token is not None and self.fault_token in msg.input_ids:
                raise RuntimeError(f"injected fault ({envs.FAULT_INJECT_TOKEN.name}={self.fault_token})")
            req = self.core.new_request(msg.rid, msg.input_ids, msg.sampling_params, msg.seed, msg.detokenize)
        except Exception as e:  # one bad request must not take the scheduler down
            logger.exception("request %s failed before scheduling", msg.rid)
            return [RequestUpdate(msg.rid, prompt_tokens=len(msg.input_ids), error_status=500,
                                  error=f"internal error: {type(e).__name__}: {e}")]
        self.live[msg.rid] = LiveRequest(req, msg.stream)
        if msg.group:
            self.group[msg.rid] = msg.group
        self.scheduler.add_request(req)
        # An empty update acknowledges admission to the queue, so the server can commit to a 200
        # (streaming headers) before the first token, knowing the request was not refused.
        return [RequestUpdate(msg.rid, prompt_tokens=len(msg.input_ids))]

    def _collect(self, rows: list[PlainRow]) -> list[RequestUpdate]:
        """Every live request's update since the previous step: the plain ones appended to ``rows``
        (UpdateBatch.rows), the others returned."""
        # Scan every live request rather than only step()'s return value: a request aborted while
        # waiting finishes inside abort(), and with overlap scheduling a step may deliver tokens
        # one step later; take_update is exact in either case. O(live) per step.
        out: list[RequestUpdate] = []
        done: list[str] = []
        interval = self.config.stream_interval or adaptive_stream_interval(len(self.live))
        for rid, live in self.live.items():
            update = live.take_update_into(rows, interval)
            if update is None:
                continue
            if update.finished:
                done.append(rid)
            out.append(update)
        for rid in done:
            del self.live[rid]
            self.group.pop(rid, None)
        return out

    def _snapshot(self) -> SchedulerSnapshot:
        s = self.scheduler
        st = s.stats
        return SchedulerSnapshot(
            num_running=len(s.prefilling) + len(s.running), num_waiting=len(s.waiting),
            kv_slots_in_use=s.kv_tokens_in_use(),
            # Data parallel: the sum of the replicas' pools (kv_tokens_in_use sums them too).
            max_total_tokens=self.runner.total_kv_tokens,
            evictable_tokens=s.tree_cache.evictable_size(), counters=dataclasses.replace(st))

    def close(self) -> None:
        if self.watchdog is not None:
            self.watchdog.close()
        if self.trace_path is not None:
            write_loop_trace(self.trace_path, self.trace)
            self.traced.close()
            if self.step_times is not None:
                write_step_times(steps_path(self.trace_path), self.step_times,
                                 time.perf_counter() - self.run_started)
        self.pull.close(0)
        for push in self.pushes:
            push.close()  # LINGER lets the last messages (final updates, Fatal) go out
        self.ctx.term()


def write_loop_trace(path: str, trace: list[TraceRow]) -> None:
    """PLAIT_LOOP_TRACE's file: one JSON object per busy iteration, ``TRACE_FIELDS`` (t0 its start, t1
    after taking messages, t2 after the step, t3 after collecting updates, t4 after sending them)."""
    with open(path, "w") as f:
        for row in trace:
            f.write(json.dumps(dict(zip(TRACE_FIELDS, row, strict=True))) + "\n")


def steps_path(trace_path: str) -> str:
    """Where a loop trace's step times go (``StepTimes.summary`` as JSON)."""
    return trace_path + ".steps.json"


def write_step_times(path: str, times: StepTimes, seconds: float) -> None:
    """The summary of every step since the model loaded (``seconds`` of the process's life)."""
    with open(path, "w") as f:
        json.dump(times.summary(seconds), f)


def _device_name(device: str) -> str:
    import torch

    if device.startswith("cuda"):
        return torch.cuda.get_device_name(torch.device(device))
    return device


def leave_a_core_for_the_server(config: EngineConfig) -> None:
    """On the CPU, run the model on all cores but one unless OMP_NUM_THREADS says otherwise. The HTTP
    process needs CPU for every streamed token, and OpenMP threads that wait for each other at
    every op slow down many times over when another busy process takes one of their cores."""
    if config.resolved_device() != "cpu" or "OMP_NUM_THREADS" in os.environ:
        return
    import torch

    threads = max(1, (os.cpu_count() or 1) - 1)
    torch.set_num_threads(threads)
    logger.info("CPU model threads: %d (one core left to the HTTP process; set OMP_NUM_THREADS to choose)",
                threads)


def run(config: EngineConfig, requests_addrs: list[str], outputs_addrs: list[str], max_queued_requests: int | None
        ) -> int:
    """The scheduler process's body (``plait scheduler-process``, started by ``plait serve``): load,
    report Ready, serve until told to stop. Returns the exit code."""
    die_with_parent()  # elsewhere than Linux the idle loop's parent check covers it
    # SIGINT goes to the whole process group on Ctrl-C; the server decides when this process ends.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # force: the CLI's entry configured logging already (at its default level, before this config was read).
    logging.basicConfig(level=config.log_level.upper(),
                        format="%(asctime)s scheduler %(name)s %(levelname)s %(message)s", force=True)
    leave_a_core_for_the_server(config)
    proc = SchedulerProcess(config, requests_addrs, outputs_addrs, max_queued_requests)
    code = 0
    try:
        t0 = time.perf_counter()
        proc.load()
        logger.info("scheduler ready in %.1f s (pid %d, KV pool %d tokens)", time.perf_counter() - t0,
                    os.getpid(), proc.runner.max_total_tokens)
        proc.run()
    except Exception as e:
        logger.error("scheduler failed:\n%s", traceback.format_exc())
        proc.broadcast(Fatal(f"{type(e).__name__}: {e}"))
        code = 1
    finally:
        proc.close()
    return code
