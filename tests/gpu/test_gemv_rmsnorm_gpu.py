"""add + RMSNorm inside the small-M GEMV's prologue (gemv_rmsnorm) and SiLU-and-mul inside its loads
(gemv_silu_mul) on the GPU at the real decode shapes, against the unfused paths (the RMSNorm or
SiLU-and-mul kernel, then the GEMV), eagerly and under CUDA graph replay with PDL, and a tiny model's
tokens with PLAIT_FUSED_NORM_GEMV / PLAIT_FUSED_ACT_GEMV on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.layers.quantization.fp8_kernels import quantize_weight_per_channel  # noqa: E402
from plait.layers.quantization.gemv import gemv, gemv_rmsnorm, gemv_silu_mul  # noqa: E402
from plait.layers.triton_ops import rmsnorm, silu_and_mul  # noqa: E402

EPS = 1e-6
# (N, K): qwen3-30b-a3b's qkv and router, llama-3.2-1b's qkv and gate_up, gpt-oss-20b's router (K 2880:
# not a power of two), llama-3.1-8b's qkv (K 4096) and a K past the prologue's one-tile width.
SHAPES = [(5120, 2048), (128, 2048), (3072, 2048), (16384, 2048), (32, 2880), (6144, 4096), (1024, 8192)]


def _operands(m: int, n: int, k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    residual = (4 * torch.randn(m, k, device="cuda", generator=g)).bfloat16()
    norm_w = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    return x, residual, norm_w, w


def _assert_matches_unfused(got, ref):
    out, res, normed = got
    ref_out, ref_res, ref_normed = ref
    assert torch.equal(res, ref_res)  # the sum rounds once, as the norm kernel's
    # The sum of squares may reduce in another order than the norm kernel's (its warps): a rounding
    # apart at most, in the scale and so in each normed value.
    torch.testing.assert_close(normed, ref_normed, rtol=8e-3, atol=1e-3)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("n", "k"), SHAPES)
def test_fused_norm_gemv_matches_norm_then_gemv_in_bf16(n, k, m):
    x, residual, norm_w, w = _operands(m, n, k, seed=n + k + m)
    normed, res = rmsnorm(x, norm_w, EPS, residual)
    got = gemv_rmsnorm(x, norm_w, EPS, w, residual=residual, want_normed=True)
    _assert_matches_unfused(got, (gemv(normed, w), res, normed))


@pytest.mark.parametrize("w8a8", [False, True])
@pytest.mark.parametrize("m", [1, 8])
def test_fused_norm_gemv_matches_norm_then_gemv_with_fp8_weights(m, w8a8):
    x, residual, norm_w, w = _operands(m, 5120, 2048, seed=m)
    q, s = quantize_weight_per_channel(w)
    normed, res = rmsnorm(x, norm_w, EPS, residual)
    got = gemv_rmsnorm(x, norm_w, EPS, q, s, residual=residual, want_normed=True, w8a8=w8a8)
    _assert_matches_unfused(got, (gemv(normed, q, s, w8a8=w8a8), res, normed))


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize(("n", "k"), [(2048, 8192), (4096, 14336)])  # llama-3.2-1b's and 3.1-8b's down
def test_fused_silu_mul_gemv_equals_silu_mul_then_gemv(n, k, m):
    # Elementwise with the SiLU-and-mul kernel's cast points: the GEMV multiplies the same activations.
    g = torch.Generator(device="cuda").manual_seed(n + m)
    gate_up = (2 * torch.randn(m, 2 * k, device="cuda", generator=g)).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / k**0.5).bfloat16()
    assert torch.equal(gemv_silu_mul(gate_up, w), gemv(silu_and_mul(gate_up), w))
    q, s = quantize_weight_per_channel(w)
    for w8a8 in (False, True):
        assert torch.equal(gemv_silu_mul(gate_up, q, s, w8a8=w8a8), gemv(silu_and_mul(gate_up), q, s, w8a8=w8a8))


def test_fused_norm_gemv_replays_in_a_cuda_graph():
    x, residual, norm_w, w = _operands(1, 5120, 2048, seed=5)
    static_x, static_r = x.clone(), residual.clone()
    gemv_rmsnorm(static_x, norm_w, EPS, w, residual=static_r, want_normed=True)  # compile before capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, res, normed = gemv_rmsnorm(static_x, norm_w, EPS, w, residual=static_r, want_normed=True)
    for seed in (6, 7):
        nx, nr, _, _ = _operands(1, 5120, 2048, seed=seed)
        static_x.copy_(nx)
        static_r.copy_(nr)
        graph.replay()
        ref_normed, ref_res = rmsnorm(nx, norm_w, EPS, nr)
        _assert_matches_unfused((out, res, normed), (gemv(ref_normed, w), ref_res, ref_normed))


@pytest.mark.parametrize("arch", ["llama", "qwen3-moe"])
def test_decoder_layers_give_the_same_tokens_with_the_fusions_on_and_off(arch, tmp_path, monkeypatch):
    """A tiny model's greedy tokens in bf16 on the GPU, every layer's norms and activations fused and not."""
    from plait.testing import make_tiny_model
    from tests.helpers import make_engine

    path = make_tiny_model(tmp_path, arch, seed=0)
    outs = {}
    for on in ("0", "1"):
        monkeypatch.setenv("PLAIT_FUSED_NORM_GEMV", on)
        monkeypatch.setenv("PLAIT_FUSED_ACT_GEMV", on)
        with make_engine(path, device="cuda", dtype="bfloat16", max_total_tokens=512) as engine:
            outs[on] = [o.token_ids for o in engine.generate([[1, 5, 9, 13], [2, 7]],
                                                             {"temperature": 0.0, "max_new_tokens": 8})]
    assert outs["0"] == outs["1"]
