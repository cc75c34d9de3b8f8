"""Qwen3's one-launch q/k head norm in bf16 at the real shapes against two RMSNorm launches."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

from plait.layers.norm import RMSNorm  # noqa: E402
from plait.layers.qk_norm import qk_rmsnorm  # noqa: E402


# qwen3-30b-a3b at decode sizes, qwen3-0.6b at a prefill size
@pytest.mark.parametrize(("hq", "hk", "tokens"), [(32, 4, 1), (32, 4, 7), (16, 8, 300)])
def test_matches_two_rmsnorm_launches_in_bf16(hq, hk, tokens):
    head_dim = 128
    qkv = (3 * torch.randn(tokens, (hq + 2 * hk) * head_dim, device="cuda")).bfloat16()
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    qn, kn = RMSNorm(head_dim, 1e-6).cuda().bfloat16(), RMSNorm(head_dim, 1e-6).cuda().bfloat16()
    qn.weight.data.normal_(1.0, 0.5)
    kn.weight.data.normal_(1.0, 0.5)
    q_out, k_out = qk_rmsnorm(q, k, qn.weight, kn.weight, 1e-6)
    torch.testing.assert_close(q_out, qn(q.reshape(tokens, hq, head_dim)).reshape(tokens, -1))
    torch.testing.assert_close(k_out, kn(k.reshape(tokens, hk, head_dim)).reshape(tokens, -1))


@pytest.mark.parametrize(("hq", "hk", "tokens"), [(32, 4, 1), (32, 4, 7), (16, 8, 300)])
def test_norm_inside_the_rotary_kernel_equals_the_two_kernels_in_bf16(hq, hk, tokens):
    # What Qwen3Attention runs on CUDA now (one launch: norm, rotation, K/V store) against the
    # qk_rmsnorm launch followed by the rotary one: the same arithmetic (equal bit for bit in the
    # interpreter, tests/test_qk_norm.py); here the two kernels' fp32 sums may reduce in another order.
    from plait.layers.rotary import QKNorm, RotaryEmbedding
    from plait.layers.triton_ops import rotary_

    head_dim = 128
    rope = RotaryEmbedding(head_dim, 4096, 1e6).cuda()
    pos = torch.randint(0, 4096, (tokens,), device="cuda")
    qkv = (3 * torch.randn(tokens, (hq + 2 * hk) * head_dim, device="cuda")).bfloat16()
    q, k, v = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    wq = (torch.randn(head_dim, device="cuda") * 0.5 + 1).bfloat16()
    wk = (torch.randn(head_dim, device="cuda") * 0.5 + 1).bfloat16()
    caches = [torch.zeros(tokens + 4, hk, head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    loc = torch.randperm(tokens + 4, device="cuda")[:tokens]
    ref_q, ref_k = rotary_(pos, *qk_rmsnorm(q, k, wq, wk, 1e-6), rope.cos_sin_cache, head_dim,
                           (v, caches[0], caches[1], loc))
    out_q, out_k = rotary_(pos, q, k, rope.cos_sin_cache, head_dim, (v, caches[2], caches[3], loc),
                           QKNorm(wq, wk, 1e-6))
    torch.testing.assert_close(out_q, ref_q)
    torch.testing.assert_close(out_k, ref_k)
    torch.testing.assert_close(caches[2], caches[0])
    torch.testing.assert_close(caches[3], caches[1])
