"""add + RMSNorm fused into the small-M GEMV's prologue (plait.layers.quantization.gemv.gemv_rmsnorm)
against the unfused path (the Triton RMSNorm kernel, then the GEMV), in the Triton interpreter at tiny
shapes: the same arithmetic, so the same bits."""

from __future__ import annotations

import pytest
import torch

from plait.layers.norm import rms_norm_native
from plait.layers.quantization.gemv import gemv, gemv_rmsnorm
from plait.layers.quantization.gemv_config import GemvConfig
from plait.layers.triton_ops import rmsnorm
from tests.quant_helpers import random_fp8_weight

# K 200 is not a multiple of BLOCK_K 64 (nor a power of two: the norm's tile is masked); N 40 not of BLOCK_N 16.
N, K = 40, 200
EPS = 1e-5
CONFIG = GemvConfig(block_n=16, block_k=64, split_k=2)


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _unfused(x, residual, norm_w, w, scale=None, block=None, w8a8=None, bias=None):
    if residual is None:
        normed, new_residual = rmsnorm(x, norm_w, EPS), x
    else:
        normed, new_residual = rmsnorm(x, norm_w, EPS, residual)
    return gemv(normed, w, scale, block, CONFIG, bias=bias, w8a8=w8a8), new_residual, normed


def _check(x, residual, norm_w, w, scale=None, block=None, w8a8=None, bias=None):
    out, res, normed = gemv_rmsnorm(x, norm_w, EPS, w, scale, block, residual=residual, want_normed=True,
                                    bias=bias, config=CONFIG, w8a8=w8a8)
    ref_out, ref_res, ref_normed = _unfused(x, residual, norm_w, w, scale, block, w8a8, bias)
    assert torch.equal(normed, ref_normed)
    assert torch.equal(res, ref_res)
    assert torch.equal(out, ref_out)


@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("m", [1, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_norm_gemv_equals_norm_then_gemv(dtype, m, with_residual):
    x = _rand(m, K, seed=1, dtype=dtype)
    residual = _rand(m, K, seed=2, dtype=dtype) if with_residual else None
    norm_w = (1 + 0.1 * _rand(K, seed=3)).to(dtype)
    w = (_rand(N, K, seed=4) * 0.05).to(dtype)
    _check(x, residual, norm_w, w, bias=_rand(N, seed=5, dtype=dtype))


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("m", [1, 3])
def test_fused_norm_gemv_with_fp8_weights_equals_norm_then_gemv(m, w8a8):
    q, s, _ = random_fp8_weight("channel", N, K)
    x = _rand(m, K, seed=6, dtype=torch.bfloat16)
    residual = _rand(m, K, seed=7, dtype=torch.bfloat16)
    _check(x, residual, (1 + 0.1 * _rand(K, seed=8)).to(torch.bfloat16), q, s, w8a8=w8a8)


def test_fused_norm_gemv_with_fp8_block_weights_equals_norm_then_gemv():
    q, s, block = random_fp8_weight("block", 136, 320)
    x = _rand(1, 320, seed=9, dtype=torch.bfloat16)
    _check(x, _rand(1, 320, seed=10, dtype=torch.bfloat16), (1 + 0.1 * _rand(320, seed=11)).to(torch.bfloat16),
           q, s, block, w8a8=False)


def test_without_residual_the_input_is_the_new_residual_and_normed_rows_only_on_request():
    x = _rand(2, K, seed=12)
    out, res, normed = gemv_rmsnorm(x, torch.ones(K), EPS, _rand(N, K, seed=13), config=CONFIG)
    assert res is x and normed is None and out.shape == (2, N)


def test_bad_norm_operands_fail_naming_the_field():
    x, w = _rand(1, K, seed=14), _rand(N, K, seed=15)
    with pytest.raises(ValueError, match=r"norm weight must have shape \(200,\), got \(100,\)"):
        gemv_rmsnorm(x, torch.ones(100), EPS, w)
    with pytest.raises(ValueError, match=r"residual must be torch.float32 of shape \(1, 200\)"):
        gemv_rmsnorm(x, torch.ones(K), EPS, w, residual=torch.zeros(2, K))


def test_fused_norm_gemv_is_the_torch_norm_and_product():
    x, residual = _rand(3, K, seed=16), _rand(3, K, seed=17)
    norm_w, w = 1 + 0.1 * _rand(K, seed=18), _rand(N, K, seed=19)
    out, res, normed = gemv_rmsnorm(x, norm_w, EPS, w, residual=residual, want_normed=True, config=CONFIG)
    h = x + residual
    ref = rms_norm_native(h, norm_w, EPS)
    torch.testing.assert_close(res, h, rtol=0, atol=0)
    torch.testing.assert_close(normed, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(out, ref @ w.t(), rtol=1e-4, atol=1e-4)


def test_fused_norm_default_configs_compile_for_sm90_without_spills_and_pipeline_their_loads():
    """The prologue's whole-row tile (K up to 8192) fits the registers beside the GEMV's pipeline."""
    from tests.gemv_aot import compile_defaults_in_subprocess

    results = compile_defaults_in_subprocess(("bf16", "fp8_channel", "fp8_block_mma"), ((5120, 2048), (128, 8192)),
                                             norm=True)
    for r in results:
        assert r["stack"] == 0 and r["regs"] <= 128, r
        assert r["pipelined_loads"] > 0, r
        assert r["loads_before_wait"] == 0, r  # the PDL contract: the norm's loads come after the wait too
