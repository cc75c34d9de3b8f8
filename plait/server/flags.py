"""Command-line flags of ``plait serve`` and ``plait bench serve`` (argparse only: importing this
must not need the server extra, since the CLI builds every subcommand's parser)."""

from __future__ import annotations

import argparse

from plait.server.operator_flags import add_operator_flags

DEFAULT_MAX_PAYLOAD_BYTES = 16 * 1024 * 1024
# The keys of plait.server.function_call.TOOL_CALL_PARSERS and plait.server.reasoning.REASONING_PARSERS.
TOOL_CALL_PARSER_NAMES = ("llama3", "hermes", "qwen25", "mistral", "pythonic", "gpt-oss", "qwen3_coder")
REASONING_PARSER_NAMES = ("qwen3", "deepseek-r1", "gpt-oss")
# vLLM's names of the same parsers.
VLLM_PARSER_NAMES = {"llama3_json": "llama3", "openai": "gpt-oss", "deepseek_r1": "deepseek-r1"}


def parser_name(raw: str) -> str:
    return VLLM_PARSER_NAMES.get(raw, raw)


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("server")
    group.add_argument("--host", default="127.0.0.1")
    group.add_argument("--port", type=int, default=30000)
    group.add_argument("--served-model-name", default=None, nargs="+", metavar="NAME",
                       help="the model name clients send (default: the --model path); more names (vLLM's) are "
                       "accepted too, the first is the one responses carry")
    group.add_argument("--max-queued-requests", type=int, default=None,
                       help="waiting requests beyond which new ones get a 503 (default: unlimited)")
    group.add_argument("--max-payload-bytes", type=int, default=DEFAULT_MAX_PAYLOAD_BYTES,
                       help="request bodies over this size get a 413")
    group.add_argument("--tokenizer-worker-num", "--api-server-count", type=int, default=None, metavar="N",
                       help="HTTP processes sharing the port and the scheduler process; each parses, "
                            "tokenizes and streams its own connections' requests (several take a burst of "
                            "requests in faster than one). Default: one per 4 CPUs, at most 4, at least 1")
    group.add_argument("--shutdown-timeout", type=float, default=30.0,
                       help="seconds in-flight requests get to finish after SIGTERM before they are aborted")
    # Names listed here, not imported: this module must not need the server extra.
    group.add_argument("--tool-call-parser", default=None, type=parser_name, choices=TOOL_CALL_PARSER_NAMES,
                       help="find tool calls in the output of chat requests with tool_choice 'auto' "
                       "(docs/tool-calling.md; vLLM's llama3_json and openai are llama3 and gpt-oss)")
    group.add_argument("--enable-auto-tool-choice", action="store_true",
                       help="accepted for vLLM commands: tool_choice 'auto' works whenever --tool-call-parser is "
                       "given")
    group.add_argument("--reasoning-parser", default=None, type=parser_name, choices=REASONING_PARSER_NAMES,
                       help="move the thinking span of chat outputs into reasoning_content (vLLM's deepseek_r1 "
                       "is deepseek-r1)")
    group.add_argument("--seed", dest="random_seed", type=int, default=None,
                       help="vLLM's spelling of --random-seed")
    group.add_argument("--incremental-streaming-output", "--stream-output", action="store_true",
                       help="/generate's stream events carry the new text and output_ids only (SGLang's; "
                       "default: the text and ids so far)")
    group.add_argument("--ssl-keyfile", default=None, metavar="FILE", help="serve HTTPS with this private key "
                       "(PEM), together with --ssl-certfile")
    group.add_argument("--ssl-certfile", default=None, metavar="FILE", help="the certificate (PEM) of --ssl-keyfile")
    group.add_argument("--chat-template", default=None, metavar="FILE",
                       help="a Jinja chat template that replaces the checkpoint's (e.g. a tools-aware one)")
    group.add_argument("--response-role", default="assistant", metavar="ROLE",
                       help="vLLM's: the role of a chat reply to a request with add_generation_prompt (the default "
                            "'assistant'); a request without one is answered in its last message's role")
    add_operator_flags(parser)


def add_bench_serve_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("bench serve")
    group.add_argument("--workload", default="serving", choices=("serving", "serving-burst"),
                       help="serving: arrivals at --request-rate; serving-burst: every request at once, with the "
                       "offline Engine on the same requests as the peer (ratio_vs_peer = server / offline)")
    group.add_argument("--no-peer", action="store_true",
                       help="serving-burst: skip the offline Engine run (peer null)")
    group.add_argument("--peer-idle-s", type=float, default=0.0, metavar="S",
                       help="serving-burst: the offline Engine idles S seconds between its untimed and its timed "
                       "pass (the server meets the burst after the bench's set-up, idle; 0: right after)")
    group.add_argument("--no-stream", action="store_true",
                       help="requests that do not stream: one JSON answer each (its arrival is the TTFT too), as "
                            "batch clients send; the server then reports a request's first token and its end only")
    group.add_argument("--tokenizer-worker-num", type=int, default=None, metavar="N",
                       help="HTTP processes of the server this starts (plait serve --tokenizer-worker-num; "
                            "default: that flag's)")
    group.add_argument("--client-procs", type=int, default=1,
                       help="load-generator processes (one Python process parses some 10k events/s; use several "
                       "for a burst at a GPU's token rate)")
    group.add_argument("--base-url", default=None,
                       help="server to load, e.g. http://127.0.0.1:30000 (default: start `plait serve` here)")
    group.add_argument("--num-prompts", type=int, default=1000)
    group.add_argument("--request-rate", type=float, default=float("inf"),
                       help="Poisson arrival rate in requests/s (inf: all at once)")
    group.add_argument("--max-concurrency", type=int, default=None,
                       help="at most this many requests in flight (with --request-rate inf: fixed concurrency)")
    group.add_argument("--input-len", type=int, default=128, help="prompt tokens (maximum when ranged)")
    group.add_argument("--output-len", type=int, default=128, help="generated tokens (maximum when ranged)")
    group.add_argument("--range-ratio", type=float, default=1.0,
                       help="lengths uniform in [ratio * len, len]; 1.0 = fixed lengths")
    group.add_argument("--seed", type=int, default=0, help="seed of the prompts, lengths and arrival times")
    group.add_argument("--shape", default=None,
                       help="a benchmark shape (llama-3.2-1b, llama-3.1-8b, qwen3-0.6b): without --model, serve "
                       "it with dummy weights; with --model / --base-url it must be what the model is (other "
                       "names only label the result; default: from the model)")
    group.add_argument("--out", default="benchmarks/results", help="directory for the result JSON")
    group.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")
