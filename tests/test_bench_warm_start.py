"""``plait bench warm-start``: one fresh process per start, over its own Triton cache directory, with
the warm-up off and on; the first requests' figures against the second's, written as one JSON."""

from __future__ import annotations

import json
import os
import pathlib
from types import SimpleNamespace

import pytest

from plait.bench.warm_start import TritonCompiles, describe_variant, measure
from plait.cli import build_parser

SMALL = {"ttft_prompt_len": 24, "num_requests": 3, "input_len": 8, "output_len": 3, "context_length": 256,
         "device": "cpu", "max_total_tokens": 2048, "max_running_requests": 3, "chunked_prefill_size": 64}


SHAPE = "tiny-qwen3-moe"  # the command writes a named shape
VOCAB = 512  # the tiny llama's


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from plait.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("warm_bench"), "llama", seed=0, num_hidden_layers=1)


def test_measure_reports_ready_time_first_and_second_figures(model):
    out = measure(str(model), vocab=VOCAB, warmup="on", **SMALL)
    assert out["ready_s"] > out["warmup_s"] > 0 and out["warmup_requests"] > 0
    assert out["ttft_first_over_second"] == pytest.approx(out["ttft_first_s"] / out["ttft_second_s"])
    assert out["offline_first_over_second"] == pytest.approx(out["offline_first_tok_s"] / out["offline_second_tok_s"])


def test_measure_without_warmup_has_no_warmup_figures(model):
    out = measure(str(model), vocab=VOCAB, warmup="off", **{**SMALL, "ttft_prompt_len": None, "num_requests": 0})
    assert out["warmup"] == "off" and "warmup_s" not in out and "ttft_first_s" not in out


def test_triton_compiles_counts_by_kernel_and_restores_the_previous_hook():
    from triton import knobs

    before = knobs.runtime.jit_post_compile_hook
    compile = {"signature": {"X": "*bf16"}, "constants": {}, "configs": [{}]}
    with TritonCompiles() as compiles:
        hook = knobs.runtime.jit_post_compile_hook
        for name in ("_extend_kernel", "_extend_kernel", "_rmsnorm_kernel"):
            hook(key=None, repr="", fn=SimpleNamespace(name=name), compile=compile, is_manual_warmup=False,
                 already_compiled=False)
    assert compiles.names == {"_extend_kernel": 2, "_rmsnorm_kernel": 1} and compiles.total == 3
    assert compiles.variants[-1] == "_rmsnorm_kernel(X: *bf16)"
    assert knobs.runtime.jit_post_compile_hook is before


def test_a_variant_description_shows_what_triton_fixed_at_compile_time():
    # As Triton hands them to its compile hooks: a pointer assumed 16-byte aligned, one that is not, an
    # int specialised to 1 (a constant) and a constexpr.
    signature = {"Q": "*bf16", "Indptr": "*i32", "bs": "constexpr", "BLOCK": "constexpr"}
    constants = {(2,): 1, (3,): 256}
    attrs = {(0,): [["tt.divisibility", 16]], (1,): []}
    assert describe_variant("_k", signature, constants, attrs) == "_k(Q: *bf16 %16, Indptr: *i32, bs=1, BLOCK=256)"


def test_warm_start_command_writes_warmup_on_against_off(tmp_path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PYTHONPATH", str(pathlib.Path(__file__).resolve().parents[1]) + os.pathsep
                       + os.environ.get("PYTHONPATH", ""))
    args = build_parser().parse_args([
        "bench", "warm-start", "--ttft-shape", "--offline-shape", SHAPE, "--num-requests", "2",
        "--input-len", "8", "--output-len", "2", "--context-length", "256", "--no-disk-start",
        "--out", str(tmp_path)])
    assert args.func(args) == 0
    (path,) = tmp_path.glob("*warm-start-tiny-qwen3-moe*offline.json")
    record = json.loads(path.read_text())
    assert record["metric"] == "offline_first_over_second" and record["peer_name"] == "plait, warm-up off"
    assert set(record["runs"]) == {"cold-warmup-off", "cold-warmup-on"}
    assert record["plait"] == record["runs"]["cold-warmup-on"]["offline_first_over_second"]
    assert set(record["ready_s"]) == {"cold-warmup-off", "cold-warmup-on"}
    on, off = record["runs"]["cold-warmup-on"], record["runs"]["cold-warmup-off"]
    assert on["warmup_s"] > 0 and "warmup_s" not in off
    # Each mode's processes ran over a Triton cache directory of their own.
    assert on["triton_cache_dir"] and off["triton_cache_dir"] and on["triton_cache_dir"] != off["triton_cache_dir"]
