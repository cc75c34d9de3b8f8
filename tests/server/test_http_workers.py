"""`plait serve --tokenizer-worker-num N`: N HTTP processes on one port and one scheduler process, each
request's updates routed back to the process that sent it."""

from __future__ import annotations

import asyncio
import os
import socket
import time

import httpx
import pytest
import zmq

from plait.cli import build_parser
from plait.config import EngineConfig
from plait.engine.messages import RequestUpdate, UpdateBatch
from plait.engine.scheduler_process import SchedulerProcess
from plait.server.app import ServerArgs, default_http_processes
from plait.server.launch import server_args_from
from tests.helpers import pid_alive
from tests.server.conftest import HTTP_TIMEOUT, MAIN_ENGINE_FLAGS, child_pids


@pytest.fixture(scope="module")
def two_workers(start_server):
    return start_server("http-workers", tokenizer_worker_num=2, **MAIN_ENGINE_FLAGS)


async def _completions(url: str, model: str, prompts: list[list[int]]) -> list[list[int]]:
    async def one(client: httpx.AsyncClient, prompt: list[int]) -> list[int]:
        body = {"model": model, "prompt": prompt, "max_tokens": 6, "temperature": 0.0, "ignore_eos": True,
                "return_token_ids": True}
        r = await client.post(url + "/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    # One connection per request, so the kernel spreads them over both processes' accept queues.
    limits = httpx.Limits(max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT, limits=limits) as client:
        return list(await asyncio.gather(*(one(client, p) for p in prompts)))


def test_two_http_processes_answer_concurrent_requests_as_the_offline_engine(two_workers, offline_engine):
    prompts = [[5 + i, 17, 29, 41 + i] for i in range(24)]
    got = asyncio.run(_completions(two_workers.url, two_workers.model, prompts))
    want = [o.token_ids for o in offline_engine.generate(prompts, {"max_new_tokens": 6, "temperature": 0.0,
                                                                   "ignore_eos": True})]
    assert got == want
    assert two_workers.wait_idle()["plait:kv_slots_in_use"] == 0


def test_the_server_runs_one_more_http_process_and_one_scheduler(two_workers):
    cmdlines = [open(f"/proc/{pid}/cmdline", "rb").read() for pid in child_pids(two_workers.proc.pid)]
    assert sum(b"scheduler-process" in c for c in cmdlines) == 1
    assert sum(b"spawn_main" in c for c in cmdlines) == 1  # the second HTTP process


def _socket_fds(pid: int) -> int:
    """Open sockets of process ``pid`` (an fd closed while listed is skipped)."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.readlink(f"/proc/{pid}/fd/{fd}").startswith("socket:")
        except FileNotFoundError:
            pass
    return n


def _settled_socket_fds(pid: int, timeout: float = 10.0) -> int:
    """``_socket_fds`` once two reads 0.1 s apart agree: connections of earlier tests may still be
    closing on the server's side."""
    deadline = time.monotonic() + timeout
    n = _socket_fds(pid)
    while time.monotonic() < deadline:
        time.sleep(0.1)
        m = _socket_fds(pid)
        if m == n:
            return n
        n = m
    return n


def test_connections_opened_at_once_spread_over_the_http_processes(two_workers):
    """Each process listens on its own socket (SO_REUSEPORT), so a burst of connections is not all
    accepted by whichever process wakes first."""
    children = child_pids(two_workers.proc.pid)
    [second] = [pid for pid in children if b"spawn_main" in open(f"/proc/{pid}/cmdline", "rb").read()]
    http = [two_workers.proc.pid, second]
    before = {pid: _settled_socket_fds(pid) for pid in http}
    url = httpx.URL(two_workers.url)
    conns = [socket.create_connection((url.host, url.port), timeout=HTTP_TIMEOUT) for _ in range(32)]
    try:
        for c in conns:
            c.sendall(b"GET /health HTTP/1.1\r\nHost: plait\r\n\r\n")
        for c in conns:
            assert c.recv(64).startswith(b"HTTP/1.1 200")  # answered, so accepted, and kept alive
        gained = [_socket_fds(pid) - before[pid] for pid in http]
    finally:
        for c in conns:
            c.close()
    assert sum(gained) == 32
    assert min(gained) > 0  # all 32 in one process: 2 chances in 2**32 with the kernel's hash


def test_sigterm_stops_every_http_process_and_the_scheduler(start_server):
    srv = start_server("http-workers-stop", tokenizer_worker_num=3, max_total_tokens=4096)
    children = child_pids(srv.proc.pid)
    assert len(children) >= 3
    srv.stop()
    assert srv.proc.returncode == 0
    assert _all_gone(children)


def _all_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Whether every process of ``pids`` is gone within ``timeout``: multiprocessing's resource tracker
    (started with the spawned HTTP processes) leaves once it sees its parent's end of the pipe close, a
    moment after the server exits."""
    deadline = time.monotonic() + timeout
    while any(pid_alive(pid) for pid in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(pid_alive(pid) for pid in pids)


def test_tokenizer_worker_num_under_one_is_refused_with_the_flag_named():
    with pytest.raises(ValueError, match="--tokenizer-worker-num must be >= 1"):
        ServerArgs(tokenizer_worker_num=0)


@pytest.mark.parametrize(("cpus", "processes"), [(1, 1), (2, 1), (7, 1), (8, 2), (16, 4), (128, 4)])
def test_default_http_processes_is_one_per_four_cpus_between_one_and_four(cpus, processes):
    assert default_http_processes(cpus) == processes


def test_serve_without_the_flag_starts_the_default_http_processes_and_with_it_the_count_given():
    assert server_args_from(build_parser().parse_args(["serve"])).tokenizer_worker_num == default_http_processes()
    for flag in ("--tokenizer-worker-num", "--api-server-count"):
        assert server_args_from(build_parser().parse_args(["serve", flag, "3"])).tokenizer_worker_num == 3


def test_the_scheduler_process_sends_each_request_update_to_the_process_that_sent_it(server_model, tmp_path):
    ctx = zmq.Context()
    outputs = []
    for w in range(2):
        sock = ctx.socket(zmq.PULL)
        sock.bind(f"ipc://{tmp_path}/outputs-{w}")
        outputs.append(sock)
    proc = SchedulerProcess(EngineConfig(model=str(server_model), device="cpu"),
                            [f"ipc://{tmp_path}/requests-{w}" for w in range(2)],
                            [f"ipc://{tmp_path}/outputs-{w}" for w in range(2)], None)
    try:
        proc.owner.update({"a": 0, "b": 1, "c": 1})
        stats = object()
        proc._send_updates([RequestUpdate("a", [1]), RequestUpdate("b", [2], finish_reason="stop")], stats,
                           [("c", [3], "", 4, 1, 0)])
        got = [sock.recv_pyobj() for sock in outputs]
    finally:
        proc.close()
        for sock in outputs:
            sock.close(0)
        ctx.term()
    assert all(isinstance(b, UpdateBatch) for b in got)
    assert [u.rid for u in got[0].updates] == ["a"]
    assert [u.rid for u in got[1].updates] == ["b", "c"]
    assert proc.owner == {"a": 0, "c": 1}  # a finished request's owner is forgotten


def test_bench_serve_starts_its_server_with_the_http_processes_asked_for(server_model, tmp_path):
    import json

    from plait.cli import main

    code = main(["bench", "serve", "--workload", "serving-burst", "--model", str(server_model), "--device", "cpu",
                 "--max-total-tokens", "4096", "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                 "--no-peer", "--tokenizer-worker-num", "2", "--out", str(tmp_path)])
    assert code == 0
    [path] = tmp_path.glob("*-serving-burst-*-cpu.json")
    r = json.loads(path.read_text())
    assert r["completed"] == 6 and r["errors"] == 0 and r["kv_slots_in_use_after"] == 0
    assert r["config"]["server"]["tokenizer_worker_num"] == 2


def test_with_several_http_processes_a_server_that_cannot_load_its_model_exits_with_the_reason(tmp_path):
    import subprocess
    import sys

    cmd = [sys.executable, "-m", "plait", "serve", "--model", str(tmp_path / "missing"), "--port", "0",
           "--device", "cpu", "--tokenizer-worker-num", "2"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "the server failed to start" in proc.stderr


def test_with_several_http_processes_a_port_in_use_exits_with_the_address(server_model):
    import subprocess
    import sys

    with socket.create_server(("127.0.0.1", 0)) as taken:  # no SO_REUSEPORT: nobody may share it
        port = taken.getsockname()[1]
        cmd = [sys.executable, "-m", "plait", "serve", "--model", str(server_model), "--host", "127.0.0.1",
               "--port", str(port), "--device", "cpu", "--tokenizer-worker-num", "2"]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert f"could not bind 127.0.0.1:{port}" in proc.stderr


def test_a_killed_scheduler_ends_every_http_process_non_zero(start_server):
    import os
    import signal

    srv = start_server("http-workers-killed", tokenizer_worker_num=2, max_total_tokens=4096)
    children = child_pids(srv.proc.pid)
    [scheduler] = [pid for pid in children if b"scheduler-process" in open(f"/proc/{pid}/cmdline", "rb").read()]
    os.kill(scheduler, signal.SIGKILL)
    assert srv.proc.wait(30) == 1
    assert _all_gone(children)
    srv.stop()


def test_abort_request_reaches_a_request_held_by_either_http_process(two_workers):
    """SGLang's /abort_request by rid ends the request whichever process answers the abort: the scheduler
    process finds it by the client's id."""
    import threading

    result = {}

    def long_request() -> None:
        body = {"text": "Go", "rid": "workers-abort-1", "sampling_params": {"max_new_tokens": 1500, "ignore_eos": True}}
        result["out"] = httpx.post(two_workers.url + "/generate", json=body, timeout=HTTP_TIMEOUT).json()

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    while worker.is_alive() and time.monotonic() < deadline:  # fresh connections: either process answers
        r = httpx.post(two_workers.url + "/abort_request", json={"rid": "workers-abort-1"}, timeout=HTTP_TIMEOUT)
        assert r.status_code == 200
        worker.join(0.1)
    worker.join(HTTP_TIMEOUT)
    meta = result["out"]["meta_info"]
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500
    assert two_workers.wait_idle()["plait:kv_slots_in_use"] == 0


def test_the_scheduler_process_aborts_by_client_id_and_everything(server_model, tmp_path):
    from plait.engine.messages import AbortRequest, GenerateRequest
    from plait.sampling.params import SamplingParams

    ctx = zmq.Context()
    sink = ctx.socket(zmq.PULL)
    sink.bind(f"ipc://{tmp_path}/outputs-0")
    proc = SchedulerProcess(EngineConfig(model=str(server_model), device="cpu", max_total_tokens=4096),
                            [f"ipc://{tmp_path}/requests-0"], [f"ipc://{tmp_path}/outputs-0"], None)
    try:
        proc.load()
        params = SamplingParams(max_new_tokens=100, ignore_eos=True)
        updates: list[RequestUpdate] = []
        for rid, group in (("g-0", "g"), ("g-1", "g"), ("h", "h"), ("other", "")):
            proc._handle(GenerateRequest(rid, [5, 6, 7], params, 0, group=group), updates)
        proc._handle(AbortRequest([], groups=["g"]), updates)
        proc.scheduler.step()
        finished = {u.rid: u.finish_reason for u in proc._collect([]) if u.finished}
        assert finished == {"g-0": "abort", "g-1": "abort"}
        proc._handle(AbortRequest([], everything=True), updates)
        proc.scheduler.step()
        finished = {u.rid: u.finish_reason for u in proc._collect([]) if u.finished}
        assert finished == {"h": "abort", "other": "abort"} and proc.group == {}
    finally:
        proc.close()
        sink.close(0)
        ctx.term()


def test_metrics_latency_histograms_cover_every_http_process(two_workers):
    """Whichever process answers /metrics, its time-to-first-token histogram counts the requests both
    processes served (each shares its own series every SHARE_INTERVAL_S)."""
    from plait.server.metrics import SHARE_INTERVAL_S

    time.sleep(3 * SHARE_INTERVAL_S)  # the requests of tests before this one shared by now
    before = [_ttft_count(two_workers) for _ in range(6)]
    assert len(set(before)) == 1  # every answer already the same total
    prompts = [[7 + i, 19, 23] for i in range(16)]
    asyncio.run(_completions(two_workers.url, two_workers.model, prompts))
    time.sleep(3 * SHARE_INTERVAL_S)
    after = [_ttft_count(two_workers) for _ in range(6)]  # fresh connections: either process answers
    assert after == [before[0] + len(prompts)] * len(after)


def _ttft_count(server) -> float:
    limits = httpx.Limits(max_keepalive_connections=0)
    with httpx.Client(timeout=HTTP_TIMEOUT, limits=limits) as client:
        text = client.get(server.url + "/metrics").text
    [line] = [ln for ln in text.splitlines() if ln.startswith("plait:time_to_first_token_seconds_count")]
    return float(line.rsplit(" ", 1)[1])
