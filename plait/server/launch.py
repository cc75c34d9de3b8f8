"""``plait serve``: the HTTP process (uvicorn) plus one scheduler child, and a graceful shutdown.

Process model::

    plait serve (HTTP process: FastAPI on uvicorn, one asyncio loop)
      ├─ tokenize + validate (plait.engine.frontend), build OpenAI responses, /metrics
      └─ ZMQ over IPC ──► plait scheduler-process (one per GPU rank; one on the CPU)
                           model, KV pool, Scheduler.step() loop, detokenization, stop strings

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
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

import uvicorn

from plait.config import EngineConfig
from plait.server.app import ServerArgs, build_app, check_text_flags
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
    def __init__(self, config: uvicorn.Config, client: SchedulerClient, shutdown_timeout: float) -> None:
        super().__init__(config)
        self.client = client
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
    names = args.served_model_name
    return ServerArgs(**{**values, "allowed_origins": flatten_origins(args.allowed_origins),
                         "served_model_name": tuple(names) if names else None})


def run_server(config: EngineConfig, sargs: ServerArgs) -> int:
    holder: dict[str, PlaitServer] = {}
    if sargs.log_level_http is not None:
        logging.getLogger("uvicorn").setLevel(sargs.log_level_http.upper())
    app = build_app(config, sargs, on_fatal=lambda reason: holder["server"].fail(reason))
    uv_config = uvicorn.Config(app, host=sargs.host, port=sargs.port, log_config=None, access_log=False,
                               lifespan="on", timeout_graceful_shutdown=sargs.shutdown_timeout + _UVICORN_GRACE_S,
                               ssl_keyfile=sargs.ssl_keyfile, ssl_certfile=sargs.ssl_certfile)
    server = PlaitServer(uv_config, app.state.client, sargs.shutdown_timeout)
    holder["server"] = server
    try:
        sock = uv_config.bind_socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_SEND_BUFFER_BYTES)
        server.run(sockets=[sock])
    finally:
        app.state.client.close()  # idempotent; covers exits that skipped the lifespan shutdown
    if not server.started and server.exit_code == 0:
        return 1  # could not bind the port (uvicorn logged why)
    logger.info("server stopped")
    return server.exit_code


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
