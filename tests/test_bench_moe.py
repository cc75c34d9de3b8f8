"""The MoE benchmark path on the CPU: the device-side count of distinct routed experts (the decode
floor's), and ``plait bench latency`` / ``plait bench offline`` end to end on tiny MoE shapes with
the transformers peer, writing result JSON as the H200 runs do."""

from __future__ import annotations

import json

import pytest
import torch

from plait import cli
from plait.bench.shapes import moe_counts
from plait.bench.workloads import decode_step_bytes, distinct_for_step
from plait.layers.moe import routing_stats
from plait.layers.moe.routing_stats import RoutedExpertCounter
from tests.helpers import make_engine


def test_counter_records_tokens_and_distinct_experts_per_call_in_a_ring():
    counter = RoutedExpertCounter(num_experts=8, device="cpu", capacity=2)
    counter.record(torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32))  # 3 tokens, experts {0, 1, 2}
    counter.record(torch.tensor([[5, 7]], dtype=torch.int32))
    assert counter.calls() == [(3, 3), (1, 2)]
    counter.record(torch.tensor([[4, 4], [4, 6]], dtype=torch.int32))  # overwrites the oldest call
    assert counter.calls() == [(1, 2), (2, 2)]
    assert counter.mean_distinct_by_tokens() == {1: 2.0, 2: 2.0}
    counter.reset()
    assert counter.calls() == []


def test_engine_counts_every_sparse_layer_call_only_when_enabled(tiny_model_dir, monkeypatch):
    path = tiny_model_dir("qwen3-moe")  # layer 0 sparse (8 experts, top 2), layer 1 dense
    with make_engine(path, max_total_tokens=128) as plain:
        assert routing_stats.counter_of(plain.runner.model) is None
    monkeypatch.setenv("PLAIT_COUNT_ROUTED_EXPERTS", "1")
    with make_engine(path, max_total_tokens=128) as engine:
        counter = routing_stats.counter_of(engine.runner.model)
        assert counter is not None
        engine.generate([[11, 12, 13, 14, 15]], {"temperature": 0.0, "max_new_tokens": 3})
        calls = counter.calls()
    # One sparse layer: the 5-token prefill, then two one-token decode steps (top 2: two experts each).
    assert [t for t, _ in calls] == [5, 1, 1]
    assert 2 <= calls[0][1] <= 8 and [d for _, d in calls[1:]] == [2, 2]


def test_decode_floor_reads_the_counted_experts_of_the_step_size():
    measured = {1: 4.0, 256: 120.0, 4096: 128.0}
    assert distinct_for_step(measured, 1) == 4.0
    assert distinct_for_step(measured, 200) == 120.0  # a graph bucket of 256 served 200 requests
    assert distinct_for_step(measured, 2000) is None  # the 4096-token calls were prefill, not this step
    m = moe_counts("qwen3-30b-a3b")
    fewer, more = (decode_step_bytes("qwen3-30b-a3b", [100], d) for d in (8.0, 16.0))
    assert more - fewer == 2 * 8 * m["sparse_layers"] * m["per_expert"]  # bf16 bytes of 8 more experts per layer


def _result(out, workload: str, shape: str) -> dict:
    (file,) = out.glob(f"*-{workload}-{shape}-cpu.json")
    return json.loads(file.read_text())


def test_bench_latency_and_offline_run_tiny_moe_shapes_with_the_transformers_peer(tmp_path):
    out = tmp_path / "results"
    # Enough steps that a loaded host's pause in the prefill timing cannot outlast the decode it is
    # subtracted from (decode_bs1 refuses a decode no longer than its prefill).
    assert cli.main(["bench", "latency", "--shape", "tiny-qwen3-moe", "--output-len", "12", "--no-compile-peer",
                     "--out", str(out)]) == 0
    decode = _result(out, "decode-bs1", "tiny-qwen3-moe")
    assert decode["plait"] > 0 and decode["peer"] > 0 and decode["peer_name"] == "transformers generate"
    assert decode["distinct_experts_per_layer_step"] == 2.0  # one token, top 2
    # Counted by the eager run; the headline (graph) run times the engine without the counter.
    assert decode["eager"]["distinct_experts_per_layer_step"] == 2.0
    assert "distinct_experts_per_layer_step" not in decode["graph"]
    assert decode["bytes_per_step"] == decode_step_bytes("tiny-qwen3-moe", [128 + 6], 2.0)
    assert decode["floor"] > 0 and decode["fraction_of_floor"] > 0

    assert cli.main(["bench", "offline", "--shape", "tiny-gpt-oss", "--num-requests", "3", "--input-len", "16",
                     "--output-len", "4", "--peer", "--out", str(out)]) == 0
    offline = _result(out, "offline-throughput", "tiny-gpt-oss")
    assert offline["plait"] > 0 and offline["peer"] > 0 and offline["peer_name"] == "transformers generate_batch"
    assert offline["detail"]["generated_tokens"] == 3 * 4
    by_tokens = {int(t): d for t, d in offline["detail"]["distinct_experts_by_tokens"].items()}
    assert 2 <= by_tokens[3] <= 6  # decode steps of the three requests: top 2 each, of 8 experts
    assert offline["floor"] > 0 and "distinct experts" in offline["floor_definition"]


def test_peer_runs_all_requests_of_a_dense_shape_and_a_bounded_prefix_of_a_moe_shape():
    from plait.bench.cli import MOE_PEER_REQUESTS, peer_request_count

    assert peer_request_count(None, 256, "llama-3.2-1b") == 256
    assert peer_request_count(None, 256, "qwen3-30b-a3b") == MOE_PEER_REQUESTS < 256
    assert peer_request_count(None, 3, "gpt-oss-20b") == 3
    assert peer_request_count(40, 256, "qwen3-30b-a3b") == 40


def test_peer_requests_outside_the_workload_are_refused_naming_the_flag(capsys):
    assert cli.main(["bench", "offline", "--shape", "tiny-qwen3-moe", "--num-requests", "3", "--peer",
                     "--peer-requests", "4"]) == 2
    assert "--peer-requests must be in [1, --num-requests=3], got 4" in capsys.readouterr().err


def test_offline_peer_on_a_prefix_says_so_and_plait_runs_the_whole_workload(tmp_path):
    out = tmp_path / "results"
    assert cli.main(["bench", "offline", "--shape", "tiny-qwen3-moe", "--num-requests", "3", "--input-len", "16",
                     "--output-len", "4", "--peer", "--peer-requests", "2", "--out", str(out)]) == 0
    offline = _result(out, "offline-throughput", "tiny-qwen3-moe")
    assert offline["peer_requests"] == 2 and offline["peer_subset"] is True
    assert offline["peer_name"] == "transformers generate_batch (first 2 of 3 requests)"
    assert "first 2 of the 3 requests" in offline["peer_note"]
    assert offline["peer_detail"]["generated_tokens"] == 2 * 4  # the same per-request lengths
    assert offline["detail"]["generated_tokens"] == 3 * 4  # plait and the floor: all requests
    assert offline["peer"] == offline["peer_detail"]["output_tok_s"] > 0


def test_one_launch_counter_records_what_the_torch_counter_records():
    # Triton interpreter: the same ring contents call for call, ids of other ranks (-1, E) not counted.
    pytest.importorskip("plait.layers.moe.routing_stats_triton")
    routings = [torch.tensor([[0, 1], [1, 2], [2, 0]], dtype=torch.int32),
                torch.tensor([[5, -1]], dtype=torch.int32), torch.tensor([[4, 4], [4, 8]], dtype=torch.int64)]
    torch_counter = RoutedExpertCounter(num_experts=8, device="cpu", capacity=2)
    fused_counter = RoutedExpertCounter(num_experts=8, device="cpu", capacity=2)
    for ids in routings:
        torch_counter.record(ids, fused=False)
        fused_counter.record(ids, fused=True)
        assert fused_counter.calls() == torch_counter.calls()
    assert fused_counter.calls() == [(1, 1), (2, 1)]


def test_eager_attention_peer_batches_few_enough_tokens_that_its_scores_fit():
    # gpt-oss's transformers peer runs paged eager attention, which materialises a batch's scores
    # [heads, T, T + cached]: at transformers' default 8192 tokens that alone is the 8 GiB allocation
    # the H200 run failed on. SDPA peers keep transformers' defaults.
    from plait.bench import peer_hf
    from plait.bench.shapes import SHAPES

    cfg = peer_hf.gpu_batching_config("gpt-oss-20b")
    heads = SHAPES["gpt-oss-20b"]["num_attention_heads"]

    def bf16_score_bytes(tokens: int) -> int:
        return heads * tokens * tokens * 2

    assert bf16_score_bytes(8192) == 8 * 2**30
    assert bf16_score_bytes(cfg.max_batch_tokens) <= 2**29
    assert cfg.max_memory_percent < 0.9  # transformers' own share for the cache
    assert peer_hf.gpu_batching_config("qwen3-30b-a3b") is None


def test_release_leaves_nothing_holding_the_engines_model(tmp_path):
    # Each bench engine is released before the next engine or the transformers peer is built, so the
    # GPU memory its weights and KV pool held can return: nothing may keep the model alive.
    import gc
    import weakref

    from plait.bench.shapes import write_shape_dir
    from plait.bench.workloads import make_engine as bench_engine
    from plait.bench.workloads import release

    engine = bench_engine(str(write_shape_dir(str(tmp_path), "tiny-qwen3-moe")), max_total_tokens=512)
    engine.generate([[1, 2, 3]], {"max_new_tokens": 2, "temperature": 0.0})
    model = weakref.ref(engine.runner.model)
    release(engine)
    del engine
    gc.collect()
    assert model() is None


def test_offline_reports_the_median_of_its_timed_passes_and_each_pass(tmp_path):
    out = tmp_path / "results"
    assert cli.main(["bench", "offline", "--shape", "tiny-qwen3-moe", "--num-requests", "3", "--input-len", "16",
                     "--output-len", "4", "--repeats", "3", "--out", str(out)]) == 0
    offline = _result(out, "offline-throughput", "tiny-qwen3-moe")
    runs = offline["detail"]["runs_output_tok_s"]
    assert offline["detail"]["timed_passes"] == 3 and len(runs) == 3
    assert offline["plait"] == sorted(runs)[1]  # the median pass
    assert offline["detail"]["generated_tokens"] == 3 * 4


def test_offline_refuses_fewer_than_one_timed_pass_naming_the_flag(capsys):
    assert cli.main(["bench", "offline", "--shape", "tiny-qwen3-moe", "--num-requests", "3", "--repeats", "0"]) == 2
    assert "--repeats must be >= 1 timed pass, got 0" in capsys.readouterr().err
