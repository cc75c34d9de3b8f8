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


def profiled_kernels(module: torch.nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, list[str]]:
    """``module(x)`` and the names of the CUDA kernels it launched, from a second call under inference
    mode: the first compiles the Triton kernels outside the profiled call."""
    with torch.inference_mode():
        module(x)
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            out = module(x)
            torch.cuda.synchronize()
    return out, [ev.name for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]


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


@pytest.mark.parametrize("num_tokens", range(1, 9))
@pytest.mark.parametrize("path", ["small-batch", "aligned", "dispatched"])
def test_decode_sizes_match_fp32_reference_on_either_path(experts, num_tokens, path):
    ex = experts
    e, h, k = ex["w13"].shape[0], ex["w13"].shape[2], ex["top_k"]
    weights, ids = routing(num_tokens, e, k, seed=10 + num_tokens)
    x = hidden(num_tokens, h, seed=10 + num_tokens)
    forced = {"small-batch": True, "aligned": False, "dispatched": None}[path]
    out = fused.fused_experts_triton(x, ex["w13"], ex["w2"], weights, ids, ex["activation"], ex["b13"], ex["b2"],
                                     small_batch=forced)
    assert rel_error(out, x, weights, ids, ex) < 1e-2


def test_small_batch_path_skips_remote_experts_and_repeated_experts(experts):
    ex = experts
    e, h, k = ex["w13"].shape[0], ex["w13"].shape[2], ex["top_k"]
    weights, ids = routing(2, e, k, seed=6)
    ids[0, :] = 3  # every slot of token 0 on one expert
    ids[1, 0], ids[1, 1] = -1, e  # two slots of token 1 held by other ranks
    x = hidden(2, h, seed=6)
    out = fused.fused_experts_triton(x, ex["w13"], ex["w2"], weights, ids, ex["activation"], ex["b13"], ex["b2"],
                                     small_batch=True)
    assert rel_error(out, x, weights, ids, ex) < 1e-2


@pytest.mark.parametrize("num_tokens", [1, 4])
def test_small_batch_router_and_experts_replay_in_a_graph(experts, num_tokens):
    # The whole small-batch MoE step as a decode graph holds it: fused top-k from router logits,
    # then the two expert launches; replays on new logits and hidden states equal eager runs.
    from plait.layers.moe.fused_router import fused_topk

    ex = experts
    e, h, k = ex["w13"].shape[0], ex["w13"].shape[2], ex["top_k"]
    softmax_first = ex["activation"] == "silu"  # qwen3: softmax then top-k, renormalised; gpt-oss the reverse
    logits = torch.randn(num_tokens, e, device="cuda").bfloat16()
    x = hidden(num_tokens, h, seed=20)

    def step():
        weights, ids = fused_topk(logits, k, softmax_first, renormalize=softmax_first)
        return fused.fused_experts_triton(x, ex["w13"], ex["w2"], weights, ids, ex["activation"], ex["b13"],
                                          ex["b2"], small_batch=True), weights, ids

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out, weights, ids = step()
    for seed in (21, 22):
        logits.copy_(torch.randn(num_tokens, e, device="cuda", generator=torch.Generator("cuda").manual_seed(seed)))
        x.copy_(hidden(num_tokens, h, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        eager_out, eager_w, eager_ids = step()
        assert torch.equal(ids, eager_ids) and torch.equal(weights, eager_w) and torch.equal(out, eager_out)
        assert rel_error(out, x, weights, ids, ex) < 1e-2


@pytest.mark.parametrize(("num_experts", "top_k", "scoring", "renormalize"),
                         [(128, 8, "softmax_topk", True), (32, 4, "topk_softmax", False),
                          (60, 4, "softmax_topk", False)])
def test_one_launch_router_matches_torch_on_gpu(num_experts, top_k, scoring, renormalize):
    from plait.layers.moe.fused_router import fused_topk
    from plait.layers.moe.router import RouterConfig, select_experts

    logits = torch.randn(64, num_experts, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    weights, ids = fused_topk(logits, top_k, scoring == "softmax_topk", renormalize)
    ref_w, ref_ids = select_experts(logits, RouterConfig(num_experts, top_k, scoring, renormalize), fused=False)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, atol=1e-6, rtol=1e-5)


def test_moe_layer_at_one_token_runs_the_router_gemv_and_the_dispatched_expert_kernels(experts):
    # Router: one GEMV launch (its bias in the epilogue), the fused top-k, then the path small_batch_plan
    # picks for this shape: gate/up + activation and down + sum (small), or align scan + scatter, the two
    # grouped GEMMs and the top-k sum (aligned).
    from plait.layers.moe.layer import FusedMoE, SparseMoeBlock
    from plait.layers.moe.router import RouterConfig
    from plait.layers.moe.small_batch import small_batch_plan

    ex = experts
    e, h, k, i = ex["w13"].shape[0], ex["w13"].shape[2], ex["top_k"], ex["w2"].shape[2]
    bias = ex["b13"] is not None
    moe = FusedMoE(e, h, i, activation=ex["activation"], bias=bias, dtype=torch.bfloat16).cuda()
    moe.w13_weight.data.copy_(ex["w13"])
    moe.w2_weight.data.copy_(ex["w2"])
    if bias:
        moe.w13_bias.data.copy_(ex["b13"])
        moe.w2_bias.data.copy_(ex["b2"])
    scoring = "topk_softmax" if bias else "softmax_topk"
    block = SparseMoeBlock(RouterConfig(e, k, scoring, renormalize=not bias), moe, h, router_bias=bias).cuda()
    block.gate.weight.data.normal_().mul_(h**-0.5)
    if bias:
        block.gate.bias.data.normal_()
    block = block.bfloat16()
    x = hidden(1, h, seed=30)
    out, names = profiled_kernels(block, x)
    small = small_batch_plan(1, e, k, h, i, torch.cuda.get_device_name()) is not None
    expected = ({"_small_gate_up_kernel": 1, "_small_down_sum_kernel": 1} if small else
                {"_align_scan_kernel": 1, "_align_scatter_kernel": 1, "fused_moe_kernel": 2, "_moe_sum_kernel": 1})
    expected.update({"_gemv_kernel": 1, "_fused_topk_kernel": 1})
    for kernel, count in expected.items():
        assert sum(n.startswith(kernel) for n in names) == count, names
    # Besides: the aligned pipeline's activation kernel where its config keeps it separate, and the
    # router's bias add while it is its own kernel.
    others = [n for n in names if not n.startswith(tuple(expected)) and not n.startswith("_moe_activation_kernel")]
    assert len(others) <= bias, names
    assert torch.isfinite(out).all()
    # Either path: the experts of the top-k kernel's routing, bit for bit.
    from plait.layers.moe.router import select_experts

    with torch.inference_mode():
        weights, ids = select_experts(block.gate(x), block.router_config, True)
        assert torch.equal(out, moe(x, weights, ids))


@pytest.mark.parametrize("num_tokens", [1, 4, 16])
@pytest.mark.parametrize(("num_experts", "hidden_size", "bias"), [(128, 2048, False), (32, 2880, True)])
def test_router_at_decode_sizes_runs_one_gemv_where_gemv_takes_says_and_stays_close_to_linear(
        num_tokens, num_experts, hidden_size, bias):
    # The router follows the dense layers' rule (gemv_takes): one token always runs the GEMV, 2..16
    # tokens only where this card's tuned table has the router's shape; elsewhere cuBLAS. The GEMV is
    # one launch with the bias in its epilogue; cuBLAS may add the bias in a second launch.
    from plait.layers.moe.layer import Router
    from plait.layers.quantization.gemv_config import gemv_takes

    router = Router(num_experts, hidden_size, bias=bias, dtype=torch.bfloat16).cuda()
    router.weight.data.normal_().mul_(hidden_size**-0.5)
    if bias:
        router.bias.data.normal_()
    x = hidden(num_tokens, hidden_size, seed=num_tokens)
    assert router.small_m_gemv
    logits, names = profiled_kernels(router, x)
    takes_gemv = gemv_takes("bf16", num_tokens, num_experts, hidden_size, torch.cuda.get_device_name())
    assert takes_gemv or num_tokens > 1
    assert sum(n.startswith("_gemv_kernel") for n in names) == int(takes_gemv), names
    assert 1 <= len(names) <= (1 if takes_gemv else 1 + bias), names
    ref = torch.nn.functional.linear(x.float(), router.weight.float(), router.bias.float() if bias else None)
    assert logits.dtype == torch.bfloat16 and logits.shape == (num_tokens, num_experts)
    torch.testing.assert_close(logits.float(), ref, atol=3e-2, rtol=2e-2)


def test_one_launch_expert_counter_matches_torch_under_graph_replay():
    from plait.layers.moe.routing_stats import RoutedExpertCounter

    fused_counter = RoutedExpertCounter(128, "cuda", capacity=4)
    torch_counter = RoutedExpertCounter(128, "cuda", capacity=4)
    _, ids = routing(3, 128, 8, seed=40)
    fused_counter.record(ids)  # compile outside the capture
    fused_counter.reset()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fused_counter.record(ids)
    for seed in (41, 42, 43, 44, 45):  # wraps the ring of 4
        ids.copy_(routing(3, 128, 8, seed=seed)[1])
        ids[0, 0] = -1  # an expert another rank holds: not counted
        graph.replay()
        torch_counter.record(ids, fused=False)
    assert fused_counter.calls() == torch_counter.calls()
