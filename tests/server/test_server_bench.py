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
