"""The router GEMV's top-k epilogue (``route=``) on the GPU at the real router shapes: the same logits as
the plain GEMV and, from them, the top-k kernel's ids and (within a few ulps) weights, eagerly and under CUDA
graph replay with PDL (its grid counter left zero every launch)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.layers.moe.fused_router import Routing, fused_topk  # noqa: E402
from plait.layers.quantization.gemv import RouteOutputs, gemv, gemv_rmsnorm, route_counter  # noqa: E402

# (E, H, routing, bias): qwen3-30b-a3b (softmax, top 8, renormalised), gpt-oss-20b (biased, top 4, softmax after)
ROUTERS = {"qwen3-30b-a3b": (128, 2048, Routing(8, True, True), False),
           "gpt-oss-20b": (32, 2880, Routing(4, False, False), True)}


def _router(name: str, m: int, seed: int):
    e, h, routing, bias = ROUTERS[name]
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, h, device="cuda", generator=g).bfloat16()
    w = (torch.randn(e, h, device="cuda", generator=g) / h**0.5).bfloat16()
    b = torch.randn(e, device="cuda", generator=g).bfloat16() if bias else None
    return x, w, b, routing


def _assert_routes_as_the_top_k_kernel(logits, route):
    # The same experts; the weights within a few fp32 ulps: on the H200 qwen3's softmax-then-renormalise
    # weights came out not bit-equal at 4 and 16 rows (the sums reduce in another order).
    weights, ids = fused_topk(logits, route.routing.top_k, route.routing.softmax_first, route.routing.renormalize)
    assert torch.equal(route.ids, ids)
    torch.testing.assert_close(route.weights, weights, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("m", [1, 4, 16])
@pytest.mark.parametrize("name", sorted(ROUTERS))
def test_router_gemv_routes_as_the_top_k_kernel(name, m):
    x, w, b, routing = _router(name, m, seed=m)
    route = RouteOutputs.empty(m, routing, x.device)
    logits = gemv(x, w, bias=b, route=route)
    assert torch.equal(logits, gemv(x, w, bias=b))
    _assert_routes_as_the_top_k_kernel(logits, route)
    assert int(route_counter(x.device).item()) == 0


def test_norm_router_and_routing_in_one_launch_replay_in_a_cuda_graph():
    x, w, _, routing = _router("qwen3-30b-a3b", 1, seed=3)
    residual, norm_w = torch.randn_like(x), torch.ones(x.shape[1], device="cuda", dtype=torch.bfloat16)
    route = RouteOutputs.empty(1, routing, x.device)
    gemv_rmsnorm(x, norm_w, 1e-6, w, residual=residual, want_normed=True, route=route)  # compile first
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        logits, _, _ = gemv_rmsnorm(x, norm_w, 1e-6, w, residual=residual, want_normed=True, route=route)
    for seed in (4, 5, 6):
        x.copy_(torch.randn(x.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed)))
        graph.replay()
        torch.cuda.synchronize()
        _assert_routes_as_the_top_k_kernel(logits, route)
    assert int(route_counter(x.device).item()) == 0
