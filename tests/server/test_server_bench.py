"""`plait bench serve`: the `serving` workload's JSON, against a running server."""

from __future__ import annotations

import json

from plait.cli import main

RESULT_KEYS = {"workload", "shape", "device", "commit", "date", "versions", "metric", "plait", "peer_name",
                 "peer", "ratio_vs_peer", "floor", "fraction_of_floor", "config"}


def test_bench_serve_writes_the_serving_result_with_zero_errors_and_no_kv_left(server, tmp_path):
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "24", "--input-len", "16",
                 "--output-len", "8", "--range-ratio", "0.5", "--request-rate", "200", "--max-concurrency", "8",
                 "--shape", "tiny-llama", "--out", str(tmp_path)])
    assert code == 0
    [path] = tmp_path.glob("*-serving-tiny-llama-cpu.json")
    result = json.loads(path.read_text())
    assert RESULT_KEYS <= set(result)
    assert result["workload"] == "serving" and result["device"] == "cpu" and result["metric"] == "output_tok_s"
    assert result["peer"] is None and set(result["versions"]) == {"torch", "triton", "transformers"}
    assert result["completed"] == 24 and result["errors"] == 0
    assert result["kv_slots_in_use_after"] == 0
    assert result["plait"] > 0
    for name in ("ttft", "itl", "e2e"):
        assert 0 <= result[f"{name}_p50_ms"] <= result[f"{name}_p99_ms"]
    assert result["config"]["bench"]["num_prompts"] == 24
    assert result["host"]["cpus"] >= 1 and result["host"]["cpu"]  # the host the loop times depend on
    loop = result["scheduler_loop"]  # the scheduler process's loop during the load
    assert loop["iterations"] > 0 and loop["step_s"] > 0
    assert set(loop["ms_per_iteration"]) == {"recv", "step", "collect", "send"}
    # Every request's prompt is prefilled in some step; most steps then only decode.
    assert 0 < loop["prefill_iterations"] < loop["iterations"]
    assert loop["step_ms_per_prefill_iteration"] > 0 and loop["step_ms_per_decode_iteration"] > 0


def _lines(chunks: list[bytes]) -> list[str]:
    import asyncio

    from plait.server.bench import sse_lines

    async def feed():
        for c in chunks:
            yield c

    async def collect() -> list[str]:
        return [line async for line in sse_lines(feed())]

    return asyncio.run(collect())


def test_bench_serve_without_streaming_counts_every_token_of_each_answer(server, tmp_path):
    code = main(["bench", "serve", "--base-url", server.url, "--num-prompts", "12", "--input-len", "16",
                 "--output-len", "8", "--request-rate", "200", "--no-stream", "--shape", "tiny-llama",
                 "--out", str(tmp_path)])
    assert code == 0
    [path] = tmp_path.glob("*-serving-tiny-llama-cpu.json")
    result = json.loads(path.read_text())
    assert result["config"]["bench"]["stream"] is False
    assert result["completed"] == 12 and result["errors"] == 0
    assert result["tokens_per_chunk"] == 8  # one answer per request, all its tokens
    assert result["ttft_p50_ms"] == result["e2e_p50_ms"]  # an answer's arrival is its first token


def test_sse_lines_keep_unicode_line_separators_inside_a_data_line():
    event = 'data: {"text": "a\u2028b\x85c\u2029d"}'.encode()
    assert _lines([event + b"\n\n", b"data: [DONE]\n\n"]) == [event.decode(), "", "data: [DONE]", ""]


def test_sse_lines_join_lines_and_characters_split_across_chunks():
    raw = 'data: {"text": "é\u2028"}\r\n\r\ndata: [DONE]\r\n'.encode()
    chunks = [raw[i:i + 3] for i in range(0, len(raw), 3)]  # cuts a CRLF and multi-byte characters
    assert _lines(chunks) == ['data: {"text": "é\u2028"}', "", "data: [DONE]"]


def test_shape_without_a_model_that_is_no_benchmark_shape_is_refused_before_any_server_starts(tmp_path, capsys):
    code = main(["bench", "serve", "--shape", "tiny-llama", "--num-prompts", "1", "--out", str(tmp_path)])
    assert code == 2
    assert "--shape 'tiny-llama' is not a benchmark shape" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []


def test_shape_without_a_model_builds_that_shape_with_dummy_weights(tmp_path):
    import argparse

    from plait.bench.shapes import SHAPES
    from plait.server.bench import resolve_shape, shape_mismatch

    args = argparse.Namespace(shape="llama-3.2-1b", model=None, base_url=None)
    model, options = resolve_shape(args, {"max_total_tokens": 4096}, str(tmp_path))
    assert options == {"load_format": "dummy", "dtype": "bfloat16", "max_total_tokens": 4096}
    assert shape_mismatch("llama-3.2-1b", model) is None
    assert json.loads((tmp_path / "llama-3.2-1b" / "config.json").read_text()) == SHAPES["llama-3.2-1b"]


def test_a_benchmark_shape_that_the_served_model_is_not_is_refused(server):
    import argparse

    import pytest

    from plait.server.bench import check_served_shape

    with pytest.raises(ValueError, match="--shape llama-3.1-8b does not describe the served model"):
        check_served_shape(argparse.Namespace(shape="llama-3.1-8b"), {"model": server.model})
    check_served_shape(argparse.Namespace(shape="tiny-llama"), {"model": server.model})  # a label only


def _post(url: str, body: dict) -> tuple[int, dict[str, str], list[bytes]]:
    import asyncio

    from plait.server import bench_http

    async def go() -> tuple[int, dict[str, str], list[bytes]]:
        async with bench_http.post(url, json.dumps(body).encode()) as r:
            return r.status, r.headers, [part async for part in r.aiter_bytes()]

    return asyncio.run(go())


def test_load_generator_client_reads_a_chunked_event_stream_as_httpx_does(server, model_name):
    body = {"model": model_name, "prompt": [11, 12, 13], "max_tokens": 5, "temperature": 0.0, "stream": True,
            "ignore_eos": True, "return_token_ids": True}
    status, headers, parts = _post(server.url + "/v1/completions", body)
    assert status == 200 and headers["content-type"].startswith("text/event-stream")
    assert headers["transfer-encoding"] == "chunked"
    expected = server.post("/v1/completions", json=body).text
    streamed = b"".join(parts).decode()
    assert streamed.endswith("data: [DONE]\n\n")
    ids = [t for line in streamed.split("\n") if line.startswith("data: {")
           for t in json.loads(line[6:])["choices"][0]["token_ids"]]
    assert ids == [t for line in expected.split("\n") if line.startswith("data: {")
                   for t in json.loads(line[6:])["choices"][0]["token_ids"]]
    assert len(ids) == 5


def test_load_generator_client_reads_an_error_body_of_known_length(server, model_name):
    status, headers, parts = _post(server.url + "/v1/completions", {"model": model_name, "prompt": [],
                                                                     "stream": True})
    assert status == 400 and int(headers["content-length"]) == len(b"".join(parts))
    assert json.loads(b"".join(parts))["error"]["param"] == "prompt"


def test_load_generator_refuses_a_url_that_is_not_plain_http():
    import pytest

    from plait.server.bench_http import split_url

    with pytest.raises(ValueError, match="not an http:// URL"):
        split_url("https://example.com/v1/completions")
    assert split_url("http://127.0.0.1:8000/v1/completions?x=1") == ("127.0.0.1", 8000, "/v1/completions?x=1")


def test_triton_cache_kernels_names_each_cached_variant_and_skips_group_files(tmp_path, monkeypatch):
    from plait.server.bench import triton_cache_kernels

    for entry, name in (("a1", "_gemv_kernel"), ("b2", "_gemv_kernel"), ("c3", "_rmsnorm_kernel")):
        (tmp_path / entry).mkdir()
        (tmp_path / entry / f"{name}.json").write_text("{}")
        (tmp_path / entry / f"__grp__{name}.json").write_text("{}")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))
    assert triton_cache_kernels() == {("a1", "_gemv_kernel"), ("b2", "_gemv_kernel"), ("c3", "_rmsnorm_kernel")}
