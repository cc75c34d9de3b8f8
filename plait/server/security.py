"""Access control of the HTTP server: the API key and CORS.

``--api-key``: every request needs ``Authorization: Bearer <key>``, except CORS preflights (OPTIONS)
and the routes a load balancer or Prometheus polls without credentials (``EXEMPT_PATHS``, as in
SGLang). Others get a 401 in OpenAI's error shape. The key is compared in constant time.

CORS: every origin is allowed by default (SGLang and vLLM do the same); ``--allowed-origins``
restricts it. The CORS layer is the outermost one, so a 401 or a 413 carries the CORS headers too and
a browser can read why it was refused.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from fastapi import FastAPI
from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Receive, Scope, Send

from plait.server.errors import APIError

# Reachable without the key: health checks and the Prometheus scrape.
EXEMPT_PATHS: frozenset[str] = frozenset({"/health", "/health_generate", "/metrics"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    def authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope["headers"]:
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        # compare_digest runs in time independent of where the bytes differ.
        return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.key)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS" or scope["path"] in EXEMPT_PATHS
                or self.authorized(scope)):
            await self.app(scope, receive, send)
            return
        err = APIError(401, "Incorrect or missing API key: send 'Authorization: Bearer <key>' with the key the "
                       "server was started with (--api-key)", code="invalid_api_key")
        response = err.response()
        response.headers["WWW-Authenticate"] = "Bearer"
        await response(scope, receive, send)


def install_access_control(app: FastAPI, api_key: str | None, allowed_origins: Sequence[str] | None) -> None:
    """Add the API-key check and then CORS around it; call after every other middleware (the last one
    added is the outermost)."""
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins) if allowed_origins else ["*"],
                       allow_methods=["*"], allow_headers=["*"], allow_credentials=False)
