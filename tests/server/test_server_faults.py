"""Load and faults: disconnecting clients, queue overflow, SIGTERM with requests in flight, a killed
scheduler process. Each against a real `plait serve` subprocess."""

from __future__ import annotations

import asyncio
import datetime
import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.helpers import pid_alive
from tests.server.conftest import HTTP_TIMEOUT

LONG = 2000  # tokens: several seconds of decoding on the CPU, so the request is surely in flight


def stream_events(url: str, body: dict, on_first=None) -> tuple[int, list]:
    """POST a streaming request; return (status, parsed data events, with "[DONE]" kept as a str)."""
    events: list = []
    with httpx.stream("POST", url, json={**body, "stream": True}, timeout=HTTP_TIMEOUT) as r:
        if r.status_code != 200:
            r.read()
            return r.status_code, [r.json()]
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            events.append(data if data == "[DONE]" else json.loads(data))
            if on_first is not None and len(events) == 1:
                on_first()
    return 200, events


def finish_reasons(events: list) -> list:
    return [e["choices"][0]["finish_reason"] for e in events
            if isinstance(e, dict) and e.get("choices") and e["choices"][0]["finish_reason"]]


# --- disconnects (shared server) -----------------------------------------------------------------
def test_64_streaming_clients_with_a_quarter_disconnecting_leave_nothing_running(server, model_name):
    before = server.wait_idle()
    client = server.async_openai()

    async def one(i: int) -> tuple[str, int, str | None]:
        leaves = i % 4 == 0
        stream = await client.completions.create(
            model=model_name, prompt=f"Request number {i} says", max_tokens=LONG if leaves else 24, temperature=0,
            stream=True, extra_body={"ignore_eos": True, "return_token_ids": True})
        tokens, finish = 0, None
        async for chunk in stream:
            if chunk.choices:
                tokens += len(chunk.choices[0].model_extra["token_ids"])
                finish = chunk.choices[0].finish_reason or finish
            if leaves and tokens >= 3:
                await stream.close()  # drop the connection mid-stream
                return "left", tokens, None
        return "done", tokens, finish

    async def run():
        try:
            return await asyncio.gather(*(one(i) for i in range(64)))
        finally:
            await client.close()

    results = asyncio.run(run())
    done = [r for r in results if r[0] == "done"]
    assert len(done) == 48
    assert all(tokens == 24 and finish == "length" for _, tokens, finish in done)
    after = server.wait_idle()
    assert after["plait:num_requests_running"] == 0
    assert after["plait:num_requests_waiting"] == 0
    assert after["plait:kv_slots_in_use"] == 0
    assert after["plait:num_aborted_requests_total"] - before["plait:num_aborted_requests_total"] == 16
    # The 16 that left were stopped, not run to LONG tokens.
    generated = after["plait:generation_tokens_total"] - before["plait:generation_tokens_total"]
    assert generated < 48 * 24 + 16 * 200


def test_non_streaming_client_disconnect_aborts_its_request_at_once(server, model_name):
    before = server.wait_idle()
    body = {"model": model_name, "prompt": "Hello", "max_tokens": LONG, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json=body, timeout=httpx.Timeout(HTTP_TIMEOUT, read=0.5))
    left = time.monotonic()
    after = server.wait_idle(timeout=1.0)
    assert time.monotonic() - left < 1.0
    assert after["plait:num_requests_running"] == 0 and after["plait:kv_slots_in_use"] == 0
    assert after["plait:num_aborted_requests_total"] == before["plait:num_aborted_requests_total"] + 1
    assert after["plait:generation_tokens_total"] - before["plait:generation_tokens_total"] < LONG


# --- queue overflow -------------------------------------------------------------------------------
def test_queue_overflow_gives_503s_and_loses_no_accepted_request(start_server):
    srv = start_server("queue", max_running_requests=2, max_queued_requests=2)
    model = srv.model
    body = {"model": model, "prompt": "Hello there", "max_tokens": 64, "ignore_eos": True}

    def plain(_: int) -> tuple[int, dict]:
        r = srv.post("/v1/completions", json=body)
        return r.status_code, r.json()

    def streamed(_: int) -> tuple[int, list]:
        return stream_events(srv.url + "/v1/completions", body)

    with ThreadPoolExecutor(20) as pool:  # 20 at once against 2 running + 2 waiting
        futures = [pool.submit(plain, i) for i in range(14)] + [pool.submit(streamed, i) for i in range(6)]
        results = [f.result() for f in futures]
    statuses = [s for s, _ in results]
    assert set(statuses) <= {200, 503}
    assert statuses.count(503) >= 1 and statuses.count(200) >= 4
    for status, payload in results:
        if status == 503:
            err = payload["error"] if isinstance(payload, dict) else payload[0]["error"]
            assert err["code"] == "queue_full" and "queue is full" in err["message"]
        elif isinstance(payload, dict):
            assert payload["usage"]["completion_tokens"] == 64
            assert payload["choices"][0]["finish_reason"] == "length"
        else:
            assert payload[-1] == "[DONE]" and finish_reasons(payload) == ["length"]
    m = srv.wait_idle()
    assert m["plait:num_rejected_requests_total"] == statuses.count(503)
    assert m["plait:kv_slots_in_use"] == 0 and m["plait:num_requests_running"] == 0


# --- SIGTERM --------------------------------------------------------------------------------------
def test_sigterm_finishes_in_flight_requests_aborts_the_rest_and_exits_cleanly(start_server):
    srv = start_server("sigterm", shutdown_timeout=2.0)
    model = srv.model
    scheduler = srv.scheduler_pid()
    url = srv.url + "/v1/completions"
    started = [threading.Event() for _ in range(3)]
    long_body = {"model": model, "prompt": "A long story", "max_tokens": LONG, "ignore_eos": True}
    short_body = {"model": model, "prompt": "Short", "max_tokens": 50, "ignore_eos": True}
    with ThreadPoolExecutor(4) as pool:
        longs = [pool.submit(stream_events, url, long_body, started[i].set) for i in range(2)]
        short = pool.submit(stream_events, url, short_body, started[2].set)
        assert all(e.wait(HTTP_TIMEOUT) for e in started)  # all three are generating
        sigterm_at = time.monotonic()
        srv.proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        # No new work is accepted: the port is closed (or, in the instant before, a 503).
        try:
            late = httpx.post(url, json={"model": model, "prompt": "Late", "max_tokens": 2}, timeout=5)
            assert late.status_code == 503
        except httpx.ConnectError:
            pass
        short_status, short_events = short.result()
        long_results = [f.result() for f in longs]
        streams_ended = time.monotonic() - sigterm_at
    assert short_status == 200 and finish_reasons(short_events) == ["length"]  # finished within the timeout
    for status, events in long_results:
        assert status == 200
        assert finish_reasons(events) == ["abort"]  # cut at the timeout
        assert events[-1] == "[DONE]"
    assert 1.8 < streams_ended < 10.0
    assert srv.proc.wait(15) == 0
    assert not pid_alive(scheduler)


# --- a dead scheduler -----------------------------------------------------------------------------
def test_killed_scheduler_fails_open_requests_at_once_turns_health_503_and_exits_non_zero(start_server):
    srv = start_server("killed")
    model = srv.model
    url = srv.url + "/v1/completions"
    long_body = {"model": model, "prompt": "A long story", "max_tokens": LONG, "ignore_eos": True}
    started = threading.Event()
    with ThreadPoolExecutor(2) as pool:
        streamed = pool.submit(stream_events, url, long_body, started.set)
        assert started.wait(HTTP_TIMEOUT)
        plain = pool.submit(srv.post, "/v1/completions", json=long_body)
        time.sleep(0.1)
        scheduler = srv.scheduler_pid()
        ended: list[float] = []  # when each in-flight request came back
        for future in (plain, streamed):
            future.add_done_callback(lambda _: ended.append(time.monotonic()))
        os.kill(scheduler, signal.SIGKILL)
        killed_at = time.monotonic()
        while httpx.get(srv.url + "/health").status_code == 200:
            assert time.monotonic() - killed_at < 1.0, "/health still 200 a second after the scheduler died"
            time.sleep(0.01)
        health = httpx.get(srv.url + "/health")
        assert health.status_code == 503 and "scheduler process died" in health.json()["reason"]
        # New requests fail at once instead of hanging.
        late = srv.post("/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 2})
        assert late.status_code == 500 and late.json()["error"]["code"] == "scheduler_dead"
        # In-flight requests end with an error: the plain one with a 500, the stream in-band.
        plain_r = plain.result(timeout=10)
        status, events = streamed.result(timeout=10)
    assert len(ended) == 2 and max(ended) - killed_at < 2.0  # at once (a loaded CPU adds its lag)
    assert plain_r.status_code == 500
    assert "scheduler process died" in plain_r.json()["error"]["message"]
    assert status == 200 and events[-1] == "[DONE]"
    assert "scheduler process died" in events[-2]["error"]["message"]
    # The server exits non-zero (a supervisor restarts it), leaving no child: it stops serving a second
    # after the death (DEAD_EXIT_DELAY_S); the interpreter's teardown of torch takes seconds more on a
    # loaded CPU.
    assert srv.proc.wait(20) == 1
    assert time.monotonic() - killed_at < 20.0
    assert not pid_alive(scheduler)
    stamps = {}
    for line in srv.log().splitlines():
        for event in ("the scheduler process died", "server stopped"):
            if event in line and event not in stamps:
                stamps[event] = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f")
    served_after_death = (stamps["server stopped"] - stamps["the scheduler process died"]).total_seconds()
    assert 0.9 < served_after_death < 3.0
    srv.stop()


# --- startup --------------------------------------------------------------------------------------
def test_health_is_503_and_requests_are_refused_while_the_model_loads(start_server):
    srv = start_server("startup", wait=False)
    deadline = time.monotonic() + 60
    while True:  # the first answer comes while the scheduler process is still loading
        assert time.monotonic() < deadline
        try:
            first = httpx.get(srv.url + "/health", timeout=1)
            break
        except httpx.TransportError:
            time.sleep(0.02)
    early = srv.post("/v1/completions", json={"model": srv.model, "prompt": "Hi", "max_tokens": 2})
    assert first.status_code == 503 and first.json()["status"] == "starting"
    assert early.status_code == 503 and early.json()["error"]["code"] == "starting"
    srv.wait_ready()
    assert srv.post("/v1/completions", json={"model": srv.model, "prompt": "Hi", "max_tokens": 2}).status_code == 200


def test_a_server_that_cannot_load_its_model_exits_with_the_reason(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "plait", "serve", "--model", str(tmp_path / "missing"),
                           "--port", "0", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "is not a Hugging Face checkpoint directory" in proc.stderr
    assert "the server failed to start" in proc.stderr
