"""The HTTP process's side of the scheduler process: spawn it, talk to it over ZMQ, watch it.

One ``SchedulerClient`` per HTTP process. The first (``worker`` 0) owns the child process (started as
``python -m plait scheduler-process``) and the temporary directory of the IPC paths; with
``--tokenizer-worker-num N`` the other HTTP processes' clients (``worker`` 1..N-1) talk to the same child,
which sends each request's updates back to the process that sent it. Each client binds two ZMQ sockets
(its requests and its outputs) and keeps a table rid -> asyncio.Queue through which a background task
hands each request's updates to the coroutine that serves it.

Lifecycle: ``starting`` (child loading the model; /health 503, requests 503) -> ``ready`` ->
``draining`` (SIGTERM: new requests 503, in-flight ones finish or are aborted) -> ``stopped``. If
the child dies at any point the state becomes ``dead``: /health 503, every pending and new request
fails with a 500. A watchdog polls the child every 50 ms (the later HTTP processes poll its pid), so
that happens within a second; the server then exits non-zero ``DEAD_EXIT_DELAY_S`` later
(``on_fatal``), so a supervisor restarts it.

A streaming request whose client stops reading has its updates queue up here; past
``max_stream_buffer`` updates per choice it is aborted (its KV freed), so a stalled client costs a
bounded buffer and slows no one else.
"""

from __future__ import annotations

import asyncio
import collections
import enum
import logging
import os
import pickle
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import zmq
import zmq.asyncio

from plait import envs
from plait.config import EngineConfig
from plait.engine.frontend import Frontend, PreparedRequest, RequestLimits
from plait.engine.generation_config import sampling_defaults
from plait.engine.heap import freeze_startup_heap
from plait.engine.messages import (
    AbortRequest,
    Fatal,
    FlushCacheReply,
    FlushCacheRequest,
    GenerateRequest,
    Ready,
    RequestUpdate,
    ShutdownRequest,
    UpdateBatch,
    coalesce_updates,
    config_to_json,
    front_end_detokenizes,
)
from plait.scheduler.detokenizer import IncrementalDetokenizer, prepare_tokenizer
from plait.server.errors import APIError
from plait.server.metrics import ServerMetrics
from plait.server.request_log import RequestLog, RequestRecord

logger = logging.getLogger(__name__)

WATCHDOG_INTERVAL_S = 0.05
# Most scheduler messages the receive loop handles before it lets the readers run.
MAX_DRAIN_MESSAGES = 64
CHILD_EXIT_WAIT_S = 5.0
# After the scheduler process died: how long /health answers 503 (load balancers see it) before exit.
DEAD_EXIT_DELAY_S = 1.0


class State(enum.StrEnum):
    STARTING = "starting"
    READY = "ready"
    DRAINING = "draining"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass
class _Timing:
    arrival: float
    last_token: float | None = None


class SchedulerClient:
    def __init__(self, config: EngineConfig, metrics: ServerMetrics, max_queued_requests: int | None,
                 on_fatal: Callable[[str], None] | None = None, request_log: RequestLog | None = None,
                 max_stream_buffer: int | None = None, worker: int = 0, workers: int = 1,
                 ipc_dir: str | None = None) -> None:
        assert 0 <= worker < workers and (workers == 1 or ipc_dir is not None)
        self.config = config
        # This HTTP process's index among ``workers`` (``--tokenizer-worker-num``); worker 0 spawns the
        # scheduler process, which connects to every worker's sockets under ``ipc_dir``.
        self.worker, self.workers = worker, workers
        self.metrics = metrics
        self.max_queued_requests = max_queued_requests
        # Called once the server cannot serve any more (startup failed, the scheduler died): it exits.
        self.on_fatal = on_fatal
        self.request_log = request_log
        self.max_stream_buffer = max_stream_buffer
        # PLAIT_FRONTEND_DETOKENIZE: make the text of requests without stop strings here, from their token ids.
        self.detokenize_here = envs.FRONTEND_DETOKENIZE.get()
        self._buffer_limits: dict[str, int] = {}  # rid -> most queued updates (streams only)
        self.state = State.STARTING
        self.dead_reason = ""
        self.ready: Ready | None = None
        self.frontend: Frontend | None = None
        self.tokenizer: Any = None
        self.proc: subprocess.Popen[bytes] | None = None
        self._queues: dict[str, asyncio.Queue[RequestUpdate]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        # The IPC paths' directory: this client's own, or the one ``plait serve`` made for every HTTP process
        # (then it removes it).
        self._owns_tmpdir = ipc_dir is None
        self._tmpdir = ipc_dir if ipc_dir is not None else tempfile.mkdtemp(prefix="plait-ipc-")
        self._ctx = zmq.asyncio.Context()
        self._sync_ctx = zmq.Context()
        self._fatal: str | None = None
        # /flush_cache callers waiting for the scheduler's reply, oldest first (replies come in order).
        self._flush_waiters: list[asyncio.Future[FlushCacheReply]] = []

    # --- lifecycle --------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the sockets and spawn the child; readiness is awaited in the background, so the
        HTTP server is up (answering 503) while the model loads."""
        requests_addrs = [f"ipc://{self._tmpdir}/requests-{w}" for w in range(self.workers)]
        outputs_addrs = [f"ipc://{self._tmpdir}/outputs-{w}" for w in range(self.workers)]
        requests_addr, outputs_addr = requests_addrs[self.worker], outputs_addrs[self.worker]
        self._push = self._sync_ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.SNDHWM, 0)
        self._push.setsockopt(zmq.LINGER, 0)
        self._push.bind(requests_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        self._pull.bind(outputs_addr)
        if self.worker == 0:
            cmd = [sys.executable, "-m", "plait", "scheduler-process", "--config-json", config_to_json(self.config),
                   "--requests-addr", *requests_addrs, "--outputs-addr", *outputs_addrs]
            if self.max_queued_requests is not None:
                cmd += ["--max-queued-requests", str(self.max_queued_requests)]
            self.proc = subprocess.Popen(cmd)
            logger.info("scheduler process started (pid %d)", self.proc.pid)
        self._tasks.append(asyncio.create_task(self._startup()))

    async def until_started(self) -> None:
        """Until the scheduler process is ready, or this process is told to stop (the first HTTP process
        failed to start the scheduler, SIGTERM): the HTTP processes after the first wait for this before
        they accept connections, so a connection never finds one of them still starting once the first
        one answers."""
        while self.state == State.STARTING:
            await asyncio.sleep(0.02)

    def _load_tokenizer(self) -> Any:
        from plait.models.loader import load_config_tokenizer  # slow first import: keep it off the event loop

        tokenizer = load_config_tokenizer(self.config)
        prepare_tokenizer(tokenizer)
        return tokenizer

    def need_tokenizer(self, param: str, what: str) -> Any:
        """The tokenizer, or a 400 naming ``param`` when the server runs without one (--skip-tokenizer-init):
        ``what`` needs it."""
        if self.tokenizer is None:
            raise APIError(400, f"{what} needs the tokenizer, which this server does not load "
                                "(--skip-tokenizer-init)", param=param)
        return self.tokenizer

    async def _startup(self) -> None:
        try:
            await self._await_ready()
        except Exception as e:  # e.g. the tokenizer cannot be loaded: fail fast, as a dead child would
            logger.exception("startup failed")
            self._startup_failed(f"{type(e).__name__}: {e}")

    def _startup_failed(self, reason: str) -> None:
        self.state = State.DEAD
        self.dead_reason = f"the server failed to start ({reason})"
        logger.error("%s", self.dead_reason)
        if self.on_fatal is not None:
            self.on_fatal(self.dead_reason)

    async def _await_ready(self) -> None:
        tokenizer_task = asyncio.create_task(asyncio.to_thread(self._load_tokenizer))
        while self.ready is None:
            if await self._pull.poll(100):
                msg = await self._pull.recv_pyobj()
                if isinstance(msg, Ready):
                    self.ready = msg
                elif isinstance(msg, Fatal):
                    self._fatal = msg.message
            elif self.proc is not None and self.proc.poll() is not None:
                tokenizer_task.cancel()
                reason = self._fatal or f"exit code {self.proc.returncode}"
                self._startup_failed(f"the scheduler process exited: {reason}")
                return
        self.tokenizer = await tokenizer_task
        freeze_startup_heap()
        if self.request_log is not None:
            self.request_log.tokenizer = self.tokenizer
        ready = self.ready
        self.frontend = Frontend(self.tokenizer, RequestLimits(ready.vocab_size, ready.max_context_len,
                                                               ready.max_total_tokens), seed=self.config.seed,
                                 sampling_defaults=sampling_defaults(self.config),
                                 constrained=self.config.grammar_backend != "none",
                                 auto_truncate=self.config.allow_auto_truncate)
        self._tasks.append(asyncio.create_task(self._recv_loop()))
        self._tasks.append(asyncio.create_task(self._watchdog()))
        if self.state == State.STARTING:
            self.state = State.READY
            logger.info("ready: KV pool %d tokens, context %d, on %s", ready.max_total_tokens,
                        ready.max_context_len, ready.device_name)

    async def _recv_loop(self) -> None:
        while True:
            # Every message already waiting is taken before any reader runs: a reader that fell
            # behind (many streams at a high token rate) then finds several of its request's updates
            # queued and sends them as one event. Awaiting one message at a time would wake the
            # readers between messages, so each event would carry one step, however far behind the
            # process is, and the backlog would grow in the socket instead.
            first = await self._pull.recv()
            for raw in self._drain_pending(first):
                self._dispatch(pickle.loads(raw))
            # An already-received message resolves the await above without suspending: let the
            # readers run before the next pass.
            await asyncio.sleep(0)

    def _drain_pending(self, first: bytes) -> list[bytes]:
        """``first`` and the messages queued behind it, at most ``MAX_DRAIN_MESSAGES`` (the readers
        run between passes, so one pass stays bounded however fast the scheduler sends)."""
        out = [first]
        while len(out) < MAX_DRAIN_MESSAGES:
            try:  # a non-blocking receive resolves at once: a message, or zmq.Again
                out.append(self._pull.recv(zmq.NOBLOCK).result())
            except zmq.Again:
                break
        return out

    def _dispatch(self, msg: object) -> None:
        if isinstance(msg, UpdateBatch):
            self.metrics.snapshot = msg.stats
            for upd in msg.updates:
                queue = self._queues.get(upd.rid)
                if queue is None:
                    continue  # its client is gone and the abort already came back
                queue.put_nowait(upd)
                if upd.finished:
                    del self._queues[upd.rid]
                    self._buffer_limits.pop(upd.rid, None)
                elif queue.qsize() > self._buffer_limits.get(upd.rid, queue.qsize()):
                    self._abort_unread(queue)
        elif isinstance(msg, FlushCacheReply):
            if self._flush_waiters:
                waiter = self._flush_waiters.pop(0)
                if not waiter.done():
                    waiter.set_result(msg)
        elif isinstance(msg, Fatal):
            self._fatal = msg.message

    def _scheduler_exit(self) -> str | None:
        """None while the scheduler process runs, else how it ended. The first HTTP process is its
        parent; the others see it gone once the first has reaped it."""
        if self.proc is not None:
            return None if self.proc.poll() is None else f"exit code {self.proc.returncode}"
        assert self.ready is not None
        try:
            os.kill(self.ready.pid, 0)
        except ProcessLookupError:
            return f"pid {self.ready.pid} gone"
        return None

    async def _watchdog(self) -> None:
        while (ended := self._scheduler_exit()) is None:
            await asyncio.sleep(WATCHDOG_INTERVAL_S)
        if self.state == State.STOPPED:
            return
        reason = f"; {self._fatal}" if self._fatal else ""
        self.dead_reason = f"the scheduler process died ({ended}{reason})"
        logger.error("%s: failing %d in-flight requests", self.dead_reason, len(self._queues))
        self.state = State.DEAD
        self._fail_all(500, self.dead_reason)
        await asyncio.sleep(DEAD_EXIT_DELAY_S)
        if self.on_fatal is not None:
            self.on_fatal(self.dead_reason)

    def _abort_unread(self, queue: asyncio.Queue[RequestUpdate]) -> None:
        """A stream's client stopped reading: abort its requests and stop buffering for them."""
        rids = [rid for rid, q in self._queues.items() if q is queue]
        logger.warning("aborting request %s: its client stopped reading (%d updates queued, limit "
                       "--max-stream-buffer %s per choice)", rids[0].rsplit("-", 1)[0], queue.qsize(),
                       self.max_stream_buffer)
        self._send(AbortRequest(rids))
        for rid in rids:
            del self._queues[rid]
            self._buffer_limits.pop(rid, None)
            queue.put_nowait(RequestUpdate(rid, error="the client stopped reading the stream; the request was "
                                           "aborted (--max-stream-buffer)", error_status=499))

    def _fail_all(self, status: int, message: str) -> None:
        for rid, queue in self._queues.items():
            queue.put_nowait(RequestUpdate(rid, error=message, error_status=status))
        self._queues.clear()

    async def drain(self, timeout: float) -> None:
        """SIGTERM: refuse new requests, give in-flight ones ``timeout`` seconds, abort the rest
        (they finish with finish_reason "abort" and their responses complete normally)."""
        if self.state in (State.READY, State.STARTING):
            self.state = State.DRAINING
        deadline = time.monotonic() + timeout
        if self._queues:
            logger.info("draining: %d requests in flight, waiting up to %.1f s", len(self._queues), timeout)
        while self._queues and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        if self._queues and self.state == State.DRAINING:
            logger.info("shutdown timeout: aborting %d requests", len(self._queues))
            self._send(AbortRequest(list(self._queues)))

    async def shutdown(self) -> None:
        """Stop the child (politely, then by force) and release the sockets."""
        previous = self.state
        self.state = State.STOPPED
        if self._queues:
            self._fail_all(503, "the server is shutting down")
        if self.proc is not None and self.proc.poll() is None and previous != State.STARTING:
            self._send(ShutdownRequest())
            deadline = time.monotonic() + CHILD_EXIT_WAIT_S
            while self.proc.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
        for task in self._tasks:
            task.cancel()
        self.close()

    def close(self) -> None:
        """Synchronous last resort (also used on error paths): no child and no socket survives."""
        self.state = State.STOPPED
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(2.0)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        for sock_name in ("_push", "_pull"):
            sock = getattr(self, sock_name, None)
            if sock is not None:
                sock.close(0)
        self._ctx.term()
        self._sync_ctx.term()
        if self._owns_tmpdir:
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    # --- requests ---------------------------------------------------------------------------------
    def check_accepting(self) -> None:
        if self.state == State.READY:
            return
        if self.state == State.STARTING:
            raise APIError(503, "the server is starting (loading the model); retry shortly", code="starting")
        if self.state == State.DEAD:
            raise APIError(500, self.dead_reason, code="scheduler_dead")
        raise APIError(503, "the server is shutting down", code="shutting_down")

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)

    def _send(self, msg: object) -> None:
        # HWM 0 on an IPC PUSH socket: send never blocks and never drops.
        self._push.send_pyobj(msg)

    def abort(self, rids: Sequence[str]) -> None:
        if rids and self.state not in (State.DEAD, State.STOPPED):
            self._send(AbortRequest(list(rids)))

    def abort_groups(self, groups: Sequence[str], everything: bool = False) -> None:
        """Abort every request of these client ids (``generate``'s ``groups``), or with ``everything``
        every request, whichever HTTP process sent it: the scheduler process finds them."""
        if (groups or everything) and self.state not in (State.DEAD, State.STOPPED):
            self._send(AbortRequest([], list(groups), everything))

    def is_in_flight(self, rid: str) -> bool:
        return rid in self._queues

    @property
    def in_flight_rids(self) -> list[str]:
        return list(self._queues)

    async def flush_cache(self, timeout: float = 10.0) -> FlushCacheReply:
        """Ask the scheduler to empty its prefix cache; it refuses while requests run or wait."""
        self.check_accepting()
        waiter: asyncio.Future[FlushCacheReply] = asyncio.get_running_loop().create_future()
        self._flush_waiters.append(waiter)
        self._send(FlushCacheRequest(self.worker))
        return await asyncio.wait_for(waiter, timeout)

    async def generate(self, requests: Sequence[PreparedRequest], stream: bool = True,
                       rids: Sequence[str] | None = None, groups: Sequence[str] | None = None,
                       ) -> AsyncGenerator[tuple[int, RequestUpdate], None]:
        """Submit requests (the choices of one HTTP request) and yield (index, update) until all
        finished. Leaving early (client disconnect, cancellation, an error) aborts the unfinished
        ones at once, which frees their KV at the scheduler's next step. ``rids``: the clients' own
        request ids (SGLang's ``rid``, for /abort_request), unique among requests in flight; ``groups``:
        per request, the client's id it belongs to (``abort_groups`` from any HTTP process)."""
        self.check_accepting()
        queue: asyncio.Queue[RequestUpdate] = asyncio.Queue()
        base = uuid.uuid4().hex
        rids = list(rids) if rids is not None else [f"{base}-{i}" for i in range(len(requests))]
        clash = [rid for rid in rids if rid in self._queues or rids.count(rid) > 1]
        if clash:
            raise APIError(400, f"rid {clash[0]!r} is already in flight; request ids must be unique", param="rid")
        index = {rid: i for i, rid in enumerate(rids)}
        now = time.perf_counter()
        timings = [_Timing(now) for _ in rids]
        pending = set(rids)
        records = None if self.request_log is None else [
            RequestRecord(rid, req.input_ids, req.sampling_params) for rid, req in zip(rids, requests, strict=True)]
        for rid in rids:
            self._queues[rid] = queue
            if stream and self.max_stream_buffer is not None:
                # Every choice of this request shares the queue.
                self._buffer_limits[rid] = self.max_stream_buffer * len(rids)
        # The requests whose text this process makes from their tokens (the scheduler sends none).
        detoks = {rid: IncrementalDetokenizer.for_request(self.tokenizer, req.input_ids, req.sampling_params)
                  for rid, req in zip(rids, requests, strict=True)
                  if self.detokenize_here and self.tokenizer is not None
                  and front_end_detokenizes(req.sampling_params)}
        try:
            for i, (rid, req) in enumerate(zip(rids, requests, strict=True)):
                self._send(GenerateRequest(rid, req.input_ids, req.sampling_params, req.seed, stream,
                                           detokenize=rid not in detoks, worker=self.worker,
                                           group=groups[i] if groups is not None else ""))
            ready: collections.deque[RequestUpdate] = collections.deque()
            while pending:
                if not ready:
                    # Everything queued, each request's updates merged: a reader that fell behind
                    # (many streams at a high token rate) then builds one chunk for several tokens
                    # instead of falling further behind.
                    batch = [await queue.get()]
                    while not queue.empty():
                        batch.append(queue.get_nowait())
                    ready.extend(coalesce_updates(batch) if len(batch) > 1 else batch)
                upd = ready.popleft()
                detok = detoks.get(upd.rid)
                if detok is not None and upd.error is None:
                    upd.text = _text_of(detok, upd, stream)
                if records is not None:
                    self._record(records[index[upd.rid]], upd)
                if upd.error is not None:
                    pending.discard(upd.rid)
                    if upd.error_status == 503:
                        self.metrics.rejected.inc()
                    raise APIError(upd.error_status or 500, upd.error,
                                   code="queue_full" if upd.error_status == 503 else None)
                i = index[upd.rid]
                self._observe(timings[i], upd)
                if upd.finished:
                    pending.discard(upd.rid)
                yield i, upd
        finally:
            # No await here: this runs during cancellation and generator close as well.
            if pending:
                self.abort(sorted(pending))
            for rid in rids:
                self._buffer_limits.pop(rid, None)
            if records is not None and self.request_log is not None:
                for rec in records:
                    self.request_log.write(rec)

    def _record(self, rec: RequestRecord, upd: RequestUpdate) -> None:
        if upd.token_ids and rec.first_token is None:
            rec.first_token = time.perf_counter()
        rec.output_tokens = max(rec.output_tokens, upd.completion_tokens)  # a running count
        if self.request_log is not None and self.request_log.keeps_text and upd.text:
            rec.output_text.append(upd.text)
        if upd.error is not None:
            rec.status = f"error {upd.error_status or 500}: {upd.error}"
        elif upd.finish_reason is not None:
            rec.status = upd.finish_reason

    def _observe(self, t: _Timing, upd: RequestUpdate) -> None:
        now = time.perf_counter()
        k = len(upd.token_ids)
        if k:
            if t.last_token is None:
                self.metrics.ttft.observe(now - t.arrival)
                k -= 1
            else:
                self.metrics.itl.observe((now - t.last_token) / k, k)
            t.last_token = now
        if upd.finished:
            self.metrics.e2e.observe(now - t.arrival)


def _text_of(detok: IncrementalDetokenizer, upd: RequestUpdate, stream: bool) -> str:
    """The text an update of a request that this process detokenizes carries: what the scheduler's
    ``take_update`` would have put there (its tokens folded in, flushed at the finish; a non-streamed
    request's text only at its end)."""
    detok.add_tokens(upd.token_ids)
    if upd.finished:
        detok.finish()
    return detok.take_delta(upd.finished) if stream or upd.finished else ""
