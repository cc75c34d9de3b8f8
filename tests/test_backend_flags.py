"""The three attention-backend flags on the engine CLI and their passthrough in ``plait bench``."""

from __future__ import annotations

import json

import pytest
import torch

from plait.bench.cli import backend_options, backend_tag
from plait.bench.results import write_result
from plait.cli import build_parser


def test_engine_cli_offers_torch_flash_on_every_backend_flag():
    args = build_parser().parse_args(["generate", "--prompt", "x", "--attention-backend", "torch_flash",
                                      "--prefill-attention-backend", "torch_flash", "--decode-attention-backend",
                                      "triton"])
    assert (args.attention_backend, args.prefill_attention_backend, args.decode_attention_backend) == (
        "torch_flash", "torch_flash", "triton")


def test_engine_cli_rejects_an_unknown_backend_before_start():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["generate", "--prompt", "x", "--decode-attention-backend", "flashinfer"])


def test_bench_offline_passes_the_hybrid_pair_through_with_graphs_on():
    args = build_parser().parse_args(["bench", "offline", "--prefill-attention-backend", "torch_flash",
                                      "--decode-attention-backend", "triton"])
    options = backend_options(args)
    assert options == {"prefill_attention_backend": "torch_flash", "decode_attention_backend": "triton"}
    assert backend_tag(options) == "attn-torch_flash-triton"


def test_bench_latency_turns_graphs_off_when_torch_flash_decodes():
    args = build_parser().parse_args(["bench", "latency", "--prefill", "--prefill-only", "--attention-backend",
                                      "torch_flash"])
    options = backend_options(args)
    assert options == {"attention_backend": "torch_flash", "disable_cuda_graph": True}
    assert backend_tag(options) == "attn-torch_flash"


def test_bench_without_backend_flags_keeps_its_file_names():
    args = build_parser().parse_args(["bench", "offline"])
    assert backend_options(args) == {} and backend_tag({}) is None


def test_result_tag_goes_into_the_file_name(tmp_path):
    path = write_result(tmp_path, "offline-throughput", "llama-3.2-1b", "output_tok_s", 1.0, None, None, None,
                        {"attention_backend": "triton"}, tag="attn-triton")
    assert path.name.endswith("-attn-triton.json")
    assert json.loads(path.read_text())["config"] == {"attention_backend": "triton"}


def test_a_result_records_the_host_cpu_it_ran_on(tmp_path):
    path = write_result(tmp_path, "offline-throughput", "llama-3.2-1b", "output_tok_s", 1.0, None, None, None, {})
    host = json.loads(path.read_text())["host"]
    assert host["cpus"] >= 1 and host["cpu"]


def test_a_result_records_the_device_memory_its_defaults_follow_from(tmp_path):
    path = write_result(tmp_path, "offline-throughput", "llama-3.2-1b", "output_tok_s", 1.0, None, None, None, {})
    record = json.loads(path.read_text())
    expected = torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None
    assert "device_memory_bytes" in record and record["device_memory_bytes"] == expected
