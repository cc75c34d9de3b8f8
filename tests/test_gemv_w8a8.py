"""The small-M GEMV's W8A8 form (FP8 weights; activations quantized to e4m3 per token and 128-column
group inside the kernel, e4m3 x e4m3 dots) and the bias epilogue of every form, in the Triton
interpreter at tiny shapes; and the W8A8 default configs compiled for an H200 (sm_90)."""

from __future__ import annotations

import json

import pytest
import torch

from plait.layers.quantization import gemv as gemv_module
from plait.layers.quantization.fp8_kernels import (
    dequantize_weight,
    reference_w8a8_gemv,
)
from plait.layers.quantization.gemv import gemv, plan_launch
from plait.layers.quantization.gemv_config import GemvConfig
from tests.quant_helpers import qdq_groups, random_fp8_weight

# K 200 ends inside its second 128-column group; N 40 is not a multiple of BLOCK_N 16 (num_warps 1
# allows 16 weight rows per program). Block weights: N 136, K 320 end inside a 128 x 128 scale block.
SHAPES = {"channel": (40, 200), "block": (136, 320)}
# e4m3 keeps 3 mantissa bits: rounding to nearest moves a normal value by at most 2^-4 of itself.
E4M3_REL = 2.0**-4


def _rand(*shape: int, seed: int) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _fp8(layout: str):
    return random_fp8_weight(layout, *SHAPES[layout])


def _cfg(split_k: int) -> GemvConfig:
    return GemvConfig(block_n=16, block_k=128, split_k=split_k, num_warps=1, num_stages=2)


@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("layout", ["channel", "block"])
def test_w8a8_gemv_equals_the_activation_quantizing_reference(layout, m, split_k):
    q, s, block = _fp8(layout)
    x = _rand(m, q.shape[1], seed=m)
    out = gemv(x, q, s, block, _cfg(split_k), w8a8=True)
    # The tests' own simulation (torch's e4m3 conversion per row and 128 columns, the last group short):
    # the same codes and scales, only the fp32 summation order differs.
    torch.testing.assert_close(out, qdq_groups(x) @ dequantize_weight(q, s, block).t(), rtol=1e-5, atol=1e-5)


def test_the_w8a8_reference_equals_the_tests_simulation():
    q, s, block = _fp8("block")
    x = _rand(3, q.shape[1], seed=3)
    torch.testing.assert_close(reference_w8a8_gemv(x, q, s, block), qdq_groups(x) @ dequantize_weight(q, s, block).t(),
                               rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["channel", "block"])
def test_w8a8_gemv_is_within_e4m3_rounding_of_the_weight_only_product(layout):
    q, s, block = _fp8(layout)
    x = _rand(3, q.shape[1], seed=9)
    wd = dequantize_weight(q, s, block)
    exact = x @ wd.t()
    # Each activation moves by at most 2^-4 of itself (normal e4m3 codes; a subnormal code's absolute
    # step is far below the atol here), so each output by at most 2^-4 of sum |x| |w|.
    bound = E4M3_REL * (x.abs() @ wd.abs().t()) + 1e-5
    err = (gemv(x, q, s, block, _cfg(2), w8a8=True) - exact).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    assert float(err.max()) > 0  # the activations were quantized: not the weight-only product


def test_an_all_zero_activation_row_gives_zeros_not_nan():
    q, s, _ = _fp8("channel")
    x = _rand(3, q.shape[1], seed=4)
    x[1] = 0
    out = gemv(x, q, s, None, _cfg(1), w8a8=True)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert bool(out.isfinite().all()) and float(out[0].abs().max()) > 0


def test_the_tuned_entry_chooses_the_form_unless_the_switch_does(monkeypatch):
    q, s, _ = _fp8("channel")
    x = _rand(2, q.shape[1], seed=5)
    w8a8_ref, weight_only_ref = reference_w8a8_gemv(x, q, s, None), x @ dequantize_weight(q, s, None).t()
    plain = GemvConfig(block_n=16, block_k=64, num_warps=1)  # block_k 64: the W8A8 form steps 128 anyway
    preferring = GemvConfig(block_n=16, block_k=64, num_warps=1, prefer_w8a8=True)
    monkeypatch.delenv("PLAIT_FP8_GEMV_W8A8", raising=False)
    torch.testing.assert_close(gemv(x, q, s, None, plain), weight_only_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gemv(x, q, s, None, preferring), w8a8_ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("PLAIT_FP8_GEMV_W8A8", "1")
    torch.testing.assert_close(gemv(x, q, s, None, plain), w8a8_ref, rtol=1e-5, atol=1e-5)
    monkeypatch.setenv("PLAIT_FP8_GEMV_W8A8", "0")
    torch.testing.assert_close(gemv(x, q, s, None, preferring), weight_only_ref, rtol=1e-5, atol=1e-5)


def test_a_table_entry_preferring_w8a8_launches_the_w8a8_tables_config(tmp_path, monkeypatch):
    from plait.layers.quantization import gemv_config

    q, s, _ = _fp8("channel")
    n, k = q.shape
    mma = GemvConfig(block_n=16, block_k=128, split_k=2, num_warps=1, num_stages=2)
    table = {"fp8_channel": {f"N{n}_K{k}": {"1": {**GemvConfig(8, 64).to_json(), "prefer_w8a8": 1},
                                               "16": GemvConfig(8, 64).to_json()}},
             "fp8_channel_mma": {f"N{n}_K{k}": {"16": mma.to_json()}}}
    (tmp_path / gemv_config.config_file_name("cpu")).write_text(json.dumps(table))
    monkeypatch.setenv("PLAIT_GEMV_CONFIG_DIR", str(tmp_path))
    monkeypatch.delenv("PLAIT_FP8_GEMV_W8A8", raising=False)
    gemv_config.clear_cache()
    try:
        assert gemv_config.get_config("fp8_channel", 1, n, k, "cpu", 8).prefer_w8a8
        launched: list[GemvConfig] = []
        real_plan = gemv_module.plan_launch
        monkeypatch.setattr(gemv_module, "plan_launch", lambda *a: launched.append(a[4]) or real_plan(*a))
        one, two = _rand(1, k, seed=6), _rand(2, k, seed=7)
        torch.testing.assert_close(gemv(one, q, s), reference_w8a8_gemv(one, q, s, None), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(gemv(two, q, s), two @ dequantize_weight(q, s, None).t(), rtol=1e-5, atol=1e-5)
        assert launched == [mma, GemvConfig(8, 64)]  # M 1: the W8A8 entry; M 2 (bucket 16): weight-only
    finally:
        gemv_config.clear_cache()


def test_w8a8_plans_one_group_per_step_and_a_warpgroup_of_weight_rows():
    plan = plan_launch(1, 4096, 4096, None, GemvConfig(block_n=16, block_k=512, num_warps=4), True)
    assert (plan.block_m, plan.block_n, plan.block_k) == (16, 64, 128)
    # Block scales 64 columns wide cannot hold a 128-column group: those weights stay weight-only.
    q, s, _ = _fp8("channel")
    x = _rand(1, q.shape[1], seed=6)
    narrow = torch.rand(-(-q.shape[0] // 8), -(-q.shape[1] // 64), generator=torch.Generator().manual_seed(0)) + 0.5
    out = gemv(x, q, narrow, (8, 64), GemvConfig(block_n=16, block_k=64), w8a8=True)
    torch.testing.assert_close(out, x @ dequantize_weight(q, narrow, (8, 64)).t(), rtol=1e-5, atol=1e-5)


def test_w8a8_needs_fp8_weights():
    with pytest.raises(ValueError, match="w8a8 is for fp8 weights, not torch.bfloat16"):
        gemv(torch.zeros(1, 64), torch.zeros(16, 64, dtype=torch.bfloat16), w8a8=True)


# --- the bias epilogue ----------------------------------------------------------------------------
@pytest.mark.parametrize("split_k", [1, 2])
@pytest.mark.parametrize("weights", ["bf16", "fp8_weight_only", "fp8_w8a8"])
def test_bias_in_the_epilogue_equals_adding_it_after(weights, split_k):
    n, k = SHAPES["channel"]
    if weights == "bf16":
        w, s, cfg, w8a8 = (_rand(n, k, seed=7) * 0.05).to(torch.bfloat16), None, GemvConfig(16, 64, split_k), None
    else:
        (w, s, _), w8a8 = _fp8("channel"), weights == "fp8_w8a8"
        cfg = _cfg(split_k) if w8a8 else GemvConfig(16, 64, split_k)
    bias = _rand(n, seed=8)
    for m in (1, 3):
        x = _rand(m, k, seed=10 + m)
        out = gemv(x, w, s, None, cfg, bias=bias, w8a8=w8a8)
        torch.testing.assert_close(out, gemv(x, w, s, None, cfg, w8a8=w8a8) + bias, rtol=1e-6, atol=1e-6)


def test_bf16_bias_and_activations_give_the_biased_product_within_bf16_rounding():
    n, k = SHAPES["channel"]
    w = (_rand(n, k, seed=7) * 0.05).to(torch.bfloat16)
    x, bias = _rand(2, k, seed=12).to(torch.bfloat16), _rand(n, seed=13).to(torch.bfloat16)
    out = gemv(x, w, bias=bias, config=GemvConfig(16, 64, 2))
    assert out.dtype == torch.bfloat16
    exact = x.float() @ w.float().t() + bias.float()
    # One bf16 rounding of the whole sum: within one unit in the last place (the interpreter narrows to
    # bf16 by truncation; the GPU rounds to nearest, half that).
    torch.testing.assert_close(out.float(), exact, rtol=2**-7, atol=1e-3)


def test_a_bias_of_the_wrong_length_is_refused():
    q, s, _ = _fp8("channel")
    with pytest.raises(ValueError, match=r"bias must have shape \(40,\), got \(39,\)"):
        gemv(torch.zeros(1, q.shape[1]), q, s, bias=torch.zeros(39))


# --- the GPU build, without a GPU ----------------------------------------------------------------
def test_w8a8_default_configs_compile_to_fp8_warpgroup_mmas_reading_unconverted_weights():
    """The interpreter upcasts the dot; this compiles the kernel for an H200 with the wheel's ptxas."""
    from tests.gemv_aot import compile_defaults_in_subprocess

    results = compile_defaults_in_subprocess(("fp8_channel_mma", "fp8_block_mma"), ((6144, 4096), (4096, 14336)))
    for r in results:
        assert r["stack"] == 0 and r["regs"] <= 128, r  # no spills
        assert r["wgmma_e4m3"] > 0, r  # e4m3 x e4m3 warpgroup MMAs ...
        assert r["e4m3_widened"] == 0, r  # ... with no e4m3 value converted in registers
        assert r["pipelined_loads"] > 0, r  # the weight tiles reach shared memory by async copies
