"""``plait serve`` flags for running a server in production: access control, CORS, request logs,
metric names, request-supplied chat templates and slow streaming clients (argparse only, like
plait.server.flags, which adds them). docs/sglang-compat.md maps each to SGLang's and vLLM's."""

from __future__ import annotations

import argparse
import json

# Updates a streaming request may have waiting for a client that does not read them before it is
# aborted (one update is one scheduler step's tokens of that request; the socket buffers hold what
# the client has not read on top of this).
DEFAULT_MAX_STREAM_BUFFER = 1024
LOG_REQUESTS_LEVELS = (0, 1, 2, 3)
LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def origins_type(raw: str) -> list[str]:
    """One origin, or vLLM's JSON list form (``'["https://a.example", "https://b.example"]'``)."""
    if raw.lstrip().startswith("["):
        try:
            value = json.loads(raw)
        except json.JSONDecodeError as e:
            raise argparse.ArgumentTypeError(f"--allowed-origins: invalid JSON list {raw!r}: {e}") from None
        if not isinstance(value, list) or not all(isinstance(o, str) for o in value):
            raise argparse.ArgumentTypeError(f"--allowed-origins: expected a JSON list of strings, got {raw!r}")
        return value
    return [raw]


def add_operator_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("security, logs and metrics")
    group.add_argument("--api-key", default=None,
                       help="every route but /health, /health_generate, /metrics and CORS preflights needs "
                       "'Authorization: Bearer KEY' (default: no key)")
    group.add_argument("--allowed-origins", type=origins_type, nargs="+", default=None,
                       help="CORS origins allowed to call the server (default: every origin, as SGLang and vLLM)")
    group.add_argument("--log-requests", action="store_true",
                       help="one log line per request: id, status, prompt and output tokens, TTFT, latency")
    group.add_argument("--log-requests-level", type=int, choices=LOG_REQUESTS_LEVELS, default=0,
                       help="what those lines carry: 0 metadata, 1 + sampling parameters, 2 + the first 2048 "
                       "characters of prompt and output, 3 + all of them (default 0: prompts never reach the log)")
    group.add_argument("--disable-log-requests", dest="log_requests", action="store_false", default=False,
                       help="accepted for vLLM commands: no request log lines (plait's default)")
    group.add_argument("--log-level-http", "--uvicorn-log-level", choices=LOG_LEVELS, default=None,
                       help="level of uvicorn's own log lines (default: --log-level's); request lines come "
                       "from --log-requests")
    group.add_argument("--enable-metrics", action="store_true",
                       help="accepted for SGLang commands: /metrics is always on")
    group.add_argument("--enable-cache-report", action="store_true",
                       help="accepted for SGLang commands: usage.prompt_tokens_details.cached_tokens is "
                       "always reported")
    group.add_argument("--sglang-metrics", action="store_true",
                       help="also export SGLang's metric names (sglang:num_running_reqs, sglang:token_usage, ...)")
    group.add_argument("--trust-request-chat-template", action="store_true",
                       help="let requests bring their own chat template (chat_template, or chat_template_kwargs."
                       "chat_template); refused by default, as in vLLM")
    group.add_argument("--max-stream-buffer", type=int, default=DEFAULT_MAX_STREAM_BUFFER,
                       help="updates a stream may have queued for a client that stopped reading before the "
                       "request is aborted")


def flatten_origins(values: list[list[str]] | None) -> tuple[str, ...] | None:
    """argparse gives one list per --allowed-origins value (each may be a JSON list)."""
    if values is None:
        return None
    return tuple(o for group in values for o in group)
