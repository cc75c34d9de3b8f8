from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x [..., 2n] -> silu(x[..., :n]) * x[..., n:] (the fused gate_up output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:
            from plait.layers.triton_ops import silu_and_mul

            return silu_and_mul(x)
        return self.forward_native(x)

    def forward_native(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1] // 2
        return F.silu(x[..., :n]) * x[..., n:]
