"""``plait serve``: the HTTP process (uvicorn) plus one scheduler child, and a graceful shutdown.

Process model::

    plait serve (HTTP process: FastAPI on uvicorn, one asyncio loop)
      ├─ tokenize + validate (plait.engine.frontend), build OpenAI responses, /metrics
      ├─ ZMQ over IPC ──► plait scheduler-process (one per GPU rank; one on the CPU)
      │                    model, KV pool, Scheduler.step() loop, detokenization, stop strings
      └─ --tokenizer-worker-num N: N - 1 more HTTP processes on the same port, each with its own
         listening socket (SO_REUSEPORT: the kernel spreads new connections over the sockets) and its
         own ZMQ pair to the same scheduler process; a scrape of /metrics adds the others' latency
         histograms to the answering one's

With several HTTP processes, SIGTERM to ``plait serve`` reaches the others; each drains its own
requests, and the scheduler process stops after the last of them has exited.

SIGTERM (or the first Ctrl-C): uvicorn stops accepting connections; requests already in flight get
``--shutdown-timeout`` seconds to finish; the rest are aborted and their responses complete with
``finish_reason: "abort"``; then the scheduler process is stopped and the server exits 0 with no
child left. A second Ctrl-C forces the exit.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from plait.config import EngineConfig
from plait.server.app import ServerArgs, build_app, check_text_flags, default_http_processes
from plait.server.operator_flags import flatten_origins
from plait.server.scheduler_client import SchedulerClient

logger = logging.getLogger(__name__)

# After SIGTERM, uvicorn itself gives up on connections this long after our own deadline.
_UVICORN_GRACE_S = 10.0
# Kernel send buffer of every connection (inherited from the listening socket; fixing it turns the
# kernel's growth up to tcp_wmem's maximum off). With --max-stream-buffer this bounds what a client
# that stops reading a stream can make the server hold before its request is aborted.
SOCKET_SEND_BUFFER_BYTES = 128 * 1024


class PlaitServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, client: SchedulerClient, shutdown_timeout: float,
                 workers: HTTPWorkers | None = None) -> None:
        super().__init__(config)
        self.client = client
        self.workers = workers  # the other HTTP processes (worker 0 only): SIGTERM reaches them too
        self.shutdown_timeout = shutdown_timeout
        self.exit_code = 0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        # uvicorn's version re-raises the signal after shutdown, so the process would die by
        # SIGTERM instead of exiting 0 after a clean drain. Same handlers, no re-raise.
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        original = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in original.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if not self.should_exit and self._loop is not None:
            logger.info("received %s: no new requests; in-flight ones get %.1f s", signal.Signals(sig).name,
                        self.shutdown_timeout)
            self._loop.call_soon_threadsafe(self._start_drain)
        if self.workers is not None:
            self.workers.signal_exit()
        super().handle_exit(sig, frame)

    def _start_drain(self) -> None:
        if self._drain_task is None:
            self._drain_task = asyncio.ensure_future(self.client.drain(self.shutdown_timeout))

    def fail(self, reason: str) -> None:
        """The server cannot serve (startup failed, the scheduler process died): exit non-zero."""
        self.exit_code = 1
        self.should_exit = True


def server_args_from(args: argparse.Namespace) -> ServerArgs:
    # Every ServerArgs field is the flag of the same name (a field without a flag keeps its default).
    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServerArgs) if hasattr(args, f.name)}
    if values.get("tokenizer_worker_num") is None:  # the flag left out
        values["tokenizer_worker_num"] = default_http_processes()
    names = args.served_model_name
    return ServerArgs(**{**values, "allowed_origins": flatten_origins(args.allowed_origins),
                         "served_model_name": tuple(names) if names else None})


def reuseport_socket(host: str, port: int) -> socket.socket:
    """A listening TCP socket on ``host``:``port`` with the server's send buffer, bound with
    SO_REUSEPORT, so each HTTP process can bind its own on the same port and the kernel spreads new
    connections over them. One socket inherited by every process would not spread them: a burst's
    connections are all pending when the first process to wake accepts, and asyncio accepts every
    pending connection in one go (up to the backlog), so one process would take the burst."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.create_server((host, port), family=family, backlog=2048, reuse_port=True)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER_BYTES)
    return sock


class HTTPWorkers:
    """The HTTP processes beyond the first (``--tokenizer-worker-num``), each on its own socket bound to
    the first one's port (``reuseport_socket``); they die with the first (the kernel's parent-death
    signal)."""

    def __init__(self, config: EngineConfig, sargs: ServerArgs, ipc_dir: str) -> None:
        self.config, self.sargs, self.ipc_dir = config, sargs, ipc_dir
        self.procs: list[multiprocessing.process.BaseProcess] = []

    def start(self, port: int) -> None:
        """Start the others on ``port`` (the first process's, bound already: ``--port 0`` picked it)."""
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and ZMQ contexts
        sargs = dataclasses.replace(self.sargs, port=port)
        for worker in range(1, self.sargs.tokenizer_worker_num):
            proc = ctx.Process(target=_http_worker, args=(self.config, sargs, worker, self.ipc_dir),
                               name=f"plait-http-{worker}")
            proc.start()
            self.procs.append(proc)
        logger.info("%d more HTTP processes (pids %s)", len(self.procs), ", ".join(str(p.pid) for p in self.procs))

    def signal_exit(self) -> None:
        for proc in self.procs:
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, signal.SIGTERM)

    async def wait(self) -> None:
        """Until every other HTTP process has drained and exited (then the scheduler may stop)."""
        self.signal_exit()
        deadline = self.sargs.shutdown_timeout + 2 * _UVICORN_GRACE_S
        for proc in self.procs:
            await asyncio.to_thread(proc.join, deadline)
            if proc.is_alive():
                logger.error("HTTP process %d did not exit; killing it", proc.pid)
                proc.kill()
                await asyncio.to_thread(proc.join)


def _http_worker(config: EngineConfig, sargs: ServerArgs, worker: int, ipc_dir: str) -> None:
    """The body of HTTP process ``worker`` > 0: the same app and uvicorn server on its own socket on the
    first process's port."""
    from plait.parallel.launch import die_with_parent

    die_with_parent()
    logging.basicConfig(level=config.log_level.upper(),
                        format=f"%(asctime)s http-{worker} %(name)s %(levelname)s %(message)s", force=True)
    raise SystemExit(_serve(config, sargs, worker, ipc_dir))


def _serve(config: EngineConfig, sargs: ServerArgs, worker: int, ipc_dir: str | None,
           workers: HTTPWorkers | None = None) -> int:
    """Run HTTP process ``worker``: bind its socket (its own ``reuseport_socket`` on the port under several
    processes), start ``workers`` on the port it got, serve."""
    holder: dict[str, PlaitServer] = {}
    if sargs.log_level_http is not None:
        logging.getLogger("uvicorn").setLevel(sargs.log_level_http.upper())
    app = build_app(config, sargs, on_fatal=lambda reason: holder["server"].fail(reason), worker=worker,
                    ipc_dir=ipc_dir, before_scheduler_stop=workers.wait if workers is not None else None)
    uv_config = uvicorn.Config(app, host=sargs.host, port=sargs.port, log_config=None, access_log=False,
                               lifespan="on", timeout_graceful_shutdown=sargs.shutdown_timeout + _UVICORN_GRACE_S,
                               ssl_keyfile=sargs.ssl_keyfile, ssl_certfile=sargs.ssl_certfile)
    server = PlaitServer(uv_config, app.state.client, sargs.shutdown_timeout, workers)
    holder["server"] = server
    try:
        if sargs.tokenizer_worker_num == 1:
            sock = uv_config.bind_socket()
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER_BYTES)
        else:
            try:
                sock = reuseport_socket(sargs.host, sargs.port)
            except OSError as e:
                logger.error("could not bind %s:%d: %s", sargs.host, sargs.port, e)
                return 1
            if workers is not None:
                workers.start(sock.getsockname()[1])
        server.run(sockets=[sock])
    finally:
        app.state.client.close()  # idempotent; covers exits that skipped the lifespan shutdown
    if not server.started and server.exit_code == 0:
        return 1  # could not bind the port (uvicorn logged why)
    logger.info("server stopped")
    return server.exit_code


def run_server(config: EngineConfig, sargs: ServerArgs) -> int:
    if sargs.tokenizer_worker_num == 1:
        return _serve(config, sargs, 0, None)
    ipc_dir = tempfile.mkdtemp(prefix="plait-ipc-")
    try:
        return _serve(config, sargs, 0, ipc_dir, HTTPWorkers(config, sargs, ipc_dir))
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def cmd_serve(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    """Entry of ``plait serve`` (the CLI parses; engine flags arrive as EngineConfig options)."""
    model = args.model
    if model is None:
        from plait.models.demo import demo_model

        demo = demo_model()
        model = str(demo.path)
        logger.info("no --model given: serving the built-in demo model, %s, at %s", demo.description, model)
    sargs = server_args_from(args)  # checked before the model loads
    config = EngineConfig.from_kwargs(model=model, **engine_options)
    check_text_flags(config, sargs)
    return run_server(config, sargs)
