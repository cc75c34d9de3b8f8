"""Where the HTTP process's time goes per streamed chunk (CPU; no GPU needed).

Runs a real ``plait serve`` (FastAPI + uvicorn + SchedulerClient + a real scheduler process) on a
tiny random checkpoint, drives it with ``plait bench serve``'s load generator (many concurrent
streams, all at once), and reports per output chunk:

* the HTTP process's CPU time (utime + stime from /proc, an unprofiled run), and the load
  generator's own CPU time (the client parses every event too);
* a cProfile run of the HTTP process whose self times are grouped into ZMQ recv + unpickle,
  per-request dispatch (queues, the generate loop), chunk building, JSON encoding, SSE write
  (starlette + uvicorn + the transport), the event loop, and the rest; the groups are also scaled to
  the unprofiled CPU time per chunk (cProfile inflates small calls, so read them as shares);
* scheduler-side costs per update, measured in this process on the same objects: building the
  update and detokenizing one token, and encoding / decoding the wire message.

    python benchmarks/profile_serving_http.py [--streams 64] [--output-len 96] [--stream-interval 1]
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import json
import os
import pathlib
import pstats
import resource
import signal
import subprocess
import sys
import tempfile
import time
from typing import Any

import httpx

from plait.server.bench import (
    _free_port,
    _wait_healthy,
    make_requests,
    percentile,
    run_load,
    run_load_procs,
    stop_server,
)

# File-path fragments (or function names) of each group, first match wins. Self times only, so the
# groups add up to the profile's total.
GROUPS: list[tuple[str, tuple[str, ...]]] = [
    # Waiting in epoll is idle time, not work: reported, left out of the per-chunk total.
    ("idle_poll", ("method 'poll' of 'select.epoll'",)),
    # Unpickling rebuilds the updates (dataclass __init__ is compiled from "<string>").
    ("zmq_recv_unpickle", ("/zmq/", "_pickle.loads", "_unpack_update_batch", "<string>:__init__")),
    ("dispatch", ("scheduler_client.py", "asyncio/queues.py", "plait/server/http.py", "coalesce_updates",
                  "merge_updates")),
    ("chunk_build", ("openai_serving.py",)),
    ("json_encode", ("json/", "_json", "orjson")),
    ("sse_write", ("starlette/", "uvicorn/", "h11/", "httptools", "selector_events.py", "transports.py",
                   "method 'send' of '_socket", "fastapi/")),
    ("event_loop", ("asyncio/",)),
]


def _group(key: tuple[str, int, str]) -> str:
    where = f"{key[0]}:{key[2]}"
    for name, pats in GROUPS:
        if any(p in where for p in pats):
            return name
    return "other"


SERVER_TREE: str | None = None
CLIENT_PROCS = 1


def _cpu_seconds(pid: int) -> float:
    fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# The HTTP process: `plait serve`, with a profiler that SIGUSR1 starts and SIGUSR2 stops and writes
# out when a path is given (its event loop runs on the main thread, where signal handlers run), and
# with --replay-step-ms its scheduler process replaced by REPLAY_SCHEDULER.
_SERVER_MAIN = '''
import cProfile, signal, subprocess, sys, types
prof, path, replay_ms = cProfile.Profile(), sys.argv.pop(1), sys.argv.pop(1)
if path:
    signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
    signal.signal(signal.SIGUSR2, lambda *_: (prof.disable(), prof.dump_stats(path)))
if replay_ms:
    import plait.server.scheduler_client as sc
    def popen(cmd, *args, **kwargs):
        cmd = [sys.executable, "-c", REPLAY, replay_ms, *cmd[cmd.index("scheduler-process") + 1:]]
        return subprocess.Popen(cmd, *args, **kwargs)
    sc.subprocess = types.SimpleNamespace(Popen=popen, TimeoutExpired=subprocess.TimeoutExpired)
from plait.cli import main
sys.exit(main(sys.argv[1:]))
'''

# A scheduler process that speaks the wire protocol and produces one token (" x") per running
# request every STEP_MS (or TOKENS of them per update, as a stream interval does), as fast a step rate
# as a GPU engine's; a request the HTTP process detokenizes (GenerateRequest.detokenize False) gets
# its token ids without text, as from the real scheduler. What the HTTP process then does is the
# serving path's own cost, at a token rate this CPU's model could not reach. Profiling only.
REPLAY_SCHEDULER = '''
import os, sys, time, zmq
from plait.engine.messages import (AbortRequest, GenerateRequest, Ready, RequestUpdate, SchedulerSnapshot,
                                   ShutdownRequest, UpdateBatch)
step_ms, _, per_update = sys.argv[1].partition("x")  # "STEP_MSxTOKENS": TOKENS per update every STEP_MS
step_s, per_update = float(step_ms) / 1000, int(per_update or 1)
argv = sys.argv[2:]
req_addr, out_addr = argv[argv.index("--requests-addr") + 1], argv[argv.index("--outputs-addr") + 1]
ctx = zmq.Context()
pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
pull.connect(req_addr)
push.connect(out_addr)
push.send_pyobj(Ready(pid=os.getpid(), vocab_size=512, max_context_len=8192, max_total_tokens=1 << 22,
                      max_running_requests=4096, eos_token_ids=(2,), runner_info={"device": "cpu"}, device_name="cpu"))
# Ids the tiny model's tokenizer decodes to whole text (as a real model's output mostly does): ids that
# decode to a partial UTF-8 sequence keep an incremental detokenizer's window open, a worst case.
from plait.models.loader import load_tokenizer
_tok = load_tokenizer(argv[argv.index("--config-json") + 1] and __import__("json").loads(
    argv[argv.index("--config-json") + 1])["model"])
WORDS = [i for i in range(3, 512) if (t := _tok.decode([i])) and "\ufffd" not in t]
live = {}  # rid -> [max_new_tokens, produced, prompt_len, text]
next_step = time.perf_counter()
while True:
    updates = []
    if pull.poll(0 if live else 100):
        while True:
            try:
                msg = pull.recv_pyobj(zmq.NOBLOCK)
            except zmq.Again:
                break
            if isinstance(msg, GenerateRequest):
                live[msg.rid] = [msg.sampling_params.max_new_tokens, 0, len(msg.input_ids),
                                 " x" if msg.detokenize else ""]
                updates.append(RequestUpdate(msg.rid, prompt_tokens=len(msg.input_ids)))
            elif isinstance(msg, AbortRequest):
                for rid in msg.rids:
                    if live.pop(rid, None) is not None:
                        updates.append(RequestUpdate(rid, finish_reason="abort"))
            elif isinstance(msg, ShutdownRequest):
                sys.exit(0)
    for rid, st in list(live.items()):
        k = min(per_update, st[0] - st[1])
        ids = [WORDS[(st[1] + j + 1) % len(WORDS)] for j in range(k)]
        st[1] += k
        upd = RequestUpdate(rid, ids, st[3] and " x" * k, prompt_tokens=st[2], completion_tokens=st[1])
        if st[1] >= st[0]:
            upd.finish_reason = "length"
            del live[rid]
        updates.append(upd)
    if updates:
        push.send_pyobj(UpdateBatch(updates, SchedulerSnapshot(num_running=len(live))))
    next_step += step_s
    time.sleep(max(0.0, next_step - time.perf_counter()))
    next_step = max(next_step, time.perf_counter() - step_s)
'''


def _serve(model: str, port: int, log: Any, profile_to: str | None, extra: list[str],
           replay_step_ms: str | None) -> subprocess.Popen[bytes]:
    # --server-tree: the HTTP and scheduler processes import that source tree (a before/after pair).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    if SERVER_TREE:
        env["PYTHONPATH"] = SERVER_TREE
    main_src = f"REPLAY = {REPLAY_SCHEDULER!r}\n" + _SERVER_MAIN
    cmd = [sys.executable, "-c", main_src, profile_to or "", "" if replay_step_ms is None else replay_step_ms,
           "serve", "--model", model, "--port", str(port), "--device", "cpu",
           "--max-running-requests", "256", "--max-total-tokens", "65536", *extra]
    # Run from that tree too: ``python -c`` puts the working directory first on sys.path.
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=SERVER_TREE or None)


def run_server_load(model: str, requests: list[tuple[list[int], int]], log_dir: str, profile_to: str | None,
                    extra: list[str], replay_step_ms: str | None = None) -> dict[str, Any]:
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(pathlib.Path(log_dir) / f"serve-{'prof' if profile_to else 'plain'}.log", "w") as log:
        proc = _serve(model, port, log, profile_to, extra, replay_step_ms)
        try:
            _wait_healthy(base, proc, timeout=180)
            # The served model's id, then a short warm-up (first-request imports, tokenizer paths).
            name = httpx.get(base + "/v1/models", timeout=30).json()["data"][0]["id"]
            asyncio.run(run_load(base, name, requests[:4], float("inf"), None, 0, 600.0))
            if profile_to:
                proc.send_signal(signal.SIGUSR1)  # profile the load only, not startup and warm-up
            client_prof = cProfile.Profile() if profile_to else None
            if client_prof is not None:
                client_prof.enable()
            out = _load_named(base, name, requests, proc.pid)
            if client_prof is not None:
                client_prof.disable()
                out["client_profile"] = profile_to + ".client"
                client_prof.dump_stats(out["client_profile"])
            if profile_to:
                proc.send_signal(signal.SIGUSR2)
                deadline = time.monotonic() + 60
                while not pathlib.Path(profile_to).exists() and time.monotonic() < deadline:
                    time.sleep(0.1)
        finally:
            stop_server(proc)
    return out


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def _load_named(base: str, name: str, requests: list[tuple[list[int], int]], pid: int) -> dict[str, Any]:
    cpu0, client0, kids0 = _cpu_seconds(pid), time.process_time(), _children_cpu()
    results, duration = run_load_procs(base, name, requests, float("inf"), None, 0, 600.0, CLIENT_PROCS)
    http_cpu = _cpu_seconds(pid) - cpu0
    client_cpu = time.process_time() - client0 + _children_cpu() - kids0
    chunks = sum(r.chunks for r in results)
    tokens = sum(r.tokens for r in results)
    return {"chunks": chunks, "tokens": tokens, "errors": sum(not r.ok for r in results), "duration_s": duration,
            "output_tok_s": tokens / duration, "tokens_per_chunk": tokens / max(chunks, 1),
            "ttft_p50_ms": 1000 * (percentile([r.ttft for r in results if r.ttft is not None], 50) or 0.0),
            "http_cpu_s": http_cpu, "client_cpu_s": client_cpu,
            "http_cpu_us_per_chunk": 1e6 * http_cpu / max(chunks, 1),
            "http_cpu_us_per_token": 1e6 * http_cpu / max(tokens, 1),
            "client_cpu_us_per_chunk": 1e6 * client_cpu / max(chunks, 1)}


def profile_groups(stats: pstats.Stats, chunks: int, cpu_us_per_chunk: float) -> dict[str, dict[str, float]]:
    """Self time per group and chunk; ``scaled``: the busy groups scaled so they add up to the
    unprofiled run's CPU per chunk (cProfile inflates every call)."""
    total: dict[str, float] = {}
    for key, (_cc, _nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        g = _group(key)
        total[g] = total.get(g, 0.0) + tt
    busy = sum(v for g, v in total.items() if g != "idle_poll")
    scale = cpu_us_per_chunk * chunks / (1e6 * busy) if busy else 0.0
    out = {}
    for g, seconds in sorted(total.items(), key=lambda kv: -kv[1]):
        out[g] = {"profiled_us_per_chunk": 1e6 * seconds / chunks,
                  "scaled_us_per_chunk": None if g == "idle_poll" else 1e6 * seconds * scale / chunks}
    return out


def print_profile(title: str, groups: dict[str, dict[str, Any]], stats: pstats.Stats, chunks: int) -> list[Any]:
    print(f"--- {title}: self time per chunk by group (profiled; scaled to the unprofiled CPU)")
    for g, v in groups.items():
        scaled = "" if v["scaled_us_per_chunk"] is None else f"{v['scaled_us_per_chunk']:8.1f} scaled"
        print(f"{g:20s} {v['profiled_us_per_chunk']:8.1f} profiled {scaled}")
    top = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])[:20]  # type: ignore[attr-defined]
    rows = [{"fn": f"{k[0]}:{k[1]}:{k[2]}", "calls": v[1], "self_us_per_chunk": 1e6 * v[2] / chunks}
            for k, v in top]
    for row in rows:
        print(f"  {row['self_us_per_chunk']:7.2f} us  {row['calls']:8d}  {row['fn'][-90:]}")
    return rows


def scheduler_side(model: str, batch: int) -> dict[str, float]:
    """Per update, on the scheduler's side of the hop: one token's detokenization (the streamed text
    delta), the wire message's encoding, and its decoding in the HTTP process."""
    import pickle

    from plait.engine.messages import RequestUpdate, SchedulerSnapshot, UpdateBatch
    from plait.models.loader import load_tokenizer
    from plait.scheduler.detokenizer import IncrementalDetokenizer

    tok = load_tokenizer(model)
    detoks = [IncrementalDetokenizer(tok, [5, 6, 7], ()) for _ in range(batch)]
    steps = 40
    t0 = time.perf_counter()
    for s in range(steps):
        for i, d in enumerate(detoks):
            d.add_token(20 + (s * 7 + i) % 400)
            d.take_delta(False)
    detok_us = 1e6 * (time.perf_counter() - t0) / (steps * batch)
    updates = [RequestUpdate(f"{i:032x}-0", [123], " tok", prompt_tokens=512, completion_tokens=7)
               for i in range(batch)]
    out: dict[str, float] = {"detokenize_us_per_update": detok_us}
    reps = 50
    # "objects": every update pickled as a dataclass (the wire format before UpdateBatch's compact
    # __reduce__); "wire": the UpdateBatch as it is sent.
    for name, msg in (("objects", updates), ("wire", UpdateBatch(updates, SchedulerSnapshot()))):
        t0 = time.perf_counter()
        for _ in range(reps):
            raw = pickle.dumps(msg, pickle.DEFAULT_PROTOCOL)
        out[f"{name}_dumps_us_per_update"] = 1e6 * (time.perf_counter() - t0) / (reps * batch)
        t0 = time.perf_counter()
        for _ in range(reps):
            pickle.loads(raw)
        out[f"{name}_loads_us_per_update"] = 1e6 * (time.perf_counter() - t0) / (reps * batch)
        out[f"{name}_bytes_per_update"] = len(raw) / batch
    return out


def _collect_takes_rows(proc: Any) -> bool:
    """Whether the tree's ``_collect`` appends plain updates to a rows list (--server-tree may name
    a tree from before it did)."""
    import inspect

    return "rows" in inspect.signature(proc._collect).parameters


def collect_step(model: str, batch: int, steps: int = 40) -> dict[str, float]:
    """One scheduler-loop iteration's output work at ``batch`` live streaming requests that each got
    one token: ``_collect`` (take_update: detokenization and the update), ``_snapshot``, and pickling
    + sending the UpdateBatch over ZMQ, on a real SchedulerProcess (its engine core built on the tiny
    model, the requests not scheduled: their tokens are appended as a step would)."""
    import zmq

    from plait.config import EngineConfig
    from plait.engine.core import LiveRequest
    from plait.engine.messages import UpdateBatch
    from plait.engine.scheduler_process import SchedulerProcess
    from plait.sampling.params import SamplingParams

    addr = f"ipc://{tempfile.mkdtemp(prefix='plait-collect-')}/out"
    sink = zmq.Context.instance().socket(zmq.PULL)
    sink.bind(addr)
    proc = SchedulerProcess(EngineConfig(model=model, device="cpu", stream_interval=1), [addr + "-unused"], [addr],
                            None)
    proc.load()
    sink.recv()  # Ready
    reqs = []
    for i in range(batch):
        req = proc.core.new_request(f"{i:032x}-0", [5, 6, 7, 8], SamplingParams(max_new_tokens=1 << 20), 0)
        proc.live[req.rid] = LiveRequest(req, True, 1)
        reqs.append(req)
    collect = (lambda rows: proc._collect(rows)) if _collect_takes_rows(proc) else (lambda rows: proc._collect())
    collect([])
    times: dict[str, float] = {"collect": 0.0, "snapshot": 0.0, "send": 0.0}
    for s in range(steps):
        for i, req in enumerate(reqs):
            token = 20 + (s * 7 + i) % 400
            req.output_ids.append(token)  # what the scheduler's step does with a sampled token
            req.detokenizer.add_token(token)
        t0 = time.perf_counter()
        rows: list[Any] = []
        updates = collect(rows)
        t1 = time.perf_counter()
        stats = proc._snapshot()
        t2 = time.perf_counter()
        proc.push.send_pyobj(UpdateBatch(updates, stats, rows) if rows else UpdateBatch(updates, stats))
        t3 = time.perf_counter()
        times["collect"] += t1 - t0
        times["snapshot"] += t2 - t1
        times["send"] += t3 - t2
        assert len(updates) + len(rows) == batch
        sink.recv()
    proc.core.close()
    proc.close()
    sink.close(0)
    out = {f"{k}_us_per_step": 1e6 * v / steps for k, v in times.items()}
    out["step_us"] = sum(out.values())
    out["step_us_per_update"] = out["step_us"] / batch
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=96)
    ap.add_argument("--serve-flag", action="append", default=[],
                    help="extra `plait serve` flag (repeat; e.g. --serve-flag=--stream-interval --serve-flag=4)")
    ap.add_argument("--server-tree", default=None, help="source tree the server imports (default: this one)")
    ap.add_argument("--client-procs", type=int, default=1, help="load-generator processes")
    ap.add_argument("--replay-tokens", type=int, default=1,
                    help="with --replay-step-ms: tokens per update (a stream interval), one update per step")
    ap.add_argument("--replay-step-ms", type=float, default=None,
                    help="replace the scheduler process by one that gives every running request a token each "
                    "this many ms (the HTTP side at a GPU's token rate; 8.6 ~ 256 streams at 30k tok/s)")
    ap.add_argument("--no-profile", action="store_true", help="only the unprofiled run")
    ap.add_argument("--scheduler-only", action="store_true",
                    help="only the scheduler-side measurements (no server run)")
    ap.add_argument("--out", default=None, help="write the result JSON here")
    args = ap.parse_args()
    global SERVER_TREE, CLIENT_PROCS
    SERVER_TREE, CLIENT_PROCS = args.server_tree, args.client_procs

    from plait.testing import make_tiny_model

    tmp = tempfile.mkdtemp(prefix="plait-prof-serve-")
    model = str(make_tiny_model(pathlib.Path(tmp) / "m", "llama", seed=0))
    requests = make_requests(args.streams, args.input_len, args.output_len, 1.0, 500, 0)
    result: dict[str, Any] = {"streams": args.streams, "input_len": args.input_len, "output_len": args.output_len,
                              "serve_flags": args.serve_flag, "server_tree": args.server_tree,
                              "client_procs": args.client_procs, "replay_step_ms": args.replay_step_ms}
    result["scheduler_side"] = scheduler_side(model, 256)
    print(json.dumps(result["scheduler_side"]), flush=True)
    if args.scheduler_only:
        result["collect_step"] = collect_step(model, 256)
        print(json.dumps({"collect_step_256": result["collect_step"]}), flush=True)
        return 0
    replay = None if args.replay_step_ms is None else f"{args.replay_step_ms}x{args.replay_tokens}"
    plain = run_server_load(model, requests, tmp, None, args.serve_flag, replay)
    result["plain"] = plain
    print(json.dumps(plain), flush=True)
    if not args.no_profile:
        prof_path = str(pathlib.Path(tmp) / "http.prof")
        prof = run_server_load(model, requests, tmp, prof_path, args.serve_flag, replay)
        result["profiled"] = prof
        stats = pstats.Stats(prof_path)
        result["groups"] = profile_groups(stats, prof["chunks"], plain["http_cpu_us_per_chunk"])
        result["top_self"] = print_profile("HTTP process", result["groups"], stats, prof["chunks"])
        cstats = pstats.Stats(prof["client_profile"])
        result["client_groups"] = profile_groups(cstats, prof["chunks"], plain["client_cpu_us_per_chunk"])
        result["client_top_self"] = print_profile("load generator", result["client_groups"], cstats, prof["chunks"])
    # Last: building an engine core here (and its gc.freeze) makes the load generator forked from
    # this process afterwards measurably cheaper, which would skew the runs above against older trees.
    result["collect_step"] = collect_step(model, 256)
    print(json.dumps({"collect_step_256": result["collect_step"]}), flush=True)
    if args.out:
        pathlib.Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
