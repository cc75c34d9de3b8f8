"""RMSNorm with an optional fused residual add (computed in float32, as Hugging Face does)."""

from __future__ import annotations

import torch
from torch import nn


def rms_norm_native(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * norm(x)`` over the last dimension: the mean of squares in float32, the normalised
    value rounded to x's dtype before the weight multiplies it (Hugging Face's order)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Without residual: norm(x). With residual: (norm(x + residual), x + residual)."""
        if x.is_cuda:
            from plait.layers.triton_ops import rmsnorm

            return rmsnorm(x, self.weight, self.eps, residual)
        return self.forward_native(x, residual)

    def forward_native(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is not None:
            x = x + residual
            residual = x
        out = rms_norm_native(x, self.weight, self.eps)
        return out if residual is None else (out, residual)
