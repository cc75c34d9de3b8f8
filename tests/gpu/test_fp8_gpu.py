"""FP8 on the GPU: the GEMV and GEMM paths against the dequantizing reference at the llama-3.1-8b
shapes, and engines with FP8 weights / an FP8 KV cache whose CUDA-graph decode equals eager decode."""

from __future__ import annotations

import gc

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402
from plait.layers.quantization.fp8_kernels import (  # noqa: E402
    dequantize_weight,
    fp8_gemv,
    fp8_linear,
    quantize_weight_per_channel,
    reference_fp8_linear,
)

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


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("m", [1, 5, 16])
@pytest.mark.parametrize("nk", [(6144, 4096), (4096, 14336)])
def test_gemv_equals_the_dequantized_weight_product(block, m, nk):
    q, s, blk = _weights(*nk, block)
    x = torch.randn(m, nk[1], device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dequantize_weight(q, s, blk).t()
    assert _rel(fp8_gemv(x, q, s, blk), ref) < 1e-2


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
