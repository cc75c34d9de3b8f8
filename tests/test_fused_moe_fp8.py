"""Block-FP8 experts: the fused MoE kernels (Triton interpreter on the CPU, the smallest shapes that
cover a 128 x 128 block) against the reference loop on the dequantized weights."""

from __future__ import annotations

import pytest
import torch

fused = pytest.importorskip("plait.layers.moe.fused_moe_triton")

from plait.layers.moe import kernel_config, small_batch  # noqa: E402
from plait.layers.moe.fp8 import quantize_blocks, quantize_expert_blocks  # noqa: E402
from plait.layers.moe.kernel_config import MoeKernelConfig  # noqa: E402
from plait.layers.moe.reference import fused_experts_reference  # noqa: E402
from plait.layers.moe.small_batch import SmallBatchConfig  # noqa: E402
from tests.quant_helpers import block_dequantize, block_quantize  # noqa: E402

E, H, INTER, K = 4, 256, 128, 2
ALIGNED = MoeKernelConfig(block_m=16, block_n=64, block_k=64, group_m=1)
ALIGNED_FUSED = MoeKernelConfig(block_m=16, block_n=64, block_k=128, group_m=1, fuse_activation=True)
SMALL = SmallBatchConfig(block_n=32, block_h=64, block_k=64)


def fp8_experts(inter: int = INTER, seed: int = 0):
    """Random experts in the published block layout: FP8 w13 [E, 2I, H], w2 [E, H, I] and their scales."""
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * inter, H, generator=g) / H**0.5
    w2 = torch.randn(E, H, inter, generator=g) / inter**0.5
    return (*quantize_expert_blocks(w13), *quantize_expert_blocks(w2))


def skewed_routing(num_tokens: int, seed: int = 1):
    """Most tokens on expert 0, none on expert 3 (an expert that receives no token)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(num_tokens, K, dtype=torch.int32)
    ids[:, 1] = torch.randint(1, 3, (num_tokens,), generator=g, dtype=torch.int32)
    ids[::3, 0] = 2
    ids[::3, 1] = 1
    weights = torch.rand(num_tokens, K, generator=g)
    return weights / weights.sum(-1, keepdim=True), ids


def test_expert_quantizer_is_the_published_block_layout():
    w = torch.randn(3, 256, 200, generator=torch.Generator().manual_seed(4))
    q, s = quantize_expert_blocks(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (3, 2, 2)
    q_ref, s_ref = block_quantize(w[1])  # tests/quant_helpers: written apart from plait's quantizer
    torch.testing.assert_close(s[1], s_ref)
    assert torch.equal(q[1].float(), q_ref.float())
    torch.testing.assert_close(block_dequantize(*quantize_blocks(w[2])), block_dequantize(q[2], s[2]))


@pytest.mark.parametrize("config", [ALIGNED, ALIGNED_FUSED], ids=["separate-activation", "fused-activation"])
def test_aligned_w8a8_pipeline_matches_the_dequantized_reference_with_quantized_activations(config):
    q13, s13, q2, s2 = fp8_experts()
    weights, ids = skewed_routing(6)
    x = torch.randn(6, H, generator=torch.Generator().manual_seed(2))
    out = fused.fused_experts_with_config(x, q13, q2, weights, ids, "silu", None, None, config, s13, s2)
    ref = fused_experts_reference(x, q13, q2, weights, ids, "silu", w13_scale=s13, w2_scale=s2,
                                  quantize_activations=True)
    torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
    # ... and the activation quantization is the only difference from the weight-only reference.
    exact = fused_experts_reference(x, q13, q2, weights, ids, "silu", w13_scale=s13, w2_scale=s2)
    rel = float((out - exact).abs().max() / exact.abs().max())
    assert 1e-4 < rel < 0.05


def test_small_batch_path_is_weight_only_and_matches_the_dequantized_reference():
    q13, s13, q2, s2 = fp8_experts()
    weights, ids = skewed_routing(2, seed=3)
    ids[1, 1] = -1  # an expert another rank holds: skipped
    x = torch.randn(2, H, generator=torch.Generator().manual_seed(5))
    out = small_batch.fused_experts_small_batch(x, q13, q2, weights, ids, "silu", None, None, SMALL, s13, s2)
    ref = fused_experts_reference(x, q13, q2, weights, ids, "silu", w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)


def test_dispatcher_runs_fp8_experts_on_both_paths():
    q13, s13, q2, s2 = fp8_experts()
    weights, ids = skewed_routing(1, seed=6)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(7))
    scales = {"w13_scale": s13, "w2_scale": s2}
    small = fused.fused_experts_triton(x, q13, q2, weights, ids, small_batch=True, **scales)
    aligned = fused.fused_experts_triton(x, q13, q2, weights, ids, small_batch=False, **scales)
    torch.testing.assert_close(small, fused_experts_reference(x, q13, q2, weights, ids, **scales),
                               atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(aligned, fused_experts_reference(x, q13, q2, weights, ids, quantize_activations=True,
                                                                **scales), atol=2e-4, rtol=2e-4)


def test_fp8_tables_are_their_own_files_and_defaults_are_valid_for_fp8():
    assert kernel_config.config_file_name(128, 768, "NVIDIA H200", kernel_config.FP8_DTYPE_KEY) == \
        "E128_N768_NVIDIA_H200_dtype=fp8_w8a8.json"
    assert small_batch.small_config_file_name(128, 768, "NVIDIA H200", "fp8_w8a8") == \
        "small_E128_N768_NVIDIA_H200_dtype=fp8_w8a8.json"
    for tokens in (1, 64, 4096):
        assert fused.fp8_block_k_ok(kernel_config.default_config(tokens, 128, 8).block_k)
    assert 128 % small_batch.small_batch_config(1, 8, 2048, 768).block_k == 0


def test_fp8_launch_refuses_a_k_tile_across_scale_groups():
    q13, s13, q2, s2 = fp8_experts()
    weights, ids = skewed_routing(2)
    wide = MoeKernelConfig(block_m=16, block_n=64, block_k=256)
    with pytest.raises(ValueError, match="block_k of 32, 64 or 128"):
        fused.fused_experts_with_config(torch.randn(2, H), q13, q2, weights, ids, "silu", None, None, wide, s13, s2)


@pytest.mark.parametrize(("field", "change", "match"), [
    ("w13_scale", lambda a: {**a, "w13_scale": a["w13_scale"][:, :1]}, r"w13_scale must be float32 \(4, 2, 2\)"),
    ("w2_scale", lambda a: {**a, "w2_scale": None}, "need float8_e4m3fn w13 and w2 with both scales"),
    ("w13", lambda a: {**a, "w13": a["w13"].float()}, "need float8_e4m3fn w13 and w2"),
])
def test_bad_fp8_arguments_are_refused_naming_the_field(field, change, match):
    q13, s13, q2, s2 = fp8_experts()
    weights, ids = skewed_routing(2)
    args = change({"w13": q13, "w2": q2, "w13_scale": s13, "w2_scale": s2})
    with pytest.raises(ValueError, match=match):
        fused.fused_experts_triton(torch.randn(2, H), args["w13"], args["w2"], weights, ids,
                                   w13_scale=args["w13_scale"], w2_scale=args["w2_scale"])


def test_fp8_experts_read_the_fp8_tables_and_bf16_experts_do_not(tmp_path, monkeypatch):
    import json

    fp8_cfg = MoeKernelConfig(block_m=16, block_n=32, block_k=32, group_m=1, num_warps=2)
    key = kernel_config.FP8_DTYPE_KEY
    (tmp_path / kernel_config.config_file_name(E, INTER, "cpu", key)).write_text(json.dumps({"1": fp8_cfg.to_json()}))
    tiles = SmallBatchConfig(block_n=16, block_h=32, block_k=32)
    small_table = {str(m): {"path": path, "config": tiles.to_json()} for m, path in ((1, "aligned"), (2, "small"))}
    (tmp_path / small_batch.small_config_file_name(E, INTER, "cpu", key)).write_text(json.dumps(small_table))
    monkeypatch.setenv("PLAIT_MOE_CONFIG_DIR", str(tmp_path))
    assert kernel_config.get_config(1, E, INTER, K, "cpu", key) == fp8_cfg
    assert kernel_config.get_config(1, E, INTER, K, "cpu") == kernel_config.default_config(1, E, K)
    assert small_batch.small_batch_plan(1, E, K, H, INTER, "cpu", key) is None  # the table says aligned at 1
    assert small_batch.small_batch_plan(2, E, K, H, INTER, "cpu", key) == tiles
    # ... and the dispatcher runs FP8 experts with them: at one token the aligned pipeline at fp8_cfg.
    q13, s13, q2, s2 = fp8_experts()
    weights, ids = skewed_routing(1)
    x = torch.randn(1, H, generator=torch.Generator().manual_seed(8))
    out = fused.fused_experts_triton(x, q13, q2, weights, ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out, fused.fused_experts_with_config(x, q13, q2, weights, ids, "silu", None, None,
                                                                    fp8_cfg, s13, s2), atol=0, rtol=0)
