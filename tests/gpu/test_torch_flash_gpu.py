"""torch_flash on the H200 (bf16): each kernel path against torch_native at real shapes (8 x 2048 with no
prefix, over a 2048-token cached prefix, sliding window 512, a verify tree), and end to end on the 1b shape:
teacher-forced logits of torch_flash and of the hybrid pair (torch_flash prefill, triton decode) against
torch_native, within the tolerance of tests/gpu/test_engine_gpu.py."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.attention.torch_flash import TorchFlashAttnBackend, detect_varlen_kernel  # noqa: E402
from plait.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.bench.shapes import SHAPES  # noqa: E402
from plait.bench.workloads import make_engine, random_prompts  # noqa: E402
from plait.forward_batch import ForwardMode  # noqa: E402
from tests.attn_cases import extend_batch, layer, make_pools, run  # noqa: E402
from tests.gpu.test_engine_gpu import release, teacher_forced_logits  # noqa: E402

HQ, HKV, D = 32, 8, 128
ATOL, RTOL = 1e-2, 2e-2  # as tests/gpu/test_triton_kernels_gpu.py
PATHS = ["auto", "sdpa"] + (["varlen"] if detect_varlen_kernel() is not None else [])


def _case(path: str, prefix: list[int], ext: list[int], window: int | None = None, tree: bool = False) -> None:
    slots = sum(prefix) + sum(ext) + 1
    pool, kv, g = make_pools(HKV, D, seed=0, dtype=torch.bfloat16, device="cuda",
                             max_context=max(p + e for p, e in zip(prefix, ext, strict=True)), slots=slots)
    native = TorchNativeAttnBackend(pool, kv)
    flash = TorchFlashAttnBackend(pool, kv, path, sliding_window=window)
    fb = extend_batch(pool, g, prefix, ext, num_slots=slots)
    if tree:
        fb.forward_mode = ForwardMode.TARGET_VERIFY
        blocks = []
        for p, e in zip(prefix, ext, strict=True):
            m = torch.rand(e, p + e, generator=g) > 0.5
            m[:, :p] = True
            m[torch.arange(e), p + torch.arange(e)] = True
            blocks.append(m.flatten())
        fb.spec_info = SimpleNamespace(custom_mask=torch.cat(blocks).cuda())
    t = fb.num_tokens
    q, k, v = (torch.randn(t, h * D, generator=g).to("cuda", torch.bfloat16) for h in (HQ, HKV, HKV))
    lay = layer(HQ, HKV, D, window)
    want = run(native, fb, q, k, v, lay).float()
    got = run(flash, fb, q, k, v, lay).float()
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("path", PATHS)
def test_extend_8x2048_no_prefix(path):
    _case(path, [0] * 8, [2048] * 8)


@pytest.mark.parametrize("path", PATHS)
def test_extend_8x2048_over_a_2048_prefix(path):
    _case(path, [2048] * 8, [2048] * 8)


@pytest.mark.parametrize("path", PATHS)
def test_extend_sliding_window_512_with_and_without_prefix(path):
    _case(path, [0, 0, 1024, 2048], [2048, 2048, 1024, 512], window=512)


@pytest.mark.parametrize("path", PATHS)
def test_extend_ragged_mixed_lengths(path):
    _case(path, [0, 0, 17, 0, 300, 1], [1000, 1000, 33, 7, 1, 1])


def test_verify_tree_mask():
    _case("auto", [500, 1200, 33], [8, 8, 8], tree=True)


def test_decode_matches_torch_native_with_a_window():
    pool, kv, g = make_pools(HKV, D, seed=1, dtype=torch.bfloat16, device="cuda", max_context=4096, slots=20000)
    native, flash = TorchNativeAttnBackend(pool, kv), TorchFlashAttnBackend(pool, kv, sliding_window=512)
    fb = extend_batch(pool, g, [100, 4000, 700, 1], [1, 1, 1, 1], num_slots=20000)
    fb.forward_mode = ForwardMode.DECODE
    q, k, v = (torch.randn(4, h * D, generator=g).to("cuda", torch.bfloat16) for h in (HQ, HKV, HKV))
    for window in (None, 512):
        lay = layer(HQ, HKV, D, window)
        torch.testing.assert_close(run(flash, fb, q, k, v, lay).float(), run(native, fb, q, k, v, lay).float(),
                                   atol=ATOL, rtol=RTOL)


# --- end to end on the 1b shape ------------------------------------------------------------------

SHAPE = "llama-3.2-1b"
VOCAB = SHAPES[SHAPE]["vocab_size"]


@pytest.fixture(scope="module")
def reference(shape_dir):
    """torch_native teacher-forced logits at bs 4 and their spread against bs 1 (the tolerance)."""
    seqs = random_prompts(4, 80, VOCAB, seed=4)
    native = make_engine(shape_dir, attention_backend="torch_native", disable_cuda_graph=True)
    ref_bs4 = teacher_forced_logits(native, seqs, 48)
    ref_bs1 = torch.cat([teacher_forced_logits(native, [s], 48) for s in seqs], dim=1)
    release(native)
    spread = (ref_bs4 - ref_bs1).abs().max().item()
    return seqs, ref_bs4, max(3 * spread, 1e-3 * ref_bs4.abs().max().item())


@pytest.mark.parametrize("options", [
    {"attention_backend": "torch_flash", "disable_cuda_graph": True},
    {"prefill_attention_backend": "torch_flash", "decode_attention_backend": "triton"},
], ids=["torch_flash", "hybrid-torch_flash-triton"])
def test_logits_match_torch_native_within_its_own_batch_spread(shape_dir, reference, options):
    seqs, ref, tolerance = reference
    engine = make_engine(shape_dir, **options)
    got = teacher_forced_logits(engine, seqs, 48)
    release(engine)
    diff = (got - ref).abs().max().item()
    assert diff <= tolerance, f"{options} vs torch_native {diff}, tolerance {tolerance}"
    top2 = ref.topk(2, dim=-1).values
    clear = (top2[..., 0] - top2[..., 1]) > 2 * tolerance
    assert clear.float().mean() > 0.5
    assert torch.equal(got.argmax(-1)[clear], ref.argmax(-1)[clear])


def test_packed_prefill_runs_flash_attention_not_cudnn_at_new_lengths():
    """cuDNN's attention builds a plan per new shape on the request path; the packed causal call must take
    FlashAttention-2 (it plans nothing) at every prompt length, and agree with torch_native there."""
    from torch.profiler import ProfilerActivity, profile

    for ext in ([384], [640, 640], [1536]):
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            _case("auto", [0] * len(ext), ext)
        names = {e.key for e in prof.key_averages()}
        assert not any("cudnn" in n for n in names), sorted(n for n in names if "cudnn" in n)
        assert any("flash_attention" in n for n in names), sorted(n for n in names if "attention" in n)
