"""``plait bench serve``: the `serving` workload (docs/benchmarks.md), an async load generator for any
OpenAI-compatible server.

Requests are random token-id prompts sent to ``/v1/completions`` with ``stream``, ``ignore_eos`` and
``return_token_ids`` (so every output token is counted and timed exactly, whatever its text).
Arrivals are Poisson at ``--request-rate`` (or all at once), optionally capped at
``--max-concurrency`` in flight; lengths are fixed or uniform in ``[range_ratio * len, len]``.

Reported: output tokens/s as the metric, plus request and token throughput, TTFT, ITL
(time between consecutive tokens of one request) and end-to-end latency p50/p99, errors, and the KV
slots still in use once the run is over (read from the server's /metrics: must be 0). The
`serving` workload has no serving peer on the CPU, so ``peer`` is null there. `serving-burst`
(``--workload serving-burst``) sends every request at once and then runs the offline ``Engine`` on
the same requests (plait.server.bench_peer): ``ratio_vs_peer`` is the server's output tok/s over
the offline engine's, with both TTFT p50s beside it. ``--client-procs`` spreads the load generator
over several processes, so that the client's own parsing does not set the pace.

Without ``--base-url`` a ``plait serve`` subprocess is started with the engine flags given, on a
free port, and stopped (SIGTERM) at the end.
"""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import os
import pathlib
import random
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import AsyncIterator, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import httpx

from plait import envs
from plait.bench.host_cpu import cpu_use, process_tree, read_counters
from plait.bench.results import git_commit, host_info
from plait.bench.shapes import SHAPES, write_shape_dir
from plait.engine.heap import startup_heap_frozen
from plait.engine.scheduler_process import steps_path
from plait.server import bench_http

METRIC = "output_tok_s"
T = TypeVar("T")

try:
    from orjson import dumps as _dumps
    from orjson import loads as _loads
except ImportError:
    _loads = json.loads

    def _dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()


@dataclass
class RequestResult:
    prompt_len: int
    output_len: int  # asked for
    ok: bool = False
    error: str | None = None
    tokens: int = 0
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    e2e: float | None = None
    finish_reason: str | None = None
    chunks: int = 0  # data events that carried a choice
    # time.perf_counter() when the request was sent and when its answer ended (CLOCK_MONOTONIC on
    # Linux, one clock for every client process on the host), for the run's timeline.
    sent: float | None = None
    done: float | None = None


def percentile(values: list[float], q: float) -> float | None:
    """Linear-interpolated percentile (numpy's default) without numpy."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def make_requests(n: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int) -> list[tuple[list[int], int]]:
    if not 0.0 < range_ratio <= 1.0:
        raise ValueError(f"range_ratio must be in (0, 1], got {range_ratio}")
    rng = random.Random(seed)
    # Keep clear of the lowest ids, where tokenizers put their special tokens.
    lo, hi = min(16, vocab_size - 1), vocab_size - 1  # randint: both ends included
    out = []
    for _ in range(n):
        plen = rng.randint(max(1, math.ceil(input_len * range_ratio)), input_len)
        olen = rng.randint(max(1, math.ceil(output_len * range_ratio)), output_len)
        out.append(([rng.randint(lo, hi) for _ in range(plen)], olen))
    return out


async def sse_lines(chunks: AsyncIterator[bytes]) -> AsyncIterator[str]:
    """The lines of an event stream, split on bytes at CRLF, LF or CR only (the SSE line ends, and
    the only ones ``bytes.splitlines`` knows). Splitting decoded text instead (``aiter_lines``) also
    breaks at U+0085, U+2028 and U+2029, which are legal raw inside the JSON of a data line."""
    buf = b""
    async for chunk in chunks:
        lines = (buf + chunk).splitlines(keepends=True)
        # The last piece stays buffered while it has no line end yet, or ends in a CR that may be the
        # first half of a CRLF.
        buf = lines.pop() if lines and (lines[-1].endswith(b"\r") or not lines[-1].endswith(b"\n")) else b""
        for line in lines:
            yield line.rstrip(b"\r\n").decode("utf-8")
    if buf:
        yield buf.rstrip(b"\r").decode("utf-8")


async def _one(url: str, model: str, prompt: list[int], output_len: int, timeout: float,
               stream: bool = True) -> RequestResult:
    """One completion request; ``stream`` False: one JSON answer, whose arrival is both its first token
    and its end (TTFT = end-to-end latency)."""
    res = RequestResult(len(prompt), output_len)
    body = _dumps({"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0, "stream": stream,
                   "ignore_eos": True, "return_token_ids": True})
    start = res.sent = time.perf_counter()
    try:
        async with asyncio.timeout(timeout), bench_http.post(url, body) as r:
            if r.status != 200:
                res.error = f"HTTP {r.status}: {(await r.aread())[:200].decode(errors='replace')}"
                return res
            if stream:
                await _read_stream(r.aiter_bytes(), res, start)
            else:
                choice = _loads(await r.aread())["choices"][0]
                res.chunks, res.tokens = 1, len(choice.get("token_ids") or [])
                res.ttft, res.itls = time.perf_counter() - start, [0.0] * max(0, res.tokens - 1)
                res.finish_reason = choice.get("finish_reason")
    except TimeoutError:
        res.error = f"timed out after {timeout} s"
        return res
    except (OSError, EOFError, ValueError, bench_http.ProtocolError) as e:  # ValueError: bad JSON, long lines
        res.error = f"{type(e).__name__}: {e}"
        return res
    if res.error is not None:
        return res
    res.done = time.perf_counter()
    res.e2e = res.done - start if stream else res.ttft  # an answer's arrival ends the request
    if res.tokens != output_len or res.finish_reason != "length":
        res.error = f"got {res.tokens} of {output_len} tokens, finish_reason {res.finish_reason!r}"
    else:
        res.ok = True
    return res


async def _read_stream(chunks: AsyncIterator[bytes], res: RequestResult, start: float) -> None:
    """A streamed completion's events into ``res``: tokens, chunks, TTFT, inter-token latencies, the
    finish reason, or the error event."""
    last: float | None = None
    async for line in sse_lines(chunks):
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            break
        obj = _loads(data)
        if "error" in obj:
            res.error = obj["error"].get("message", "error event")
            return
        if not obj.get("choices"):
            continue
        choice = obj["choices"][0]
        res.chunks += 1
        k = len(choice.get("token_ids") or [])
        now = time.perf_counter()
        if k:
            if last is None:
                res.ttft = now - start
                res.itls += [0.0] * (k - 1)  # tokens delivered together
            else:
                res.itls += [(now - last) / k] * k
            last = now
            res.tokens += k
        res.finish_reason = choice.get("finish_reason") or res.finish_reason


async def run_load(base_url: str, model: str, requests: list[tuple[list[int], int]], request_rate: float,
                   max_concurrency: int | None, seed: int, timeout: float, stream: bool = True
                   ) -> tuple[list[RequestResult], float]:
    url = base_url.rstrip("/") + "/v1/completions"
    bench_http.split_url(url)  # an http:// URL, or a ValueError before any request
    rng = random.Random(seed + 1)
    sem = asyncio.Semaphore(max_concurrency or len(requests))

    async def gated(prompt: list[int], olen: int) -> RequestResult:
        async with sem:
            return await _one(url, model, prompt, olen, timeout, stream)

    tasks = []
    start = time.perf_counter()
    for prompt, olen in requests:
        tasks.append(asyncio.create_task(gated(prompt, olen)))
        if math.isfinite(request_rate):
            await asyncio.sleep(rng.expovariate(request_rate))
    results = await asyncio.gather(*tasks)
    duration = time.perf_counter() - start
    return list(results), duration


def run_client(coro: Coroutine[Any, Any, T]) -> T:
    """Run the load generator on uvloop where it is installed (as uvicorn serves on it): the
    client's per-event cost is part of what a burst measures."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(coro)


def _load_worker(args: tuple[Any, ...], barrier: Any, out: Any) -> None:
    base_url, model, requests, request_rate, max_concurrency, seed, timeout, stream = args

    async def go() -> tuple[list[RequestResult], float, float]:
        await asyncio.to_thread(barrier.wait)  # every worker starts at once
        start = time.perf_counter()
        results, _ = await run_load(base_url, model, requests, request_rate, max_concurrency, seed, timeout, stream)
        return results, start, time.perf_counter()

    out.put(run_client(go()))


def run_load_procs(base_url: str, model: str, requests: list[tuple[list[int], int]], request_rate: float,
                   max_concurrency: int | None, seed: int, timeout: float, procs: int, stream: bool = True,
                   ) -> tuple[list[RequestResult], float]:
    """``run_load`` spread over ``procs`` client processes (one asyncio loop each: one Python process
    cannot parse the events of a server at tens of thousands of chunks/s). Request i goes to process
    i % procs, each with rate / procs (Poisson arrivals that add up to ``request_rate``) and its share
    of ``max_concurrency``; the duration spans the first start to the last finish."""
    # The heap as it is now (plait, transformers, the prompts) out of the collector's reach while
    # the load runs, as the server does with its own: otherwise every collection in a client scans
    # it, and in a forked worker also touches (copies) its pages, which would count against the
    # server's measured speed. Put back after, so the offline peer runs in the process as it was.
    with startup_heap_frozen():
        return _run_load_procs(base_url, model, requests, request_rate, max_concurrency, seed, timeout, procs,
                               stream)


def _run_load_procs(base_url: str, model: str, requests: list[tuple[list[int], int]], request_rate: float,
                    max_concurrency: int | None, seed: int, timeout: float, procs: int, stream: bool,
                    ) -> tuple[list[RequestResult], float]:
    if procs <= 1:
        return run_client(run_load(base_url, model, requests, request_rate, max_concurrency, seed, timeout,
                                   stream))
    import multiprocessing

    # Forked: starting at once, without importing plait (and torch) again. This process has run no
    # CUDA or torch work yet (the offline peer runs after the load), and holds no thread.
    ctx = multiprocessing.get_context("fork")
    procs = min(procs, len(requests))
    barrier, out = ctx.Barrier(procs), ctx.Queue()
    workers = []
    for k in range(procs):
        share = max(1, max_concurrency // procs) if max_concurrency else None
        args = (base_url, model, requests[k::procs], request_rate / procs, share, seed + 7919 * k, timeout, stream)
        workers.append(ctx.Process(target=_load_worker, args=(args, barrier, out), daemon=True))
    for w in workers:
        w.start()
    parts = [out.get(timeout=timeout + 120) for _ in workers]
    for w in workers:
        w.join()
    results = [r for part in parts for r in part[0]]
    return results, max(p[2] for p in parts) - min(p[1] for p in parts)


def summarize(results: list[RequestResult], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tokens = sum(r.tokens for r in ok)
    in_tokens = sum(r.prompt_len for r in ok)
    ms = 1000.0

    def stats(values: list[float], name: str) -> dict[str, float | None]:
        def scaled(v: float | None) -> float | None:
            return None if v is None else v * ms
        mean = sum(values) / len(values) if values else None
        return {f"{name}_p50_ms": scaled(percentile(values, 50)), f"{name}_p99_ms": scaled(percentile(values, 99)),
                f"{name}_mean_ms": scaled(mean)}

    errors = [r.error for r in results if not r.ok]
    return {
        "num_requests": len(results),
        "completed": len(ok),
        "errors": len(errors),
        "error_examples": sorted(set(e for e in errors if e))[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        METRIC: out_tokens / duration,
        "input_tok_s": in_tokens / duration,
        "total_tok_s": (in_tokens + out_tokens) / duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        # Above 1 where the server streamed several tokens per event (--stream-interval, or a reader
        # that fell behind and got its queued updates merged).
        "tokens_per_chunk": out_tokens / max(1, sum(r.chunks for r in ok)),
        **stats([r.ttft for r in ok if r.ttft is not None], "ttft"),
        **stats([x for r in ok for x in r.itls], "itl"),
        **stats([r.e2e for r in ok if r.e2e is not None], "e2e"),
        "timeline_ms": timeline(ok),
    }


def read_json(path: str) -> Any:
    """A JSON file's value, or None where it is missing or unreadable (a process that did not stop
    cleanly writes none)."""
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def loop_timeline(path: str, t0: float, num_requests: int, first: int = 8) -> dict[str, Any] | None:
    """The scheduler process's loop (its PLAIT_LOOP_TRACE file) in ms after ``t0``, the clients' first
    send (both stamped with time.perf_counter(), one monotonic clock on the host): when it took the
    first message and when it had taken ``num_requests``, when its first step began, its ``first``
    busy iterations (start, messages taken, ms taking them, stepping, and collecting and sending the
    updates, whether it prefilled, requests waiting and running after, the collector's pauses inside)
    and its ``first`` slowest steps (the same, with each one's index among the busy iterations), and
    the collector's pauses over every busy iteration. None without a trace (a scheduler that did not
    stop cleanly writes none)."""
    try:
        with open(path) as f:
            rows = [json.loads(line) for line in f]
    except OSError:
        return None

    def ms(t: float) -> float:
        return 1e3 * (t - t0)

    taken, all_taken = 0, None
    for row in rows:
        taken += row["messages"]
        if all_taken is None and taken >= num_requests:
            all_taken = ms(row["t1"])

    def iteration(r: dict[str, Any]) -> dict[str, Any]:
        return {"at": ms(r["t0"]), "messages": r["messages"], "recv_ms": 1e3 * (r["t1"] - r["t0"]),
                "step_ms": 1e3 * (r["t2"] - r["t1"]), "updates_ms": 1e3 * (r["t4"] - r["t2"]),
                "prefills": r["prefills"], "waiting": r["waiting"], "running": r["running"],
                "gc_ms": 1e3 * r.get("gc_s", 0.0)}

    with_messages = [r for r in rows if r["messages"]]
    stepped = [i for i, r in enumerate(rows) if r["stepped"]]
    slowest = sorted(stepped, key=lambda i: rows[i]["t2"] - rows[i]["t1"], reverse=True)[:first]
    return {"first_message": ms(with_messages[0]["t0"]) if with_messages else None,
            "all_requests_taken": all_taken,
            "first_step": ms(rows[stepped[0]]["t1"]) if stepped else None,
            "iterations": [iteration(r) for r in rows[:first]],
            "slowest_steps": [{"index": i, **iteration(rows[i])} for i in slowest],
            "gc_pause_ms": 1e3 * sum(r.get("gc_s", 0.0) for r in rows)}


def timeline(ok: list[RequestResult]) -> dict[str, float] | None:
    """When, in ms after the first request was sent, the last one was sent, the first and the last
    request got its first token, and the last one ended. Under a burst: how long the sends took to get
    out, and whether the time goes before the first token, in the prefills (up to the last first token)
    or in the decodes after them."""
    firsts = [r.sent + r.ttft for r in ok if r.sent is not None and r.ttft is not None]
    ends = [r.done for r in ok if r.done is not None]
    sent = [r.sent for r in ok if r.sent is not None]
    if not (firsts and ends and sent):
        return None
    t0 = min(sent)
    return {"last_sent": 1e3 * (max(sent) - t0), "first_token": 1e3 * (min(firsts) - t0),
            "last_first_token": 1e3 * (max(firsts) - t0), "last_done": 1e3 * (max(ends) - t0)}


def read_metrics(base_url: str) -> dict[str, float]:
    """The samples of /metrics whose only label is ``model_name`` (or none), as name -> value."""
    text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=30).text
    out = {}
    for line in text.splitlines():
        m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{model_name="[^"]*"\})? (\S+)$', line)
        if m:
            out[m.group(1)] = float(m.group(3))
    return out


LOOP_PHASES = ("recv", "step", "collect", "send")


def scheduler_loop_during(before: dict[str, float], after: dict[str, float]) -> dict[str, Any]:
    """The scheduler process's loop between two /metrics reads: iterations, seconds per phase
    (``LoopSeconds``) and milliseconds per iteration. Set beside the run's duration, it says whether the
    loop kept up: steps that wait for the device, or host work (detokenization, pickling) between them."""
    def delta(name: str) -> float:
        key = f"plait:scheduler_loop_{name}_total"
        return after.get(key, 0.0) - before.get(key, 0.0)

    iterations = int(delta("iterations"))
    seconds = {phase: delta(f"{phase}_seconds") for phase in LOOP_PHASES}
    prefills, prefill_s = int(delta("prefill_iterations")), delta("prefill_step_seconds")
    decodes, decode_s = iterations - prefills, seconds["step"] - prefill_s
    return {"iterations": iterations, **{f"{phase}_s": v for phase, v in seconds.items()},
            "ms_per_iteration": {phase: 1e3 * v / iterations for phase, v in seconds.items()} if iterations else {},
            # The step split by what it ran: steps that prefill (alone or beside decode rows), decode-only ones.
            "prefill_iterations": prefills,
            "step_ms_per_prefill_iteration": 1e3 * prefill_s / prefills if prefills else None,
            "step_ms_per_decode_iteration": 1e3 * decode_s / decodes if decodes else None}


def settled_metrics(base_url: str, timeout: float = 5.0) -> dict[str, float]:
    """/metrics once the server reports nothing running (the last snapshot trails the last response)."""
    deadline = time.monotonic() + timeout
    while True:
        m = read_metrics(base_url)
        if (m.get("plait:num_requests_running", 0) == 0 and m.get("plait:kv_slots_in_use", 0) == 0) \
                or time.monotonic() > deadline:
            return m
        time.sleep(0.05)


# --- a server of our own --------------------------------------------------------------------------
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve_argv(model: str | None, engine_options: dict[str, Any], port: int, http_processes: int | None = None
                ) -> list[str]:
    argv = [sys.executable, "-m", "plait", "serve", "--port", str(port)]
    if http_processes is not None:  # the flag only when asked: left out, the server's default
        argv += ["--tokenizer-worker-num", str(http_processes)]
    if model is not None:
        argv += ["--model", model]
    for key, value in engine_options.items():
        flag = "--random-seed" if key == "seed" else "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif isinstance(value, list | tuple):
            argv += [flag, *map(str, value)]
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def _wait_healthy(base_url: str, proc: subprocess.Popen[bytes], timeout: float = 600.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"plait serve exited with code {proc.returncode} before becoming healthy")
        try:
            if httpx.get(base_url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"plait serve not healthy after {timeout} s")


def _shape_name(info: dict[str, Any]) -> str:
    model = pathlib.Path(info.get("model") or "model")
    return "demo-tiny-llama" if model.name == "demo-model" else model.name


# The fields that make a checkpoint the named shape.
SHAPE_FIELDS = ("model_type", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "vocab_size")


def shape_mismatch(shape: str, model_dir: str | None) -> str | None:
    """Why the checkpoint at ``model_dir`` is not ``shape`` (None when it is)."""
    config_path = pathlib.Path(model_dir or "") / "config.json"
    if model_dir is None or not config_path.is_file():
        return f"its config.json cannot be read here ({model_dir!r})"
    config = json.loads(config_path.read_text())
    wrong = [f"{k} {config.get(k)!r} (the shape has {SHAPES[shape][k]!r})" for k in SHAPE_FIELDS
             if config.get(k) != SHAPES[shape][k]]
    return ", ".join(wrong) or None


def resolve_shape(args: argparse.Namespace, engine_options: dict[str, Any], root: str
                  ) -> tuple[str | None, dict[str, Any]]:
    """The model and engine options to serve. ``--shape`` without ``--model`` / ``--base-url`` serves
    that shape with dummy weights (as ``plait bench latency`` and ``offline`` do). With a model, a shape
    name of the named benchmarks must be what the model is; any other name only labels the result."""
    if args.shape is None or args.model is not None or args.base_url is not None:
        return args.model, engine_options
    if args.shape not in SHAPES:
        raise ValueError(f"--shape {args.shape!r} is not a benchmark shape ({sorted(SHAPES)}): without "
                         "--model it names the model to build with dummy weights; to label a run of "
                         "another model, pass --model (or --base-url) too")
    dummy = {"load_format": "dummy", "dtype": "bfloat16", **engine_options}
    return str(write_shape_dir(root, args.shape)), dummy


def check_served_shape(args: argparse.Namespace, info: dict[str, Any]) -> None:
    if args.shape in SHAPES and (why := shape_mismatch(args.shape, info.get("model"))):
        raise ValueError(f"--shape {args.shape} does not describe the served model {info.get('model')!r}: {why}")


def check_workload(args: argparse.Namespace) -> None:
    if args.client_procs < 1:
        raise ValueError(f"--client-procs must be >= 1, got {args.client_procs}")
    if not 0.0 <= args.peer_idle_s <= 600.0:
        raise ValueError(f"--peer-idle-s must be in [0, 600] seconds, got {args.peer_idle_s}")
    if args.workload == "serving-burst" and (math.isfinite(args.request_rate) or args.max_concurrency is not None):
        raise ValueError("--workload serving-burst sends every request at once: leave --request-rate (inf) and "
                         "--max-concurrency unset")


def _served_model(model: str | None) -> str:
    if model is not None:
        return model
    from plait.models.demo import demo_model

    return str(demo_model().path)


def cmd_bench_serve(args: argparse.Namespace, engine_options: dict[str, Any]) -> int:
    check_workload(args)
    proc: subprocess.Popen[bytes] | None = None
    base_url = args.base_url
    shape_root = tempfile.mkdtemp(prefix="plait-shapes-")
    model, engine_options = resolve_shape(args, engine_options, shape_root)
    peer: dict[str, Any] | None = None
    if base_url is None:
        port = _free_port()
        base_url = f"http://127.0.0.1:{port}"
        print(f"starting plait serve on {base_url}", file=sys.stderr)
        # The scheduler process's loop, iteration by iteration, for the result's ``scheduler_timeline_ms``.
        env = {**os.environ, envs.LOOP_TRACE.name: os.path.join(shape_root, "loop-trace.jsonl")}
        proc = subprocess.Popen(_serve_argv(model, engine_options, port, args.tokenizer_worker_num), env=env)
    try:
        if proc is not None:
            _wait_healthy(base_url, proc)
        info = httpx.get(base_url + "/server_info", timeout=30).json()
        check_served_shape(args, info)
        served_name = httpx.get(base_url + "/v1/models", timeout=30).json()["data"][0]["id"]
        vocab = min(info["scheduler"]["vocab_size"], info.get("tokenizer_vocab_size") or 1 << 62)
        requests = make_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, vocab,
                                 args.seed)
        cached_before = triton_cache_kernels()
        loop_before = read_metrics(base_url)
        # The host's CPUs during the load: the scheduler process, the HTTP processes (the rest of the
        # server's tree), this process and its client processes, and the machine as a whole.
        server_pids = process_tree(proc.pid) if proc is not None else []
        scheduler_pid = (info.get("scheduler") or {}).get("pid")
        cpu_groups = {"scheduler": [p for p in server_pids if p == scheduler_pid],
                      "http": [p for p in server_pids if p != scheduler_pid], "client": [os.getpid()]}
        cpu_before = read_counters([p for pids in cpu_groups.values() for p in pids])
        results, duration = run_load_procs(base_url, served_name, requests, args.request_rate, args.max_concurrency,
                                           args.seed, args.request_timeout, args.client_procs, not args.no_stream)
        cpu_after = read_counters([p for pids in cpu_groups.values() for p in pids])
        summary = summarize(results, duration)
        summary["host_cpu"] = cpu_use(cpu_before, cpu_after, cpu_groups)
        compiled = triton_cache_kernels() - cached_before
        summary["triton_compiled_during_run"] = dict(Counter(name for _, name in compiled))
        after = settled_metrics(base_url)
        summary["kv_slots_in_use_after"] = int(after.get("plait:kv_slots_in_use", -1))
        summary["num_requests_running_after"] = int(after.get("plait:num_requests_running", -1))
        summary["num_retractions"] = int(after.get("plait:num_retractions_total", 0))
        summary["scheduler_loop"] = scheduler_loop_during(loop_before, after)
        if proc is not None:
            stop_server(proc)  # the scheduler process writes its loop trace as it stops
            sent = [r.sent for r in results if r.sent is not None]
            trace = os.path.join(shape_root, "loop-trace.jsonl")
            summary["scheduler_timeline_ms"] = loop_timeline(trace, min(sent, default=0.0), len(requests))
            # Every step of the server's life (the load is nearly all of it) by kind, with the device's
            # time per forward on a GPU: wall time over device time is the host's share; a forward's
            # device time also holds any wait for its own launches.
            summary["scheduler_steps"] = read_json(steps_path(trace))
        if args.workload == "serving-burst" and not args.no_peer and proc is not None:
            # After the server is gone (its GPU memory free, and the server met a Triton cache the
            # peer had not warmed); same model, options and requests.
            from plait.server.bench_peer import offline_burst

            peer = offline_burst(_served_model(model), engine_options, requests, args.peer_idle_s)
            ttfts = peer.pop("ttft_s")
            peer["ttft_p50_ms"], peer["ttft_p99_ms"] = (1000 * (percentile(ttfts, q) or 0.0) for q in (50, 99))
        path = write_result(args, info, summary, peer)
        shown = {k: summary[k] for k in ("completed", "errors", METRIC, "request_throughput", "ttft_p50_ms",
                                         "ttft_p99_ms", "itl_p50_ms", "itl_p99_ms", "e2e_p50_ms", "e2e_p99_ms",
                                         "kv_slots_in_use_after")}
        if peer is not None:
            shown |= {"peer_output_tok_s": peer["output_tok_s"], "peer_ttft_p50_ms": peer["ttft_p50_ms"],
                      "ratio_vs_peer": summary[METRIC] / peer["output_tok_s"]}
        print(json.dumps({"workload": args.workload, **shown}))
        print(f"wrote {path}", file=sys.stderr)
        ok = summary["errors"] == 0 and summary["kv_slots_in_use_after"] == 0
        return 0 if ok else 1
    finally:
        if proc is not None:
            stop_server(proc)
        shutil.rmtree(shape_root, ignore_errors=True)


def triton_cache_kernels() -> set[tuple[str, str]]:
    """(cache entry, kernel name) of every kernel variant in Triton's on-disk cache (TRITON_CACHE_DIR, else
    ~/.triton/cache). A server compiles into it, so the entries that appear while the load runs are the
    variants that compiled on the request path (what the start-up warm-up missed)."""
    root = pathlib.Path(os.environ.get("TRITON_CACHE_DIR") or pathlib.Path.home() / ".triton" / "cache")
    if not root.is_dir():
        return set()
    return {(path.parent.name, path.stem) for path in root.glob("*/*.json") if not path.name.startswith("__grp__")}


def stop_server(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def write_result(args: argparse.Namespace, info: dict[str, Any], summary: dict[str, Any],
                 peer: dict[str, Any] | None = None) -> pathlib.Path:
    """One JSON object with the keys every benchmark result has, plus the run's detail. ``peer``:
    serving-burst's offline Engine run on the same requests (``offline_burst``)."""
    date = datetime.date.today().isoformat()
    sched = info.get("scheduler") or {}
    device = sched.get("device_name") or (sched.get("runner_info") or {}).get("device") or "unknown"
    shape = args.shape or _shape_name(info)
    workload = args.workload
    if peer is not None:
        peer_fields: dict[str, Any] = {
            "peer_name": "plait-offline-engine", "peer": peer["output_tok_s"],
            "peer_note": "the offline Engine in one process on the same model, engine options and requests "
                         "(all added at once), after one untimed pass of the whole workload"
                         + (f" and {peer['idle_before_timed_s']:g} s idle" if peer.get("idle_before_timed_s") else ""),
            "ratio_vs_peer": summary[METRIC] / peer["output_tok_s"],
            "peer_ttft_p50_ms": peer["ttft_p50_ms"], "peer_ttft_p99_ms": peer["ttft_p99_ms"],
            "ttft_p50_ratio_vs_peer": (summary["ttft_p50_ms"] / peer["ttft_p50_ms"]
                                       if summary["ttft_p50_ms"] is not None and peer["ttft_p50_ms"] else None),
            "peer_detail": peer}
    else:
        note = ("no serving peer is run: vLLM and SGLang servers need a GPU, and no CPU serving peer is installed"
                if workload == "serving" else "the offline Engine peer runs only against a server this command "
                "starts (not with --base-url) and not with --no-peer")
        peer_fields = {"peer_name": None, "peer": None, "peer_note": note, "ratio_vs_peer": None}
    record = {
        "workload": workload,
        "shape": shape,
        "device": device,
        "commit": git_commit(),
        "date": date,
        "versions": info.get("versions"),
        "host": host_info(),  # the load generator's, which is the server's unless --base-url is remote
        "metric": METRIC,
        "plait": summary[METRIC],
        **peer_fields,
        "floor": None,
        "fraction_of_floor": None,
        "config": {
            "engine": info.get("config"),
            "server": info.get("server_args"),
            "bench": {"num_prompts": args.num_prompts,
                      "request_rate": args.request_rate if math.isfinite(args.request_rate) else "inf",
                      "max_concurrency": args.max_concurrency, "input_len": args.input_len,
                      "output_len": args.output_len, "range_ratio": args.range_ratio, "seed": args.seed,
                      "client_procs": args.client_procs,
                      "endpoint": "/v1/completions", "stream": not args.no_stream, "ignore_eos": True,
                      "temperature": 0.0},
        },
        "floor_note": "no physical floor is defined for serving latency; see decode-bs1 and offline-throughput",
        **summary,
    }
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    safe_device = re.sub(r"[^A-Za-z0-9_.-]+", "-", device)
    path = out / f"{date}-{workload}-{shape}-{safe_device}.json"
    path.write_text(json.dumps(record, indent=2, default=str) + "\n")
    return path
