"""Qwen3's q/k head norm in one launch (Triton interpreter on the CPU) against two RMSNorm calls."""

from __future__ import annotations

import pytest
import torch

qk_norm = pytest.importorskip("plait.layers.qk_norm")

from plait.layers.norm import RMSNorm  # noqa: E402


def two_norms(q, k, wq, wk, head_dim, eps):
    qn, kn = RMSNorm(head_dim, eps), RMSNorm(head_dim, eps)
    qn.weight.data, kn.weight.data = wq, wk
    t = q.shape[0]
    return (qn.forward_native(q.reshape(t, -1, head_dim)).reshape(t, -1),
            kn.forward_native(k.reshape(t, -1, head_dim)).reshape(t, -1))


# The interpreter has no bf16 (numpy): fp16 stands for the half-precision path here, bf16 runs on the GPU.
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_one_launch_equals_two_norms_on_strided_slices_of_the_qkv_output(dtype):
    # 6 query heads and 2 key heads of 24 (neither a power of two), read from the QKV rows.
    g = torch.Generator().manual_seed(0)
    head_dim, hq, hk, tokens = 24, 6, 2, 3
    qkv = (3 * torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g)).to(dtype)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    wq = (1 + torch.randn(head_dim, generator=g)).to(dtype)
    wk = (1 + torch.randn(head_dim, generator=g)).to(dtype)
    q_out, k_out = qk_norm.qk_rmsnorm(q, k, wq, wk, 1e-6)
    ref_q, ref_k = two_norms(q, k, wq, wk, head_dim, 1e-6)
    assert q_out.is_contiguous() and k_out.is_contiguous() and q_out.dtype == dtype
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 2e-2, "rtol": 1e-2}
    torch.testing.assert_close(q_out, ref_q, **tol)
    torch.testing.assert_close(k_out, ref_k, **tol)


def test_widths_that_are_not_whole_heads_are_refused():
    with pytest.raises(ValueError, match="multiples of the head dim 8"):
        qk_norm.qk_rmsnorm(torch.randn(2, 20), torch.randn(2, 16), torch.ones(8), torch.ones(8), 1e-6)


def qkv_slices(tokens: int, hq: int, hk: int, head_dim: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qkv = (3 * torch.randn(tokens, (hq + 2 * hk) * head_dim, generator=g)).to(dtype)
    wq = (1 + torch.randn(head_dim, generator=g)).to(dtype)
    wk = (1 + torch.randn(head_dim, generator=g)).to(dtype)
    return qkv, wq, wk


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("kv_store", [False, True], ids=["rotate", "rotate-and-store-kv"])
def test_norm_inside_the_rotary_kernel_equals_the_norm_kernel_then_the_rotary_kernel(dtype, kv_store):
    # 6 query heads, 2 key heads of 16, at positions out of order; the fused launch works in place on
    # the strided q/k slices of the QKV rows, the two-kernel path on qk_rmsnorm's contiguous outputs.
    from plait.layers.rotary import QKNorm, RotaryEmbedding
    from plait.layers.triton_ops import rotary_

    head_dim, hq, hk, tokens = 16, 6, 2, 3
    rope = RotaryEmbedding(head_dim, 64, 10000.0)
    pos = torch.tensor([5, 0, 37])
    qkv, wq, wk = qkv_slices(tokens, hq, hk, head_dim, dtype)
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    caches = [torch.zeros(8, hk, head_dim, dtype=dtype) for _ in range(4)]
    loc = torch.tensor([6, 1, 3])

    ref_q, ref_k = qk_norm.qk_rmsnorm(q, k, wq, wk, 1e-6)
    store = (v, caches[0], caches[1], loc) if kv_store else None
    ref_q, ref_k = rotary_(pos, ref_q, ref_k, rope.cos_sin_cache, head_dim, store)
    fused_store = (v, caches[2], caches[3], loc) if kv_store else None
    out_q, out_k = rotary_(pos, q, k, rope.cos_sin_cache, head_dim, fused_store, QKNorm(wq, wk, 1e-6))

    assert out_q.data_ptr() == q.data_ptr()  # in place on the QKV output
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)
    assert torch.equal(caches[2], caches[0]) and torch.equal(caches[3], caches[1])
    if kv_store:
        assert caches[2][loc].abs().sum() > 0


def test_rotary_with_qk_norm_off_cuda_is_the_two_rmsnorms_then_the_rotation():
    # The torch path RotaryEmbedding takes on the CPU with a QKNorm: what Qwen3Attention did before.
    from plait.layers.rotary import QKNorm, RotaryEmbedding

    head_dim, hq, hk, tokens = 16, 4, 2, 2
    rope = RotaryEmbedding(head_dim, 32, 10000.0)
    pos = torch.tensor([3, 9])
    qkv, wq, wk = qkv_slices(tokens, hq, hk, head_dim, torch.float32, seed=1)
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    out_q, out_k = rope(pos, q, k, qk_norm=QKNorm(wq, wk, 1e-6))
    ref_q, ref_k = rope.forward_native(pos, *two_norms(q, k, wq, wk, head_dim, 1e-6))
    assert torch.equal(out_q, ref_q) and torch.equal(out_k, ref_k)


def test_qk_norm_weights_of_another_head_dim_are_refused():
    from plait.layers.rotary import QKNorm, RotaryEmbedding
    from plait.layers.triton_ops import rotary_

    rope = RotaryEmbedding(16, 8, 10000.0)
    q, k = torch.randn(1, 32), torch.randn(1, 16)
    with pytest.raises(ValueError, match=r"two \[16\] weights"):
        rotary_(torch.tensor([0]), q, k, rope.cos_sin_cache, 16, None, QKNorm(torch.ones(8), torch.ones(16), 1e-6))
