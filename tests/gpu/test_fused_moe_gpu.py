"""The fused MoE Triton pipeline on the GPU at the real expert shapes (bf16) against the reference loop
on fp32 copies of the same values, eagerly and under CUDA graph capture and replay."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

fused = pytest.importorskip("plait.layers.moe.fused_moe_triton")

from plait.layers.moe.kernel_config import MoeKernelConfig, get_config  # noqa: E402
from plait.layers.moe.reference import fused_experts_reference  # noqa: E402

# name: (E, top_k, hidden, intermediate, activation, biases)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, "silu", False),
    "gpt-oss-20b": (32, 4, 2880, 2880, "swiglu_oai", True),
}


@pytest.fixture(scope="module", params=sorted(SHAPES))
def experts(request):
    e, k, h, i, act, bias = SHAPES[request.param]
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=g) / h**0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda", generator=g) / i**0.5).bfloat16()
    b13 = (0.5 * torch.randn(e, 2 * i, device="cuda", generator=g)).bfloat16() if bias else None
    b2 = (0.5 * torch.randn(e, h, device="cuda", generator=g)).bfloat16() if bias else None
    return {"top_k": k, "activation": act, "w13": w13, "w2": w2, "b13": b13, "b2": b2}


def routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, num_experts, device="cuda", generator=g)
    weights, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
    return weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def hidden(num_tokens: int, size: int, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed + 1000)
    return (2 * torch.randn(num_tokens, size, device="cuda", generator=g)).bfloat16()


def rel_error(out: torch.Tensor, x, weights, ids, ex) -> float:
    f32 = [t.float() if t is not None else None for t in (ex["b13"], ex["b2"])]
    ref = fused_experts_reference(x.float(), ex["w13"].float(), ex["w2"].float(), weights, ids, ex["activation"], *f32)
    assert torch.isfinite(out).all()
    return float((out.float() - ref).norm() / ref.norm())


@pytest.mark.parametrize("num_tokens", [1, 37, 256, 2048])
@pytest.mark.parametrize("variant", ["tuned", "separate-activation", "fused-activation"])
def test_matches_fp32_reference_in_bf16(experts, num_tokens, variant):
    ex = experts
    e, h = ex["w13"].shape[0], ex["w13"].shape[2]
    weights, ids = routing(num_tokens, e, ex["top_k"], seed=num_tokens)
    x = hidden(num_tokens, h, seed=num_tokens)
    if variant == "tuned":
        cfg = get_config(num_tokens, e, ex["w2"].shape[2], ex["top_k"], torch.cuda.get_device_name())
    else:
        cfg = MoeKernelConfig(block_m=32, block_n=64, block_k=64, group_m=16, num_warps=4, num_stages=4,
                              fuse_activation=variant == "fused-activation")
    out = fused.fused_experts_with_config(x, ex["w13"], ex["w2"], weights, ids, ex["activation"], ex["b13"],
                                          ex["b2"], cfg)
    assert rel_error(out, x, weights, ids, ex) < 1e-2


def test_skewed_routing_and_remote_experts(experts):
    # All tokens on expert 3 for their first slot; the rest -1 or E (experts another rank holds).
    ex = experts
    e, h, k = ex["w13"].shape[0], ex["w13"].shape[2], ex["top_k"]
    num_tokens = 300
    weights, ids = routing(num_tokens, e, k, seed=5)
    ids[:, 0] = 3
    ids[::2, 1:] = -1
    ids[1::2, 1:] = e
    x = hidden(num_tokens, h, seed=5)
    out = fused.fused_experts_triton(x, ex["w13"], ex["w2"], weights, ids, ex["activation"], ex["b13"], ex["b2"])
    assert rel_error(out, x, weights, ids, ex) < 1e-2


@pytest.mark.parametrize("num_tokens", [1, 64])
def test_graph_replay_equals_eager_on_new_routings(experts, num_tokens):
    ex = experts
    e, h, k = ex["w13"].shape[0], ex["w13"].shape[2], ex["top_k"]
    weights, ids = routing(num_tokens, e, k, seed=1)
    x = hidden(num_tokens, h, seed=1)

    def step():
        return fused.fused_experts_triton(x, ex["w13"], ex["w2"], weights, ids, ex["activation"], ex["b13"], ex["b2"])

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    for seed in (2, 3, 4):  # new inputs into the captured buffers, including a skewed routing
        new_w, new_ids = routing(num_tokens, e, k, seed=seed)
        if seed == 4:
            new_ids[:] = torch.arange(k, device="cuda", dtype=torch.int32)
        weights.copy_(new_w)
        ids.copy_(new_ids)
        x.copy_(hidden(num_tokens, h, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, step())
        assert rel_error(out, x, weights, ids, ex) < 1e-2
