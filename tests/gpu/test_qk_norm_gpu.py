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
