"""The router GEMV's top-k epilogue (plait.layers.quantization.gemv, ``route=``): the last program to
finish routes every row from the logits it stored, the same weights and ids as the top-k kernel reading
those logits (bit for bit, in the Triton interpreter at tiny shapes)."""

from __future__ import annotations

import pytest
import torch

from plait.layers.moe.fused_router import Routing, fused_topk
from plait.layers.quantization.gemv import RouteOutputs, gemv, gemv_rmsnorm, route_counter
from plait.layers.quantization.gemv_config import GemvConfig

E, K = 40, 200  # 40 experts: not a power of two, nor a multiple of BLOCK_N 16


def _rand(*shape: int, seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


@pytest.mark.parametrize(("softmax_first", "renormalize"), [(True, True), (True, False), (False, False)])
@pytest.mark.parametrize(("m", "split_k"), [(1, 1), (3, 2)])
def test_router_gemv_routes_each_row_as_the_top_k_kernel_does(m, split_k, softmax_first, renormalize):
    x, w, bias = _rand(m, K, seed=1), _rand(E, K, seed=2), _rand(E, seed=3)
    routing = Routing(6, softmax_first, renormalize)
    route = RouteOutputs.empty(m, routing, x.device)
    config = GemvConfig(block_n=16, block_k=64, split_k=split_k)
    logits = gemv(x, w, config=config, bias=bias, route=route)
    assert torch.equal(logits, gemv(x, w, config=config, bias=bias))
    weights, ids = fused_topk(logits, routing.top_k, softmax_first, renormalize)
    assert torch.equal(route.ids, ids) and torch.equal(route.weights, weights)
    assert int(route_counter(x.device).item()) == 0  # left zero for the next launch


def test_the_norm_prologue_and_the_route_epilogue_run_in_one_launch():
    x, residual = _rand(2, K, seed=4, dtype=torch.bfloat16), _rand(2, K, seed=5, dtype=torch.bfloat16)
    norm_w, w = (1 + 0.1 * _rand(K, seed=6)).to(torch.bfloat16), (0.1 * _rand(E, K, seed=7)).to(torch.bfloat16)
    route = RouteOutputs.empty(2, Routing(4, True, True), x.device)
    logits, _, normed = gemv_rmsnorm(x, norm_w, 1e-6, w, residual=residual, want_normed=True, route=route)
    assert normed is not None and logits.dtype == torch.bfloat16
    weights, ids = fused_topk(logits, 4, True, True)
    assert torch.equal(route.ids, ids) and torch.equal(route.weights, weights)


def test_bad_routing_outputs_fail_naming_the_limit():
    x, w = _rand(2, K, seed=8), _rand(E, K, seed=9)
    with pytest.raises(ValueError, match=r"1 <= top_k <= N <= 1024"):
        gemv(x, w, route=RouteOutputs.empty(2, Routing(41, True, False), x.device))
    bad = RouteOutputs(Routing(4, True, False), torch.empty(1, 4), torch.empty(1, 4, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"float32 and int32 of shape \(2, 4\)"):
        gemv(x, w, route=bad)


def test_the_router_gemv_with_both_fusions_compiles_for_sm90_without_spills():
    """qwen3-30b-a3b's router (128 x 2048) and gpt-oss-20b's (32 x 2880), norm prologue and route epilogue."""
    from tests.gemv_aot import compile_defaults_in_subprocess

    for r in compile_defaults_in_subprocess(("bf16",), ((128, 2048), (32, 2880)), norm=True, route=True):
        assert r["stack"] == 0 and r["regs"] <= 128, r
        assert r["loads_before_wait"] == 0, r
