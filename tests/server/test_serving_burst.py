"""The serving path at a high token rate: `plait serve --stream-interval` over HTTP, and `plait bench
serve --workload serving-burst` (the server against the offline Engine on the same requests)."""

from __future__ import annotations

import json

import httpx
import pytest

from plait.cli import main
from plait.server.bench import sse_lines
from tests.server.conftest import HTTP_TIMEOUT

INTERVAL = 4


@pytest.fixture(scope="module")
def interval_server(start_server):
    return start_server("stream-interval", stream_interval=INTERVAL, max_total_tokens=4096)


async def _token_chunks(url: str, body: dict) -> list[dict]:
    chunks = []
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT) as client, \
            client.stream("POST", url + "/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in sse_lines(r.aiter_bytes()):
            if line.startswith("data: ") and line != "data: [DONE]":
                chunks.append(json.loads(line[6:])["choices"][0])
    return chunks


def test_stream_interval_server_sends_tokens_in_steps_of_n_and_the_same_output(interval_server):
    import asyncio

    body = {"model": interval_server.model, "prompt": [11, 12, 13, 14], "max_tokens": 11, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    chunks = asyncio.run(_token_chunks(interval_server.url, {**body, "stream": True}))
    counts = [len(c["token_ids"]) for c in chunks]
    assert sum(counts) == 11 and chunks[-1]["finish_reason"] == "length"
    # Under load the server may also merge queued chunks (on a busy machine all of them, into one event):
    # every boundary but the last still falls after the first token plus a multiple of the interval.
    # The exact steps without merging are tests/test_stream_interval.py's.
    cuts = [sum(counts[: i + 1]) for i in range(len(counts) - 1)]
    assert all((cut - 1) % INTERVAL == 0 for cut in cuts)
    assert len(chunks) <= 4
    whole = interval_server.post("/v1/completions", json=body).json()["choices"][0]
    assert [t for c in chunks for t in c["token_ids"]] == whole["token_ids"]
    assert "".join(c["text"] for c in chunks) == whole["text"]


@pytest.fixture(scope="module")
def burst_result(server_model, tmp_path_factory) -> dict:
    """One `plait bench serve --workload serving-burst` run on the CPU, its result JSON."""
    out = tmp_path_factory.mktemp("burst")
    code = main(["bench", "serve", "--workload", "serving-burst", "--model", str(server_model), "--device", "cpu",
                 "--max-total-tokens", "4096", "--num-prompts", "6", "--input-len", "8", "--output-len", "4",
                 "--client-procs", "2", "--out", str(out)])
    assert code == 0
    [path] = out.glob("*-serving-burst-*-cpu.json")
    return json.loads(path.read_text())


def test_serving_burst_writes_server_and_offline_engine_throughput_and_their_ratio(burst_result):
    r = burst_result
    assert r["workload"] == "serving-burst" and r["config"]["bench"]["request_rate"] == "inf"
    assert r["completed"] == 6 and r["errors"] == 0 and r["kv_slots_in_use_after"] == 0
    assert r["total_output_tokens"] == 24
    assert r["peer_name"] == "plait-offline-engine" and r["peer_detail"]["generated_tokens"] == 24
    assert r["ratio_vs_peer"] == pytest.approx(r["plait"] / r["peer"])
    assert r["peer_ttft_p50_ms"] > 0 and r["ttft_p50_ms"] > 0
    assert r["ttft_p50_ratio_vs_peer"] == pytest.approx(r["ttft_p50_ms"] / r["peer_ttft_p50_ms"])
    assert r["peer_detail"]["kv_tokens_in_use_after"] == 0


def test_serving_burst_records_when_sends_first_tokens_and_ends_happened(burst_result):
    """The server's and the peer's timelines, ms after the first send, in the order a burst moves."""
    r = burst_result
    for tl in (r["timeline_ms"], r["peer_detail"]["timeline_ms"]):
        assert 0 <= tl["last_sent"] <= tl["last_done"]
        assert 0 < tl["first_token"] <= tl["last_first_token"] <= tl["last_done"]
    assert r["timeline_ms"]["last_done"] <= 1e3 * r["duration_s"]  # the duration also spans the clients' start
    assert r["peer_detail"]["timeline_ms"]["last_done"] == pytest.approx(1e3 * r["peer_detail"]["seconds"])


def test_serving_burst_lines_the_scheduler_loop_up_with_the_clients_clock(burst_result):
    """The scheduler process's loop trace (PLAIT_LOOP_TRACE, set by the bench) read back in ms after the
    clients' first send: every request taken, the first step after the first message."""
    tl = burst_result["scheduler_timeline_ms"]
    assert tl["first_message"] is not None and tl["all_requests_taken"] is not None
    assert tl["first_message"] <= tl["first_step"] <= burst_result["timeline_ms"]["last_done"]
    assert tl["first_message"] <= tl["all_requests_taken"]
    first = tl["iterations"][0]
    assert first["messages"] >= 1 and first["prefills"] and first["step_ms"] >= 0
    assert tl["slowest_steps"] and tl["gc_pause_ms"] >= 0


def test_serving_burst_times_the_server_and_the_peer_steps_by_kind(burst_result):
    """Both sides' steps split into prefill and decode (a burst of 6 x 8 in / 4 out prefills, then decodes
    the last tokens), with the time outside steps: on a GPU each kind also carries its device time."""
    server, peer = burst_result["scheduler_steps"], burst_result["peer_detail"]["steps"]
    for steps in (server, peer):
        assert steps["prefill"]["count"] >= 1 and steps["decode"]["count"] >= 1
        assert 0 < steps["decode"]["median_ms"] <= steps["decode"]["p90_ms"]
        assert steps["outside_steps_s"] >= 0
        assert "device_busy_s" not in steps["decode"]  # on the CPU: wall times only


def test_serving_burst_records_the_cpus_each_side_used_during_the_load(burst_result):
    """The scheduler process, the HTTP processes, the client (this process and its two load processes)
    and the machine, in CPUs' worth of use over the load."""
    cpu = burst_result["host_cpu"]
    assert cpu["cpus"] >= 1 and 0 < cpu["busy_cpus"] <= cpu["cpus"] + 0.05 and cpu["steal_cpus"] >= 0
    assert cpu["scheduler_cpus"] > 0 and cpu["http_cpus"] > 0 and cpu["children_cpus"] > 0
    assert cpu["client_cpus"] >= 0


def test_loop_timeline_reads_a_trace_relative_to_the_first_send(tmp_path):
    from plait.engine.scheduler_process import write_loop_trace
    from plait.server.bench import loop_timeline

    path = str(tmp_path / "trace.jsonl")
    write_loop_trace(path, [(10.1, 10.11, 10.13, 10.13, 10.14, 2, True, True, 0, 2, 0.0),
                            (10.14, 10.15, 10.16, 10.16, 10.17, 1, True, True, 0, 3, 0.0),
                            (10.17, 10.17, 10.18, 10.18, 10.19, 0, True, False, 0, 3, 0.0)])
    tl = loop_timeline(path, 10.0, num_requests=3)
    assert tl["first_message"] == pytest.approx(100.0) and tl["first_step"] == pytest.approx(110.0)
    assert tl["all_requests_taken"] == pytest.approx(150.0)
    assert [it["messages"] for it in tl["iterations"]] == [2, 1, 0]
    first = tl["iterations"][0]
    assert (first["recv_ms"], first["step_ms"], first["updates_ms"]) == pytest.approx((10.0, 20.0, 10.0))
    assert loop_timeline(str(tmp_path / "missing.jsonl"), 10.0, 3) is None


def test_loop_timeline_lists_the_slowest_steps_with_the_collectors_pauses_inside_them(tmp_path):
    from plait.engine.scheduler_process import write_loop_trace
    from plait.server.bench import loop_timeline

    path = str(tmp_path / "trace.jsonl")
    # Steps of 10, 30 and 20 ms; the 30 ms one held a 12 ms collection.
    write_loop_trace(path, [(1.0, 1.0, 1.01, 1.01, 1.01, 3, True, True, 0, 3, 0.0),
                            (1.01, 1.01, 1.04, 1.04, 1.04, 0, True, False, 0, 3, 0.012),
                            (1.04, 1.04, 1.06, 1.06, 1.06, 0, True, False, 0, 3, 0.001)])
    tl = loop_timeline(path, 1.0, num_requests=3, first=2)
    assert [(s["index"], round(s["step_ms"])) for s in tl["slowest_steps"]] == [(1, 30), (2, 20)]
    assert tl["slowest_steps"][0]["gc_ms"] == pytest.approx(12.0)
    assert tl["gc_pause_ms"] == pytest.approx(13.0)


def test_timeline_is_in_ms_after_the_first_send():
    from plait.server.bench import RequestResult, timeline

    a = RequestResult(8, 4, ok=True, ttft=0.5, sent=10.0, done=12.0)
    b = RequestResult(8, 4, ok=True, ttft=0.25, sent=10.5, done=11.0)
    assert timeline([a, b]) == {"last_sent": 500.0, "first_token": 500.0, "last_first_token": 750.0,
                                "last_done": 2000.0}
    assert timeline([]) is None


def test_the_offline_peer_idles_the_seconds_asked_between_its_passes(server_model):
    import time

    from plait.server.bench_peer import offline_burst

    requests = [([11 + i, 12, 13, 14], 2) for i in range(2)]
    t0 = time.perf_counter()
    peer = offline_burst(str(server_model), {"device": "cpu", "max_total_tokens": 4096}, requests, idle_s=0.5)
    assert peer["idle_before_timed_s"] == 0.5
    assert time.perf_counter() - t0 >= 0.5 + peer["seconds"]


def test_a_negative_peer_idle_is_refused_with_the_flag_named(tmp_path, capsys):
    code = main(["bench", "serve", "--workload", "serving-burst", "--peer-idle-s", "-1", "--out", str(tmp_path)])
    assert code == 2
    assert "--peer-idle-s must be in [0, 600] seconds, got -1.0" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_serving_burst_with_a_request_rate_is_refused_before_any_server_starts(tmp_path, capsys):
    code = main(["bench", "serve", "--workload", "serving-burst", "--request-rate", "20", "--out", str(tmp_path)])
    assert code == 2
    assert "--workload serving-burst sends every request at once" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_the_offline_peer_splits_its_steps_as_the_servers_loop_does(server_model):
    """The peer's steps split into prefilling and decode-only ones by the rule the scheduler process's
    loop uses (requests waiting or prefilling when the step starts), so the two compare step for step."""
    from plait.server.bench_peer import offline_burst

    requests = [([11 + i, 12, 13, 14, 15, 16, 17, 18], 4) for i in range(6)]
    peer = offline_burst(str(server_model), {"device": "cpu", "max_total_tokens": 4096}, requests)
    loop = peer["loop"]
    assert peer["generated_tokens"] == 24
    assert loop["prefill_iterations"] >= 1 and loop["iterations"] > loop["prefill_iterations"]
    assert loop["step_ms_per_prefill_iteration"] > 0 and loop["step_ms_per_decode_iteration"] > 0
