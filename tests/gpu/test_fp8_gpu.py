"""FP8 on the GPU: the GEMV (its W8A8 form against the activation-quantizing reference, its weight-only
form against the dequantized-weight product) and GEMM paths at the llama-3.1-8b shapes, the bias
epilogue, and engines with FP8 weights / an FP8 KV cache whose CUDA-graph decode equals eager decode
(decode runs the GEMV's default form, W8A8, in both)."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES, linear_shapes  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402
from plait.layers.quantization.fp8_kernels import (  # noqa: E402
    dequantize_weight,
    fp8_linear,
    quantize_weight_per_channel,
    reference_fp8_linear,
    reference_w8a8_gemv,
)
from plait.layers.quantization.gemv import gemv, split_counters  # noqa: E402
from plait.layers.quantization.gemv_config import GemvConfig  # noqa: E402

VOCAB = SHAPES["llama-3.2-1b"]["vocab_size"]


def _weights(n: int, k: int, block: bool):
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    if not block:
        return (*quantize_weight_per_channel(w), None)
    q = w.to(torch.float8_e4m3fn)  # any FP8 values with positive block scales
    s = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 0.5 + 0.5
    return q, s, (128, 128)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


LLAMA_8B_LAYERS = linear_shapes("llama-3.1-8b")


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("m", [1, 2, 5, 16])
@pytest.mark.parametrize("layer", sorted(LLAMA_8B_LAYERS))
def test_weight_only_gemv_equals_the_dequantized_weight_product(block, m, layer):
    nk = LLAMA_8B_LAYERS[layer]
    q, s, blk = _weights(*nk, block)
    x = torch.randn(m, nk[1], device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dequantize_weight(q, s, blk).t()
    assert _rel(gemv(x, q, s, blk, w8a8=False), ref) < 1e-2


@pytest.mark.parametrize("kind", ["bf16", "channel", "block"])
@pytest.mark.parametrize("m", [2, 5, 16])
@pytest.mark.parametrize("layer", sorted(LLAMA_8B_LAYERS))
def test_swapped_operand_gemv_equals_the_weight_product(kind, m, layer):
    nk = LLAMA_8B_LAYERS[layer]
    if kind == "bf16":
        q, s, blk = torch.randn(*nk, device="cuda", dtype=torch.bfloat16) * 0.02, None, None
        w = q.float()
    else:
        q, s, blk = _weights(*nk, kind == "block")
        w = dequantize_weight(q, s, blk)
    x = torch.randn(m, nk[1], device="cuda", dtype=torch.bfloat16)
    for cfg in (GemvConfig(block_n=64, block_k=128, num_stages=4, swap_ab=True),
                GemvConfig(block_n=128, block_k=128, split_k=4, num_warps=8, swap_ab=True)):
        assert _rel(gemv(x, q, s, blk, cfg, w8a8=False), x.float() @ w.t()) < 1e-2, cfg


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("layer", sorted(LLAMA_8B_LAYERS))
def test_w8a8_gemv_equals_the_activation_quantizing_reference(block, m, layer):
    nk = LLAMA_8B_LAYERS[layer]
    q, s, blk = _weights(*nk, block)
    x = torch.randn(m, nk[1], device="cuda", dtype=torch.bfloat16)
    out = gemv(x, q, s, blk, w8a8=True)
    # The same e4m3 codes: the bf16 output's rounding (2^-9 of the largest entry) and the summation order.
    assert _rel(out, reference_w8a8_gemv(x, q, s, blk)) < 5e-3
    # Against the unquantized activations: e4m3 moves each by at most 2^-4 of itself.
    assert _rel(out, x.float() @ dequantize_weight(q, s, blk).t()) < 5e-2


@pytest.mark.parametrize("split_k", [1, 4])
def test_w8a8_gemv_replays_in_a_graph_as_it_ran_eagerly(split_k):
    q, s, _ = _weights(4096, 4096, False)
    x = torch.randn(3, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(block_n=64, block_k=128, split_k=split_k, num_warps=4, num_stages=4)
    eager = gemv(x, q, s, None, cfg, w8a8=True)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, q, s, None, cfg, w8a8=True)
    x.copy_(torch.randn_like(x))  # a replay reads the captured input buffer as it is now
    graph.replay()
    torch.cuda.synchronize()
    assert _rel(out, reference_w8a8_gemv(x, q, s, None)) < 5e-3
    assert torch.equal(out, gemv(x, q, s, None, cfg, w8a8=True))
    assert not torch.equal(out, eager)
    assert int(split_counters(x.device).abs().sum()) == 0


@pytest.mark.parametrize("block", [False, True])
def test_fp8_linear_adds_the_bias_in_the_gemv(block):
    q, s, blk = _weights(6144, 4096, block)
    bias = torch.randn(6144, device="cuda", dtype=torch.bfloat16)
    for m in (1, 16, 40):  # 40: the GEMM path, bias added after
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        ref = fp8_linear(x, q, s, blk, None, None).float() + bias.float()
        assert _rel(fp8_linear(x, q, s, blk, None, bias), ref) < 1e-2


def test_bf16_linear_adds_the_bias_in_the_gemv(monkeypatch):
    from plait.layers.linear import ColumnParallelLinear

    monkeypatch.setenv("PLAIT_BF16_GEMV", "1")
    layer = ColumnParallelLinear(4096, 1024, bias=True, dtype=torch.bfloat16).cuda()
    layer.weight.data.normal_(0, 0.02)
    layer.bias.data.normal_(0, 1)
    for m in (1, 7):
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        assert _rel(layer(x), x.float() @ layer.weight.float().t() + layer.bias.float()) < 1e-2


@pytest.mark.parametrize("m", [1, 3, 16])
@pytest.mark.parametrize("layer", sorted(LLAMA_8B_LAYERS))
def test_bf16_gemv_equals_the_fp32_product(m, layer):
    n, k = LLAMA_8B_LAYERS[layer]
    w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    assert _rel(gemv(x, w), x.float() @ w.float().t()) < 1e-2


@pytest.mark.parametrize("m", [1, 8])
def test_split_k_gemv_replays_in_a_graph_and_leaves_its_counters_zero(m):
    q, s, _ = _weights(4096, 4096, False)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    cfg = GemvConfig(block_n=16, block_k=256, split_k=4)
    ref = x.float() @ dequantize_weight(q, s, None).t()
    eager = gemv(x, q, s, None, cfg, w8a8=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = gemv(x, q, s, None, cfg, w8a8=False)
    for _ in range(3):
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, eager)  # the slices are added in order: deterministic
    assert _rel(out, ref) < 1e-2
    assert int(split_counters(x.device).abs().sum()) == 0


def test_bf16_linear_with_the_gemv_switch_equals_cublas(monkeypatch):
    from plait.layers.linear import RowParallelLinear

    monkeypatch.setenv("PLAIT_BF16_GEMV", "1")
    layer = RowParallelLinear(4096, 6144, dtype=torch.bfloat16).cuda()
    assert layer.small_m_gemv
    layer.weight.data.normal_(0, 0.02)
    for m in (1, 7, 40):  # 40 tokens: past the GEMV's range, cuBLAS
        x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
        assert _rel(layer(x), x.float() @ layer.weight.float().t()) < 1e-2


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("m", [64, 300])
def test_gemm_path_equals_the_activation_quantizing_reference(block, m):
    q, s, blk = _weights(4096, 4096, block)
    x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
    ref = reference_fp8_linear(x, q, s, blk, None)
    assert _rel(fp8_linear(x, q, s, blk, None, None), ref) < 2e-2


def test_static_input_scale_path_equals_its_reference():
    q, s, _ = _weights(2048, 4096, False)
    x = torch.randn(128, 4096, device="cuda", dtype=torch.bfloat16)
    scale = (x.float().abs().max() / 448).reshape(())
    assert _rel(fp8_linear(x, q, s, None, scale, None), reference_fp8_linear(x, q, s, None, scale)) < 2e-2


def _greedy(shape_dir: str, **options) -> list[list[int]]:
    engine = make_engine(shape_dir, max_running_requests=8, cuda_graph_max_bs=8, **options)
    outs = engine.generate(random_prompts(4, 64, VOCAB, seed=3),
                           {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 24})
    capacity = engine.runner.max_total_tokens
    engine.shutdown()
    del engine
    gc.collect()
    torch.cuda.empty_cache()
    return [o.token_ids for o in outs] + [[capacity]]


@pytest.mark.parametrize("options", [{"quantization": "fp8"}, {"kv_cache_dtype": "fp8_e4m3"},
                                     {"quantization": "fp8", "kv_cache_dtype": "fp8_e5m2"}])
def test_fp8_engine_graph_decode_equals_eager(shape_dir, options):
    # The last entry is the KV capacity, which differs by the graphs' memory: compare the tokens only.
    graph = _greedy(shape_dir, **options)[:-1]
    eager = _greedy(shape_dir, disable_cuda_graph=True, **options)[:-1]
    assert graph == eager


def test_fp8_kv_cache_doubles_the_capacity_and_torch_flash_prefill_reads_it(shape_dir):
    bf16 = make_engine(shape_dir, max_running_requests=8)
    auto_tokens = bf16.runner.max_total_tokens
    bf16.shutdown()
    del bf16
    gc.collect()
    torch.cuda.empty_cache()
    flash = _greedy(shape_dir, kv_cache_dtype="fp8_e4m3", prefill_attention_backend="torch_flash",
                    decode_attention_backend="triton")
    assert flash[-1][0] >= 1.9 * auto_tokens
    assert all(len(t) == 24 for t in flash[:-1])
