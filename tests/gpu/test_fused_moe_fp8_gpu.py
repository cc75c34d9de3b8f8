"""Block-FP8 experts through the fused MoE kernels on the GPU at the qwen3-30b-a3b shape (E 128, top
8, H 2048, I 768): the aligned W8A8 pipeline and the weight-only small-batch path against the bf16
pipeline on the dequantized weights, eagerly and under CUDA graph replay."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

fused = pytest.importorskip("plait.layers.moe.fused_moe_triton")

from plait.layers.moe.fp8 import quantize_expert_blocks  # noqa: E402
from plait.layers.moe.reference import fused_experts_reference  # noqa: E402
from plait.layers.quantization.fp8_kernels import dequantize_weight  # noqa: E402

E, TOP_K, H, INTER = 128, 8, 2048, 768
# Against the bf16 pipeline on the dequantized weights, relative (Frobenius): the weight-only small
# path differs by bf16 rounding only; the aligned path also quantizes both GEMMs' inputs to e4m3 per
# token per 128 columns (3 mantissa bits: about 3.6% RMS per value). The two references (weight-only
# against quantized activations, fp32 on the CPU at this shape with 16 experts) differ by 4.3%.
SMALL_TOL = 1e-2
ALIGNED_TOL = 8e-2


def _dequantize(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return torch.stack([dequantize_weight(q[e], s[e], (128, 128)) for e in range(q.shape[0])])


@pytest.fixture(scope="module")
def experts():
    g = torch.Generator(device="cuda").manual_seed(0)
    w13 = torch.randn(E, 2 * INTER, H, device="cuda", generator=g) / H**0.5
    w2 = torch.randn(E, H, INTER, device="cuda", generator=g) / INTER**0.5
    (q13, s13), (q2, s2) = quantize_expert_blocks(w13), quantize_expert_blocks(w2)
    return {"q13": q13, "s13": s13, "q2": q2, "s2": s2,
            "bf16": (_dequantize(q13, s13).bfloat16(), _dequantize(q2, s2).bfloat16())}


def routing(num_tokens: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(num_tokens, E, device="cuda", generator=g)
    weights, ids = torch.topk(logits.softmax(-1), TOP_K, dim=-1)
    x = (2 * torch.randn(num_tokens, H, device="cuda", generator=g)).bfloat16()
    return x, weights / weights.sum(-1, keepdim=True), ids.to(torch.int32)


def run_fp8(ex, x, weights, ids, small_batch):
    return fused.fused_experts_triton(x, ex["q13"], ex["q2"], weights, ids, small_batch=small_batch,
                                      w13_scale=ex["s13"], w2_scale=ex["s2"])


def rel(out: torch.Tensor, ref: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return float((out.float() - ref.float()).norm() / ref.float().norm())


@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
@pytest.mark.parametrize("path", ["small", "aligned", "dispatched"])
def test_fp8_experts_match_the_bf16_pipeline_on_the_dequantized_weights(experts, num_tokens, path):
    x, weights, ids = routing(num_tokens, seed=num_tokens)
    small = {"small": True, "aligned": False, "dispatched": None}[path]
    out = run_fp8(experts, x, weights, ids, small)
    ref = fused.fused_experts_triton(x, *experts["bf16"], weights, ids, small_batch=small)
    assert rel(out, ref) < (SMALL_TOL if path == "small" else ALIGNED_TOL)


# The kernel quantizes the activation output after rounding it to bf16, the fp32 reference before: about
# 3% of the values sit close enough to an e4m3 rounding boundary to land one e4m3 step (12.5%) apart,
# about 2% relative in all (1.5% measured on an H200), against 8% for the weight-only comparison above.
# The interpreter test (tests/test_fused_moe_fp8.py) holds the kernel to 2e-4 of this reference.
QUANTIZED_REF_TOL = 3e-2


def test_fp8_aligned_pipeline_equals_its_reference_with_quantized_activations(experts):
    x, weights, ids = routing(64, seed=3)
    out = run_fp8(experts, x, weights, ids, small_batch=False)
    ref = fused_experts_reference(x.float(), experts["q13"], experts["q2"], weights, ids, w13_scale=experts["s13"],
                                  w2_scale=experts["s2"], quantize_activations=True)
    assert rel(out, ref) < QUANTIZED_REF_TOL


def test_fp8_skewed_routing_and_remote_experts(experts):
    x, weights, ids = routing(300, seed=5)
    ids[:, 0] = 3
    ids[::2, 1:] = -1
    ids[1::2, 1:] = E
    out = run_fp8(experts, x, weights, ids, small_batch=False)
    ref = fused.fused_experts_triton(x, *experts["bf16"], weights, ids, small_batch=False)
    assert rel(out, ref) < ALIGNED_TOL


@pytest.mark.parametrize("num_tokens", [1, 4, 64, 512])
@pytest.mark.parametrize("small_batch", [True, False], ids=["small", "aligned"])
def test_fp8_graph_replay_equals_eager_on_new_routings(experts, num_tokens, small_batch):
    if small_batch and num_tokens > 16:
        pytest.skip("the small path is for decode sizes")
    x, weights, ids = routing(num_tokens, seed=11)
    run_fp8(experts, x, weights, ids, small_batch)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run_fp8(experts, x, weights, ids, small_batch)
    for seed in (12, 13, 14):  # new inputs into the captured buffers, the last all on experts 0..7
        nx, nw, ni = routing(num_tokens, seed=seed)
        if seed == 14:
            ni[:] = torch.arange(TOP_K, device="cuda", dtype=torch.int32)
        x.copy_(nx)
        weights.copy_(nw)
        ids.copy_(ni)
        graph.replay()
        torch.cuda.synchronize()
        eager = run_fp8(experts, nx, nw, ni, small_batch)
        torch.testing.assert_close(out, eager, atol=0, rtol=0)
