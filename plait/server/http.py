"""HTTP plumbing under the OpenAI routes: the request-body limit, server-sent events, and running a
handler only while its client stays connected."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, Coroutine
from typing import Any, TypeVar

from fastapi import Request
from starlette.requests import ClientDisconnect
from starlette.responses import StreamingResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from plait.engine.messages import RequestUpdate
from plait.server.errors import APIError

T = TypeVar("T")


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

    def __init__(self, content: AsyncGenerator[bytes, None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._gen = content

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        finally:
            await self._gen.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        with contextlib.suppress(OSError, ClientDisconnect):
            await super().__call__(scope, receive, send)


# The event that ends an OpenAI stream.
SSE_DONE = b"data: [DONE]\n\n"

try:  # several times faster per chunk than the json module; the server extra installs it
    import orjson

    def _json_bytes(obj: dict[str, Any]) -> bytes:
        return orjson.dumps(obj, option=orjson.OPT_NON_STR_KEYS)
except ImportError:  # the same JSON (compact, UTF-8, non-ASCII raw) from the standard library
    def _json_bytes(obj: dict[str, Any]) -> bytes:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()


def sse(obj: dict[str, Any]) -> bytes:
    """One server-sent event carrying ``obj`` as compact JSON (UTF-8)."""
    return b"data: " + _json_bytes(obj) + b"\n\n"


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, coro: Coroutine[Any, Any, T]) -> T | None:
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


async def read_acknowledgements(gen: AsyncGenerator[tuple[int, RequestUpdate], None], count: int,
                                ) -> list[tuple[int, RequestUpdate]]:
    """Read a request's updates until each of its ``count`` scheduler requests was acknowledged
    (admitted to the queue, or refused): a stream commits to a 200 only after that, so a full queue
    is a 503 rather than an error inside a 200 stream. Returns what was read, to be replayed."""
    seen: set[int] = set()
    buffered = []
    try:
        while len(seen) < count:
            i, upd = await anext(gen)
            seen.add(i)
            buffered.append((i, upd))
    except BaseException:
        await gen.aclose()
        raise
    return buffered


async def replayed(primed: list[tuple[int, RequestUpdate]], gen: AsyncGenerator[tuple[int, RequestUpdate], None],
                   ) -> AsyncGenerator[tuple[int, RequestUpdate], None]:
    """The updates ``read_acknowledgements`` read, then the rest of ``gen``."""
    for item in primed:
        yield item
    async for item in gen:
        yield item
