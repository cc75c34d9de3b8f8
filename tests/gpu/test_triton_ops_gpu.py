"""The fused layer kernels on the H200 at real shapes (bf16): rotary with the KV-cache write against
rotary then the backend's store, and the two-pass argmax against torch.argmax over a 128k vocabulary."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

triton_ops = pytest.importorskip("plait.layers.triton_ops")

from plait.attention.triton.kernels import store_kv  # noqa: E402
from plait.layers.rotary import RotaryEmbedding  # noqa: E402

HQ, HKV, D = 32, 8, 128


@pytest.mark.parametrize("tokens", [1, 256, 8192])
def test_rotary_with_kv_store_equals_rotary_then_store(tokens):
    rope = RotaryEmbedding(D, 8192, 500000.0).cuda()
    q = torch.randn(tokens, HQ * D, device="cuda", dtype=torch.bfloat16)
    k = torch.randn(tokens, HKV * D, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(tokens, HKV * D, device="cuda", dtype=torch.bfloat16)
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    loc = torch.randperm(2 * tokens, device="cuda")[:tokens]
    caches = [torch.zeros(2 * tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    q1, k1 = triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, D,
                                (v, caches[0], caches[1], loc))
    q2, k2 = triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, D)
    store_kv(caches[2], caches[3], loc, k2.view(tokens, HKV, D), v.view(tokens, HKV, D))
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("bs", [1, 7, 256])
def test_argmax_equals_torch_argmax_over_the_llama3_vocabulary(bs):
    logits = torch.randn(bs, 128256, device="cuda", dtype=torch.float32)
    logits[0, 77777] = logits[0].max() + 1.0  # a clear winner in a late block
    assert torch.equal(triton_ops.argmax(logits), torch.argmax(logits, dim=-1))


@pytest.mark.parametrize("tokens", [1, 16])
def test_rotary_over_head_blocks_equals_one_program_per_token(monkeypatch, tokens):
    # The split grid (4 heads a program at decode) changes no value: q, k and both caches equal the
    # launch with one program per token.
    rope = RotaryEmbedding(D, 8192, 500000.0).cuda()
    q, k, v = (torch.randn(tokens, h * D, device="cuda", dtype=torch.bfloat16) for h in (HQ, HKV, HKV))
    pos = torch.randint(0, 8192, (tokens,), device="cuda")
    loc = torch.randperm(2 * tokens, device="cuda")[:tokens]
    caches = [torch.zeros(2 * tokens, HKV, D, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    assert triton_ops.rotary_heads_per_program(tokens, HQ, HKV, 132, D) == triton_ops.ROTARY_SPLIT_HEADS
    q1, k1 = triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, D, (v, caches[0], caches[1], loc))
    monkeypatch.setenv("PLAIT_ROTARY_SPLIT_HEADS", "0")
    q2, k2 = triton_ops.rotary_(pos, q.clone(), k.clone(), rope.cos_sin_cache, D, (v, caches[2], caches[3], loc))
    assert torch.equal(q1, q2) and torch.equal(k1, k2)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


@pytest.mark.parametrize("bs", [1, 256])
def test_one_pass_gumbel_max_equals_the_separate_passes_over_the_qwen3_vocabulary(bs):
    """The fused temperature + noise + argmax draw against dividing, adding the noise and taking torch's
    argmax, on a padded-vocabulary view of LM-head-sized fp32 logits."""
    from plait.sampling.rng import add_gumbel_noise_, gumbel_max_sample

    buf = torch.randn(bs, 152064, device="cuda") * 5
    logits = buf[:, :151936]
    temps = torch.rand(bs, device="cuda") * 1.5 + 0.1
    keys = torch.randint(-(1 << 62), 1 << 62, (bs,), device="cuda", dtype=torch.int64)
    separate = torch.argmax(add_gumbel_noise_(logits / temps[:, None], keys), dim=-1)
    assert torch.equal(gumbel_max_sample(logits, temps, keys), separate)
