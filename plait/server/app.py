"""The OpenAI-compatible HTTP application (FastAPI), run by ``plait serve`` in the HTTP process: the
routes, their error handling and the app's lifespan.

This process tokenizes (prompts and chat templates), validates (plait.engine.frontend, the same
checks as the offline Engine), and turns scheduler updates into OpenAI responses
(plait.server.openai_serving). Incremental detokenization and stop strings run in the scheduler
process (see plait.engine.scheduler_process); the text arrives here as deltas. Every route answers
errors in OpenAI's shape (plait.server.errors): validation failures are 400 (FastAPI's 422 is
overridden), unknown models 404, oversized bodies 413, a full queue or a starting/stopping server
503, anything unexpected 500 without harming other requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
from collections.abc import AsyncIterator, Callable, Coroutine
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response

from plait.config import EngineConfig
from plait.server import protocol
from plait.server.errors import APIError, bad_request
from plait.server.flags import DEFAULT_MAX_PAYLOAD_BYTES
from plait.server.http import PayloadLimitMiddleware
from plait.server.metrics import CONTENT_TYPE, SHARE_INTERVAL_S, ServerMetrics
from plait.server.native_api import NativeServing, add_native_routes
from plait.server.openai_serving import OpenAIServing
from plait.server.operator_flags import DEFAULT_MAX_STREAM_BUFFER
from plait.server.request_log import RequestLog
from plait.server.scheduler_client import SchedulerClient, State
from plait.server.security import install_access_control
from plait.server.tool_calling import ChatOptions

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: tuple[str, ...] | None = None  # the first names the model; the others are accepted too
    max_queued_requests: int | None = None  # waiting requests beyond which new ones get a 503
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM
    ssl_keyfile: str | None = None  # both set: HTTPS
    ssl_certfile: str | None = None
    # Chat completions (plait.server.tool_calling): parser names and a template file path.
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    response_role: str = "assistant"  # vLLM's --response-role
    # plait.server.operator_flags
    api_key: str | None = None
    allowed_origins: tuple[str, ...] | None = None  # None: every origin
    log_requests: bool = False
    log_requests_level: int = 0
    log_level_http: str | None = None  # uvicorn's loggers (None: --log-level's)
    sglang_metrics: bool = False
    trust_request_chat_template: bool = False
    max_stream_buffer: int = DEFAULT_MAX_STREAM_BUFFER
    incremental_streaming_output: bool = False  # /generate's stream events: new text and ids only
    # HTTP processes sharing the port and the scheduler process (SGLang's --tokenizer-worker-num): each
    # parses, validates and streams its own connections' requests. The CLI's default is
    # default_http_processes(); a ServerArgs built in code gets one unless it asks for more.
    tokenizer_worker_num: int = 1

    def __post_init__(self) -> None:
        checks = [
            (0 <= self.port <= 65535, f"--port must be in [0, 65535], got {self.port}"),
            (self.max_queued_requests is None or self.max_queued_requests >= 1,
             f"--max-queued-requests must be >= 1 (or unset: unlimited), got {self.max_queued_requests}"),
            (self.max_payload_bytes >= 1, f"--max-payload-bytes must be >= 1, got {self.max_payload_bytes}"),
            (self.shutdown_timeout >= 0, f"--shutdown-timeout must be >= 0 seconds, got {self.shutdown_timeout}"),
            (self.max_stream_buffer >= 1, f"--max-stream-buffer must be >= 1 update, got {self.max_stream_buffer}"),
            (self.tokenizer_worker_num >= 1,
             f"--tokenizer-worker-num must be >= 1 HTTP process, got {self.tokenizer_worker_num}"),
            ((self.ssl_keyfile is None) == (self.ssl_certfile is None),
             "--ssl-keyfile and --ssl-certfile go together: give both for HTTPS, or neither"),
        ]
        checks += [(os.path.isfile(path), f"--{name.replace('_', '-')} {path!r} is not a file")
                   for name, path in (("ssl_keyfile", self.ssl_keyfile), ("ssl_certfile", self.ssl_certfile))
                   if path is not None]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)


# CPUs per HTTP process in the CLI's default, and that default's ceiling.
CPUS_PER_HTTP_PROCESS = 4
MAX_DEFAULT_HTTP_PROCESSES = 4


def default_http_processes(cpus: int | None = None) -> int:
    """HTTP processes ``plait serve`` starts when --tokenizer-worker-num is not given: one per
    CPUS_PER_HTTP_PROCESS CPUs this process may run on (``cpus``: that count), at most
    MAX_DEFAULT_HTTP_PROCESSES, at least one. One process parses, tokenizes and streams every request in
    turn, so a burst of requests reaches the scheduler over a few hundred ms; several take it in parallel.
    A machine with few CPUs keeps one: the scheduler process needs a core of its own."""
    if cpus is None:
        cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return max(1, min(MAX_DEFAULT_HTTP_PROCESSES, cpus // CPUS_PER_HTTP_PROCESS))


def check_text_flags(config: EngineConfig, args: ServerArgs) -> None:
    """Server flags that read the text refused with --skip-tokenizer-init (no tokenizer, no text)."""
    if not config.skip_tokenizer_init:
        return
    names = ("tool_call_parser", "reasoning_parser", "chat_template")
    given = ["--" + name.replace("_", "-") for name in names if getattr(args, name) is not None]
    if given:
        raise ValueError(f"{', '.join(given)} read the text, which needs the tokenizer: drop them or "
                         "--skip-tokenizer-init")


async def _share_metrics(metrics: ServerMetrics) -> None:
    """Several HTTP processes: write this one's own series for the others' scrapes, periodically."""
    while True:
        metrics.write_share()
        await asyncio.sleep(SHARE_INTERVAL_S)


def build_app(config: EngineConfig, args: ServerArgs, on_fatal: Callable[[str], None] | None = None,
              worker: int = 0, ipc_dir: str | None = None,
              before_scheduler_stop: Callable[[], Coroutine[Any, Any, None]] | None = None) -> FastAPI:
    """The app of HTTP process ``worker`` of ``args.tokenizer_worker_num`` (their IPC paths under
    ``ipc_dir``). ``before_scheduler_stop``: awaited at shutdown before worker 0 stops the scheduler
    process (the other HTTP processes finish their requests first)."""
    model_name, *aliases = args.served_model_name or (config.model,)
    check_text_flags(config, args)
    metrics = ServerMetrics(model_name, sglang_names=args.sglang_metrics)
    if args.tokenizer_worker_num > 1:
        assert ipc_dir is not None
        metrics.share(ipc_dir, worker)
    client = SchedulerClient(config, metrics, args.max_queued_requests, on_fatal,
                             RequestLog(args.log_requests_level) if args.log_requests else None,
                             args.max_stream_buffer, worker, args.tokenizer_worker_num, ipc_dir)
    chat_options = ChatOptions.from_flags(args.tool_call_parser, args.reasoning_parser, args.chat_template,
                                          args.response_role)
    serving = OpenAIServing(client, model_name, config, trust_request_chat_template=args.trust_request_chat_template,
                            max_rendered_chars=args.max_payload_bytes, chat_options=chat_options,
                            model_aliases=tuple(aliases))

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        if worker > 0:
            await client.until_started()
        sharing = asyncio.create_task(_share_metrics(metrics)) if args.tokenizer_worker_num > 1 else None
        try:
            yield
        finally:
            if sharing is not None:
                sharing.cancel()
            if before_scheduler_stop is not None:
                await before_scheduler_stop()
            await client.shutdown()
            serving.prompt_work.close()

    app = FastAPI(title="plait", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.client = client
    app.state.metrics = metrics
    app.state.serving = serving

    async def guarded(handler: Callable[[Request], Coroutine[Any, Any, Response]], request: Request) -> Response:
        try:
            return await handler(request)
        except APIError as e:
            if e.status >= 500:
                logger.warning("%s %s -> %d: %s", request.method, request.url.path, e.status, e.message)
            return e.response()
        except Exception as e:  # a bug for this request only: answer 500 and keep serving the rest
            logger.exception("internal error on %s %s", request.method, request.url.path)
            return APIError(500, f"internal server error: {type(e).__name__}: {e}").response()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await guarded(serving.completions, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await guarded(serving.chat, request)

    @app.get("/v1/models")
    async def models() -> Response:
        return JSONResponse({"object": "list", "data": [serving.model_card()]})

    @app.get("/v1/models/{model:path}")
    async def model(model: str) -> Response:
        try:
            serving.check_model(model)
        except APIError as e:
            return e.response()
        return JSONResponse(serving.model_card())

    @app.get("/health")
    async def health() -> Response:
        if client.state == State.READY:
            return JSONResponse({"status": "ok"})
        reason = client.dead_reason if client.state == State.DEAD else None
        return JSONResponse({"status": client.state.value, "reason": reason}, status_code=503)

    @app.get("/metrics")
    async def metrics_endpoint() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/server_info")
    async def server_info() -> Response:
        return JSONResponse(_server_info(client, serving, args))

    native = NativeServing(client, config, serving.model_name, lambda: _server_info(client, serving, args),
                           serving.prompt_work, incremental_stream=args.incremental_streaming_output,
                           model_aliases=serving.model_aliases)
    add_native_routes(app, native, guarded)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        message, param = protocol.describe_errors(list(errors)) if errors else ("invalid request", None)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    app.add_middleware(PayloadLimitMiddleware, max_bytes=args.max_payload_bytes)
    install_access_control(app, args.api_key, args.allowed_origins)
    return app


def _server_info(client: SchedulerClient, serving: OpenAIServing, args: ServerArgs) -> dict[str, Any]:
    import importlib.metadata

    versions = {}
    for pkg in ("torch", "triton", "transformers"):
        try:
            versions[pkg] = importlib.metadata.version(pkg)
        except importlib.metadata.PackageNotFoundError:
            versions[pkg] = None
    ready = client.ready
    return {
        "state": client.state.value,
        "model": serving.config.model,
        "served_model_name": serving.model_name,
        "attention_backend": serving.attention_backend,
        "config": dataclasses.asdict(serving.config),
        "server_args": {**dataclasses.asdict(args), "api_key": "<set>" if args.api_key else None},
        "scheduler": dataclasses.asdict(ready) if ready is not None else None,
        # Ids past the tokenizer's (padding rows of the embedding) are valid input but not text.
        "tokenizer_vocab_size": len(client.tokenizer) if client.tokenizer is not None else None,
        "num_in_flight": client.num_in_flight,
        "versions": versions,
    }
