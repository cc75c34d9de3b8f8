"""SiLU-and-mul fused into the small-M GEMV's loads (plait.layers.quantization.gemv.gemv_silu_mul)
against the unfused path (the Triton SiLU-and-mul kernel, then the GEMV), in the Triton interpreter at
tiny shapes: the same arithmetic, so the same bits; and a dense MLP's tokens with it."""

from __future__ import annotations

import pytest
import torch

from plait.layers.quantization.gemv import gemv, gemv_silu_mul
from plait.layers.quantization.gemv_config import GemvConfig
from plait.layers.triton_ops import silu_and_mul
from tests.quant_helpers import random_fp8_weight

N, K = 40, 200  # K not a multiple of BLOCK_K 64, N not of BLOCK_N 16
CONFIG = GemvConfig(block_n=16, block_k=64, split_k=2)


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_silu_mul_gemv_equals_silu_mul_then_gemv(dtype, m):
    gate_up = (2 * _rand(m, 2 * K, seed=1)).to(dtype)
    w, bias = (0.05 * _rand(N, K, seed=2)).to(dtype), _rand(N, seed=3, dtype=dtype)
    out = gemv_silu_mul(gate_up, w, bias=bias, config=CONFIG)
    assert torch.equal(out, gemv(silu_and_mul(gate_up), w, config=CONFIG, bias=bias))


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_silu_mul_gemv_with_fp8_weights_equals_silu_mul_then_gemv(m, w8a8):
    q, s, _ = random_fp8_weight("channel", N, K)
    gate_up = (2 * _rand(m, 2 * K, seed=4)).to(torch.bfloat16)
    out = gemv_silu_mul(gate_up, q, s, config=CONFIG, w8a8=w8a8)
    assert torch.equal(out, gemv(silu_and_mul(gate_up), q, s, config=CONFIG, w8a8=w8a8))


def test_the_fused_result_is_the_torch_silu_product():
    gate_up, w = _rand(2, 2 * K, seed=5), _rand(N, K, seed=6)
    ref = torch.nn.functional.silu(gate_up[:, :K]) * gate_up[:, K:]
    torch.testing.assert_close(gemv_silu_mul(gate_up, w, config=CONFIG), ref @ w.t(), rtol=1e-4, atol=1e-4)


def test_a_gate_up_of_the_wrong_width_fails_naming_it():
    with pytest.raises(ValueError, match=r"gate_up must be \[M, 2K\] = \[M, 400\]"):
        gemv_silu_mul(torch.zeros(1, K), torch.zeros(N, K))


def test_fused_silu_mul_default_configs_compile_for_sm90_without_spills():
    from tests.gemv_aot import compile_defaults_in_subprocess

    for r in compile_defaults_in_subprocess(("bf16", "fp8_channel_mma"), ((2048, 8192),), act=True):
        assert r["stack"] == 0 and r["regs"] <= 128, r
        assert r["pipelined_loads"] > 0 and r["loads_before_wait"] == 0, r
