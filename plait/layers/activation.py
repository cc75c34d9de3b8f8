from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """x [..., 2n] -> silu(x[..., :n]) * x[..., n:] (the fused gate_up output)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1] // 2
        return F.silu(x[..., :n]) * x[..., n:]
