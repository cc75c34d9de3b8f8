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
