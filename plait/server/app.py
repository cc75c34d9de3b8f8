"""The OpenAI-compatible HTTP application (FastAPI), run by ``plait serve`` in the HTTP process.

This process tokenizes (prompts and chat templates), validates (plait.engine.frontend, the same
checks as the offline Engine), and turns scheduler updates into OpenAI responses. Incremental
detokenization and stop strings run in the scheduler process (see plait.engine.scheduler_process); the
text arrives here as deltas. Every route answers errors in OpenAI's shape (plait.server.errors):
validation failures are 400 (FastAPI's 422 is overridden), unknown models 404, oversized bodies 413,
a full queue or a starting/stopping server 503, anything unexpected 500 without harming other
requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plait.config import EngineConfig
from plait.engine.frontend import ContextLengthError, Frontend, PreparedRequest
from plait.engine.messages import RequestUpdate
from plait.sampling.params import SamplingParams, seed_to_int64
from plait.server import protocol
from plait.server.errors import APIError, bad_request
from plait.server.flags import DEFAULT_MAX_PAYLOAD_BYTES
from plait.server.metrics import CONTENT_TYPE, ServerMetrics
from plait.server.scheduler_client import SchedulerClient, State

logger = logging.getLogger(__name__)

T = TypeVar("T")

# OpenAI's default max_tokens for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16


@dataclass(frozen=True)
class ServerArgs:
    host: str = "127.0.0.1"
    port: int = 30000
    served_model_name: str | None = None
    max_queued_requests: int | None = None  # waiting requests beyond which new ones get a 503
    max_payload_bytes: int = DEFAULT_MAX_PAYLOAD_BYTES
    shutdown_timeout: float = 30.0  # seconds in-flight requests get after SIGTERM


# --- transport helpers ----------------------------------------------------------------------------
class PayloadLimitMiddleware:
    """413 for request bodies over the limit, whether announced (Content-Length) or streamed
    (chunked). The body is buffered here (it is small by construction) and replayed to the app."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        announced = headers.get(b"content-length")
        if announced is not None and announced.isdigit() and int(announced) > self.max_bytes:
            await self._too_large(int(announced), receive, send)
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body += message.get("body", b"")
            more = message.get("more_body", False)
            if len(body) > self.max_bytes:
                await self._too_large(len(body), receive, send, more)
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: wait for http.disconnect

        await self.app(scope, replay, send)

    async def _too_large(self, size: int, receive: Receive, send: Send, more: bool = True) -> None:
        # Read (and drop) the rest of a moderately oversized body first: answering while the client
        # is still uploading makes many clients see a connection reset instead of the 413.
        drained = 0
        while more and drained < 16 * self.max_bytes:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            drained += len(message.get("body", b""))
            more = message.get("more_body", False)
        err = APIError(413, f"request body of {size} bytes is over the limit of {self.max_bytes} bytes "
                            "(--max-payload-bytes)", code="payload_too_large")
        await err.response()({"type": "http"}, receive, send)


class SSEResponse(StreamingResponse):
    """text/event-stream that closes its generator at once when the client goes away (so the
    request is aborted now, not when the generator is garbage-collected) and does not log a
    disconnect as a server error."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = content

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self._gen.aclose()  # type: ignore[attr-defined]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(OSError, ClientDisconnect):
            await super().__call__(scope, receive, send)


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _unless_disconnected(request: Request, coro: Coroutine[Any, Any, T]) -> T | None:
    """Run ``coro``; if the client disconnects first, cancel it (its generators abort their
    requests) and return None."""
    task = asyncio.ensure_future(coro)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():  # the client left (or this handler itself is being cancelled)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


# --- per-choice accumulation ----------------------------------------------------------------------
@dataclass
class _Choice:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_offset: int = 0  # running character offset of token strings (completions logprobs)

    def add(self, upd: RequestUpdate) -> None:
        self.text += upd.text
        self.token_ids += upd.token_ids
        if upd.logprobs:
            self.logprobs += upd.logprobs
        if upd.top_logprobs:
            self.top_logprobs += upd.top_logprobs
        self.completion_tokens = max(self.completion_tokens, upd.completion_tokens)
        self.cached_tokens = upd.cached_tokens
        if upd.finish_reason is not None:
            self.finish_reason = upd.finish_reason


@dataclass
class _Job:
    """One HTTP generation request after validation."""

    kind: str  # "completion" | "chat"
    id: str
    created: int
    model: str
    prompt_ids: list[list[int]]
    n: int
    prepared: list[PreparedRequest]
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    include_usage: bool

    def usage(self, choices: Sequence[_Choice]) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(c.completion_tokens for c in choices)
        cached = sum(choices[p * self.n].cached_tokens for p in range(len(self.prompt_ids)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


# --- the OpenAI endpoints -------------------------------------------------------------------------
class OpenAIServing:
    def __init__(self, client: SchedulerClient, model_name: str, config: EngineConfig) -> None:
        self.client = client
        self.model_name = model_name
        self.config = config
        self.created = int(time.time())
        self._token_pieces: dict[int, tuple[str, bytes]] = {}

    @property
    def frontend(self) -> Frontend:
        assert self.client.frontend is not None, "check_accepting() runs first"
        return self.client.frontend

    def _check_model(self, name: str) -> None:
        if name not in (self.model_name, self.config.model):
            raise APIError(404, f"The model `{name}` does not exist. This server serves `{self.model_name}`.",
                           param="model", code="model_not_found")

    def _sampling(self, req: protocol.GenerationRequest, max_new: int, logprobs: bool, top: int,
                  max_name: str) -> SamplingParams:
        try:
            return self.frontend.sampling_params(protocol.sampling_dict(req, max_new, logprobs, top))
        except ValueError as e:
            raise protocol.value_error_to_api(e, max_name) from None

    def _check_length(self, ids: list[int], sp: SamplingParams, noun: str) -> None:
        try:
            self.frontend.check_length(len(ids), sp)
        except ContextLengthError as e:
            raise bad_request(e.openai_message(noun), "messages" if noun == "messages" else "prompt",
                              "context_length_exceeded") from None

    def _fan_out(self, prompt_ids: list[list[int]], sp: SamplingParams, n: int) -> list[PreparedRequest]:
        out = []
        for ids in prompt_ids:
            for j in range(n):
                # n choices of one seeded request: seed, seed+1, ... so they differ yet reproduce.
                seed = seed_to_int64(sp.seed + j) if sp.seed is not None else self.frontend.draw_seed(sp)
                out.append(PreparedRequest(ids, sp, seed))
        return out

    # --- /v1/completions ---
    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for p in prompts:
            try:
                out.append(self.frontend.tokenize(p))
            except ValueError as e:
                raise bad_request(str(e), "prompt") from None
        return out

    async def completions(self, request: Request) -> Response:
        req = protocol.parse_request(protocol.CompletionRequest, await request.body())
        protocol.check_completion(req)
        self._check_model(req.model)
        self.client.check_accepting()
        max_new = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        top = req.logprobs or 0
        sp = self._sampling(req, max_new, req.logprobs is not None, top, "max_tokens")
        prompt_ids = self._completion_prompts(req.prompt)
        for ids in prompt_ids:
            self._check_length(ids, sp, "prompt")
        job = _Job("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), req.model, prompt_ids, req.n,
                   self._fan_out(prompt_ids, sp, req.n), req.logprobs is not None, top, req.return_token_ids,
                   bool(req.stream_options and req.stream_options.include_usage))
        return await self._respond(request, job, req.stream)

    # --- /v1/chat/completions ---
    def _chat_prompt(self, req: protocol.ChatCompletionRequest) -> list[int]:
        tok = self.client.tokenizer
        if not getattr(tok, "chat_template", None):
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions", "messages")
        kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt,
                                  "continue_final_message": req.continue_final_message}
        kwargs.update(req.chat_template_kwargs or {})
        kwargs["tokenize"] = False
        try:
            text = tok.apply_chat_template(protocol.chat_messages(req), **kwargs)
        except Exception as e:  # a template or its kwargs rejected these messages: the client's input
            raise bad_request(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                              "messages") from None
        # The template writes the special tokens (BOS, turn markers) itself.
        ids = tok.encode(text, add_special_tokens=False)
        try:
            self.frontend.check_input_ids(ids)
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return ids

    async def chat(self, request: Request) -> Response:
        req = protocol.parse_request(protocol.ChatCompletionRequest, await request.body())
        protocol.check_chat(req)
        self._check_model(req.model)
        self.client.check_accepting()
        ids = self._chat_prompt(req)
        if req.max_completion_tokens is not None:
            max_name, max_new = "max_completion_tokens", req.max_completion_tokens
        elif req.max_tokens is not None:
            max_name, max_new = "max_tokens", req.max_tokens
        else:  # OpenAI: up to the context limit
            max_name, max_new = "max_completion_tokens", max(1, self.frontend.limits.max_request_tokens - len(ids))
        top = req.top_logprobs or 0
        sp = self._sampling(req, max_new, req.logprobs, top, max_name)
        self._check_length(ids, sp, "messages")
        job = _Job("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), req.model, [ids], req.n,
                   self._fan_out([ids], sp, req.n), req.logprobs, top, req.return_token_ids,
                   bool(req.stream_options and req.stream_options.include_usage))
        return await self._respond(request, job, req.stream)

    # --- running a job ---
    async def _respond(self, request: Request, job: _Job, stream: bool) -> Response:
        gen = self.client.generate(job.prepared, stream=stream)
        if not stream:
            body = await _unless_disconnected(request, self._full(job, gen))
            return JSONResponse(body) if body is not None else Response(status_code=499)
        # Commit to a 200 only once every choice was accepted by the scheduler (a full queue must be
        # a 503, not an error inside a 200 stream): read up to the acknowledgements first.
        primed = await _unless_disconnected(request, self._prime(job, gen))
        if primed is None:
            return Response(status_code=499)
        return SSEResponse(self._stream(job, gen, primed))

    async def _prime(self, job: _Job, gen: AsyncIterator[tuple[int, RequestUpdate]]) -> list[tuple[int, RequestUpdate]]:
        seen: set[int] = set()
        buffered = []
        try:
            while len(seen) < len(job.prepared):
                i, upd = await anext(gen)
                seen.add(i)
                buffered.append((i, upd))
        except BaseException:
            await gen.aclose()  # type: ignore[attr-defined]
            raise
        return buffered

    async def _full(self, job: _Job, gen: AsyncIterator[tuple[int, RequestUpdate]]) -> dict[str, Any]:
        choices = [_Choice() for _ in job.prepared]
        try:
            async for i, upd in gen:
                choices[i].add(upd)
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
        out = []
        for i, c in enumerate(choices):
            lp = self._logprobs(job, c, c.token_ids, c.logprobs, c.top_logprobs)
            if job.kind == "chat":
                choice: dict[str, Any] = {"index": i, "message": {"role": "assistant", "content": c.text},
                                          "logprobs": lp, "finish_reason": c.finish_reason}
            else:
                choice = {"index": i, "text": c.text, "logprobs": lp, "finish_reason": c.finish_reason}
            if job.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = job.prompt_ids[i // job.n]
            out.append(choice)
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": out,
                "usage": job.usage(choices)}

    async def _stream(self, job: _Job, gen: AsyncIterator[tuple[int, RequestUpdate]],
                      primed: list[tuple[int, RequestUpdate]]) -> AsyncIterator[str]:
        chat = job.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": job.id, "object": obj, "created": job.created, "model": job.model}
        if job.include_usage:
            head["usage"] = None
        choices = [_Choice() for _ in job.prepared]

        def chunk(i: int, upd: RequestUpdate | None, finish: str | None, first: bool = False) -> str:
            c = choices[i]
            lp = None
            if upd is not None and upd.token_ids:
                lp = self._logprobs(job, c, upd.token_ids, upd.logprobs or [], upd.top_logprobs or [])
            text = upd.text if upd is not None else ""
            if chat:
                delta: dict[str, Any] = {"role": "assistant", "content": ""} if first else (
                    {"content": text} if upd is not None else {})
                choice: dict[str, Any] = {"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
            if job.return_token_ids:
                choice["token_ids"] = upd.token_ids if upd is not None else []
                if first or (not chat and upd is not None and c.completion_tokens == len(upd.token_ids)):
                    choice["prompt_token_ids"] = job.prompt_ids[i // job.n]
            return sse({**head, "choices": [choice]})

        async def updates() -> AsyncIterator[tuple[int, RequestUpdate]]:
            for item in primed:
                yield item
            async for item in gen:
                yield item

        try:
            if chat:
                for i in range(len(choices)):
                    yield chunk(i, None, None, first=True)
            async for i, upd in updates():
                choices[i].add(upd)
                has_content = bool(upd.text or upd.token_ids)
                if chat:
                    if has_content:
                        yield chunk(i, upd, None)
                    if upd.finish_reason is not None:
                        yield chunk(i, None, upd.finish_reason)
                elif has_content or upd.finish_reason is not None:
                    yield chunk(i, upd, upd.finish_reason)
            if job.include_usage:
                yield sse({**head, "choices": [], "usage": job.usage(choices)})
        except APIError as e:  # the status line went out already: report in-band, as OpenAI does
            yield sse(e.body())
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
        yield "data: [DONE]\n\n"

    # --- logprobs ---
    def _token(self, tid: int) -> tuple[str, bytes]:
        piece = self._token_pieces.get(tid)
        if piece is None:
            piece = self._token_pieces[tid] = token_piece(self.client.tokenizer, tid)
        return piece

    def _token_text(self, tid: int) -> str:
        return self._token(tid)[0]

    def _chat_entry(self, tid: int, lp: float) -> dict[str, Any]:
        name, raw = self._token(tid)
        return {"token": name, "logprob": lp, "bytes": list(raw)}

    def _logprobs(self, job: _Job, c: _Choice, ids: Sequence[int], lps: Sequence[float],
                  tops: Sequence[Sequence[tuple[int, float]]]) -> dict[str, Any] | None:
        if not job.logprobs:
            return None
        if job.kind == "chat":
            content = []
            for k, (tid, lp) in enumerate(zip(ids, lps, strict=False)):
                top = [self._chat_entry(t, v) for t, v in (tops[k] if k < len(tops) else [])]
                content.append({**self._chat_entry(tid, lp), "top_logprobs": top})
            return {"content": content}
        tokens, offsets, top_dicts = [], [], []
        for k, tid in enumerate(ids):
            s = self._token_text(tid)
            tokens.append(s)
            offsets.append(c.text_offset)
            c.text_offset += len(s)
            if job.top_logprobs:
                top_dicts.append({self._token_text(t): v for t, v in (tops[k] if k < len(tops) else [])})
        return {"tokens": tokens, "token_logprobs": list(lps[: len(ids)]),
                "top_logprobs": top_dicts if job.top_logprobs else None, "text_offset": offsets}

    # --- other endpoints ---
    def model_card(self) -> dict[str, Any]:
        limits = self.client.frontend.limits.max_request_tokens if self.client.frontend else None
        ready = self.client.ready
        # The effective attention backend (pair), as built: e.g. hybrid(prefill=torch_flash,decode=triton).
        backend = ready.runner_info.get("attention_backend") if ready is not None else None
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "plait",
                "root": self.config.model, "max_model_len": limits, "attention_backend": backend}


def _byte_decoder() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet (bytes <-> printable characters in BPE pieces)."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


_BYTE_DECODER = _byte_decoder()


def token_piece(tokenizer: Any, tid: int) -> tuple[str, bytes]:
    """One token as logprobs show it: (name, raw bytes). The name is its text, or, for a piece of a
    multi-byte character (which decodes to U+FFFD on its own), OpenAI's ``bytes:\\xNN`` form of its
    raw bytes, so that different partial tokens never share a name."""
    text = tokenizer.decode([tid])
    if "\ufffd" not in text:
        return text, text.encode()
    piece = tokenizer.convert_ids_to_tokens(tid)
    if not isinstance(piece, str):
        return text, text.encode()
    if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # sentencepiece byte fallback
        raw = bytes([int(piece[3:5], 16)])
    elif piece and all(ch in _BYTE_DECODER for ch in piece):  # byte-level BPE
        raw = bytes(_BYTE_DECODER[ch] for ch in piece)
    else:
        return text, text.encode()
    return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def build_app(config: EngineConfig, args: ServerArgs,
              on_startup_failure: Callable[[str], None] | None = None) -> FastAPI:
    metrics = ServerMetrics()
    client = SchedulerClient(config, metrics, args.max_queued_requests, on_startup_failure)
    serving = OpenAIServing(client, args.served_model_name or config.model, config)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        client.start()
        try:
            yield
        finally:
            await client.shutdown()

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
            serving._check_model(model)
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

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> Response:
        errors = exc.errors()
        message, param = protocol.describe_errors(list(errors)) if errors else ("invalid request", None)
        return bad_request(message, param).response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        return APIError(exc.status_code, str(exc.detail)).response()

    app.add_middleware(PayloadLimitMiddleware, max_bytes=args.max_payload_bytes)
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
        "config": dataclasses.asdict(serving.config),
        "server_args": dataclasses.asdict(args),
        "scheduler": dataclasses.asdict(ready) if ready is not None else None,
        # Ids past the tokenizer's (padding rows of the embedding) are valid input but not text.
        "tokenizer_vocab_size": len(client.tokenizer) if client.tokenizer is not None else None,
        "num_in_flight": client.num_in_flight,
        "versions": versions,
    }
