"""add + RMSNorm fused into the small-M GEMV that reads its output (``PLAIT_FUSED_NORM_GEMV``).

A decoder layer at decode runs ``hidden, residual = norm(hidden, residual)`` and then a GEMV on
``hidden`` (qkv after ``input_layernorm``; after ``post_attention_layernorm`` a dense MLP's gate_up or
the MoE router, whose experts then read the normed rows too). ``norm_linear`` runs both as one launch
(``gemv_rmsnorm``) where the linear layer would take the GEMV for this call anyway (CUDA, or the Triton
interpreter with ``PLAIT_TRITON_OPS=1`` in tests; 1..16 rows; its weights in a form the GEMV reads),
else the norm and then the layer, exactly as before. Column-parallel layers only: under tensor
parallelism the norm's input is already the all-reduced row, and each rank's GEMV reads all of it.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from plait import envs
from plait.layers.norm import RMSNorm
from plait.layers.quantization.gemv import GemvOperands, gemv_rmsnorm
from plait.layers.quantization.gemv_config import GEMV_MAX_TOKENS


class GemvLinear(Protocol):
    """A linear layer whose decode-size calls may run in the GEMV: ``gemv_operands(x)`` gives its weight
    as the GEMV takes it when its own forward of ``x`` would take the GEMV, else None."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
    def gemv_operands(self, x: torch.Tensor) -> GemvOperands | None: ...


def norm_linear(norm: nn.Module, linear: GemvLinear, x: torch.Tensor, residual: torch.Tensor | None,
                want_normed: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(linear(norm(h)), h, norm(h) if want_normed)`` for ``h = x + residual`` (``x`` where residual is
    None, the first layer): the decoder layer's ``norm(hidden, residual)`` and the linear layer after it.
    ``norm`` that is not an RMSNorm (EAGLE's first layer has none) runs as it is."""
    operands = None
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if isinstance(norm, RMSNorm) and 1 <= rows <= GEMV_MAX_TOKENS and envs.FUSED_NORM_GEMV.get():
        operands = linear.gemv_operands(x)
    if operands is None:
        if residual is None:
            normed, residual = norm(x), x
        else:
            normed, residual = norm(x, residual)
        return linear(normed), residual, normed
    assert isinstance(norm, RMSNorm)
    shape = x.shape
    x2 = x.reshape(rows, shape[-1])
    out, new_residual, normed = gemv_rmsnorm(
        x2, norm.weight, norm.eps, operands.weight, operands.scale, operands.block,
        residual=residual.reshape(rows, shape[-1]) if residual is not None else None, want_normed=want_normed,
        bias=operands.bias)
    return (out.view(*shape[:-1], out.shape[-1]), new_residual.view(shape),
            normed.view(shape) if normed is not None else None)
