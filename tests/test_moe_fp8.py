"""Block-FP8 experts in Qwen3-MoE models (CPU, fp32): a checkpoint in the published
Qwen3-30B-A3B-FP8 layout and ``--quantization fp8`` on a bf16/fp32 one load into the fused expert
tensors and decode greedily as transformers does on the dequantized weights; bad layouts fail at
load naming the tensor."""

from __future__ import annotations

import json
import pathlib
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from plait.testing import make_tiny_model
from tests.helpers import assert_no_leaks, make_engine, prompt_ids
from tests.quant_helpers import write_dequantized_checkpoint, write_fp8_checkpoint, write_online_fp8_simulation

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PROMPTS = prompt_ids(2)
# The smallest Qwen3-MoE whose every projection is on the 128-row grid: experts of H 256 x I 128,
# q 256 and k/v 128 rows, a dense layer (mlp_only_layers [1]) of intermediate 256.
FP8_SHAPE = dict(hidden_size=256, moe_intermediate_size=128, intermediate_size=256, num_attention_heads=16,
                 num_key_value_heads=8, num_hidden_layers=2)


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory) -> tuple[pathlib.Path, pathlib.Path]:
    """(the FP8 checkpoint, its dequantized fp32 twin)."""
    root = tmp_path_factory.mktemp("moe-fp8")
    src = make_tiny_model(root / "src", "qwen3-moe", seed=0, **FP8_SHAPE)
    fp8 = write_fp8_checkpoint(src, root / "fp8", "fp8-block")
    return fp8, write_dequantized_checkpoint(fp8, root / "deq")


def test_published_fp8_layout_loads_into_the_fused_fp8_expert_tensors(fp8_pair):
    fp8, _ = fp8_pair
    raw = load_file(str(fp8 / "model.safetensors"))
    assert raw["model.layers.0.mlp.experts.3.up_proj.weight"].dtype == torch.float8_e4m3fn
    assert raw["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"].shape == (1, 2)
    with make_engine(fp8, max_total_tokens=128) as engine:
        layer = engine.runner.model.model.layers[0]
        ex = layer.mlp.experts
        assert ex.w13_weight.dtype == torch.float8_e4m3fn and ex.w13_weight.shape == (8, 256, 256)
        assert ex.w13_weight_scale_inv.shape == (8, 2, 2) and ex.w2_weight_scale_inv.shape == (8, 2, 1)
        # gate rows then up rows, each with its own scales
        assert torch.equal(ex.w13_weight[3, 128:].float(), raw["model.layers.0.mlp.experts.3.up_proj.weight"].float())
        assert torch.equal(ex.w13_weight_scale_inv[3, 1:], raw["model.layers.0.mlp.experts.3.up_proj.weight_scale_inv"])
        # dense layers through Fp8LinearMethod; the router stays as stored
        assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
        assert engine.runner.model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float8_e4m3fn
        assert layer.mlp.gate.weight.dtype == torch.float32


def test_fp8_checkpoint_decodes_as_transformers_on_its_dequantized_weights(fp8_pair, hf_reference):
    fp8, deq = fp8_pair
    refs = [hf_reference(deq, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    assert sum(len(set(r.tokens)) >= 4 for r in refs) >= 1, "reference output too repetitive to prove anything"
    with make_engine(fp8, max_total_tokens=128) as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [r.tokens for r in refs]
        assert_no_leaks(engine)


def test_compressed_tensors_fp8_block_experts_load_the_same_way(fp8_pair, tmp_path, hf_reference):
    """compressed-tensors FP8_BLOCK names the block scales ``weight_scale``; the same values otherwise."""
    src = fp8_pair[0].parent / "src"
    ct = write_fp8_checkpoint(src, tmp_path / "ct", "ct-block")
    refs = [hf_reference(fp8_pair[1], p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    with make_engine(ct, max_total_tokens=128) as engine:
        assert engine.runner.model.model.layers[0].mlp.experts.w2_weight_scale_inv.shape == (8, 2, 1)
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [r.tokens for r in refs]


def test_fp8_experts_with_per_channel_scales_are_refused_naming_the_layer(fp8_pair, tmp_path):
    ct = write_fp8_checkpoint(fp8_pair[0].parent / "src", tmp_path / "ct", "ct-channel")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: FP8 experts are supported in the block "
                                         "layout .* channel scales"):
        make_engine(ct, max_total_tokens=64)


@pytest.mark.parametrize(("arch", "shape"), [
    ("qwen2-moe", {**FP8_SHAPE, "shared_expert_intermediate_size": 128}),  # a shared expert (Fp8LinearMethod)
    # experts named w1 / w2 / w3 (their intermediate is the config's intermediate_size), sliding window
    ("mixtral", {**{k: v for k, v in FP8_SHAPE.items() if k != "moe_intermediate_size"}, "intermediate_size": 128}),
])
def test_other_moe_architectures_load_fp8_experts_the_same_way(arch, shape, tmp_path, hf_reference):
    src = make_tiny_model(tmp_path / "src", arch, seed=0, **shape)
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", "fp8-block")
    deq = write_dequantized_checkpoint(fp8, tmp_path / "deq")
    refs = [hf_reference(deq, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    with make_engine(fp8, max_total_tokens=128) as engine:
        mlp = engine.runner.model.model.layers[0].mlp
        assert mlp.experts.w13_weight.dtype == torch.float8_e4m3fn
        if arch == "qwen2-moe":
            assert mlp.shared_expert.gate_up_proj.weight.dtype == torch.float8_e4m3fn
            assert mlp.shared_expert_gate.weight.dtype == torch.float32
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [r.tokens for r in refs]


def test_online_fp8_quantizes_the_experts_into_the_same_block_layout(tiny_model_dir, tmp_path, hf_reference):
    src = tiny_model_dir("qwen3-moe")  # experts of I 32: a 128-row block spans gate and up
    sim = write_online_fp8_simulation(src, tmp_path / "sim")
    refs = [hf_reference(sim, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    plain = [hf_reference(src, p, GREEDY["max_new_tokens"]) for p in PROMPTS]
    with make_engine(src, max_total_tokens=128, quantization="fp8") as engine:
        ex = engine.runner.model.model.layers[0].mlp.experts
        assert ex.w13_weight.dtype == torch.float8_e4m3fn and ex.w13_weight_scale_inv.shape == (8, 1, 1)
        assert ex.w2_weight.dtype == torch.float8_e4m3fn and ex.w2_weight_scale_inv.shape == (8, 1, 1)
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [r.tokens for r in refs]
    # FP8 changed the model (the comparison is not bf16 against itself).
    assert any(not torch.allclose(r.logits, p.logits, atol=1e-3) for r, p in zip(refs, plain, strict=True))


def _copy_with(src: pathlib.Path, dst: pathlib.Path, name: str, value) -> pathlib.Path:
    """A copy of checkpoint ``src`` whose tensor ``name`` is ``value(old tensor)``."""
    shutil.copytree(src, dst)
    tensors = load_file(str(dst / "model.safetensors"))
    tensors[name] = value(tensors[name])
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_a_block_size_other_than_128_is_refused_naming_the_layer(fp8_pair, tmp_path):
    path = tmp_path / "b64"
    shutil.copytree(fp8_pair[0], path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["quantization_config"]["weight_block_size"] = [64, 64]
    (path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: FP8 experts need weight_block_size "
                                         r"\[128, 128\], got \[64, 64\]"):
        make_engine(path, max_total_tokens=64)


def test_a_scale_of_the_wrong_shape_is_refused_naming_the_tensor(fp8_pair, tmp_path):
    name = "model.layers.0.mlp.experts.5.down_proj.weight_scale_inv"
    path = _copy_with(fp8_pair[0], tmp_path / "bad-scale", name, lambda t: torch.ones(4, 2))
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' has shape \(4, 2\); 128 x 128 block scales"):
        make_engine(path, max_total_tokens=64)


def test_experts_off_the_128_row_grid_are_refused_naming_the_shard(tmp_path):
    src = make_tiny_model(tmp_path / "src", "qwen3-moe", seed=0, **{**FP8_SHAPE, "moe_intermediate_size": 64})
    fp8 = write_fp8_checkpoint(src, tmp_path / "fp8", "fp8-block")
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.experts: the gate_proj and up_proj shards of each "
                                         r"expert hold 64 rows"):
        make_engine(fp8, max_total_tokens=64)


def test_a_bf16_expert_in_an_fp8_checkpoint_is_refused_naming_the_tensor(fp8_pair, tmp_path):
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    path = _copy_with(fp8_pair[0], tmp_path / "mixed", name, lambda t: t.float())
    with pytest.raises(ValueError, match=rf"checkpoint tensor '{name}' is torch.float32, but the checkpoint declares "
                                         "FP8 experts"):
        make_engine(path, max_total_tokens=64)


def test_fp8_decode_floor_counts_one_byte_per_expert_weight_plus_block_scales():
    from plait.bench.quant import moe_fp8_weight_bytes
    from plait.bench.shapes import moe_counts

    m = moe_counts("qwen3-30b-a3b")
    fewer, more = (moe_fp8_weight_bytes("qwen3-30b-a3b", d) for d in (8.0, 16.0))
    blocks = 12 * 16 + 16 * 6  # w13 [1536, 2048] and w2 [2048, 768] in 128 x 128 blocks
    assert more - fewer == 8 * m["sparse_layers"] * (m["per_expert"] + 4 * blocks)
    assert fewer < 0.6 * 2 * (3.3e9)  # about half the bf16 step (3.3B active parameters)


def test_bench_latency_fp8_floor_counts_fp8_experts_for_moe_shapes_and_fp8_layers_for_dense_ones():
    from plait.bench.cli import fp8_step_weight_bytes
    from plait.bench.quant import fp8_weight_bytes, moe_fp8_weight_bytes
    from plait.bench.shapes import expected_distinct_experts

    assert fp8_step_weight_bytes("qwen3-30b-a3b", 8.0) == moe_fp8_weight_bytes("qwen3-30b-a3b", 8.0)
    # without a count (no eager run): the expectation under uniform routing at one token, top 8
    assert fp8_step_weight_bytes("qwen3-30b-a3b", None) == moe_fp8_weight_bytes(
        "qwen3-30b-a3b", expected_distinct_experts("qwen3-30b-a3b", 1))
    assert fp8_step_weight_bytes("llama-3.1-8b", None) == fp8_weight_bytes("llama-3.1-8b")
