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

from typing import NamedTuple, Protocol

import torch
from torch import nn

from plait import envs
from plait.layers.norm import RMSNorm
from plait.layers.quantization.gemv import GemvOperands, RouteOutputs, gemv, gemv_rmsnorm
from plait.layers.quantization.gemv_config import GEMV_MAX_TOKENS


class GemvLinear(Protocol):
    """A linear layer whose decode-size calls may run in the GEMV: ``gemv_operands(x)`` gives its weight
    as the GEMV takes it when its own forward of ``x`` would take the GEMV, else None."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
    def gemv_operands(self, x: torch.Tensor) -> GemvOperands | None: ...


class NormLinearOut(NamedTuple):
    out: torch.Tensor  # linear(norm(h))
    residual: torch.Tensor  # h
    normed: torch.Tensor | None  # norm(h): where asked, or where the norm ran on its own
    routed: bool  # the ``route`` outputs were written (the GEMV ran, with its router epilogue)


def _rows(x: torch.Tensor) -> int:
    return x.numel() // x.shape[-1] if x.dim() else 0


def linear_routed(linear: GemvLinear, x: torch.Tensor, route: RouteOutputs | None) -> tuple[torch.Tensor, bool]:
    """``linear(x)``; with ``route``, where the layer takes the GEMV, that GEMV's last program also
    writes each row's top-k routing there (True), else the plain layer (False)."""
    operands = linear.gemv_operands(x) if route is not None and 1 <= _rows(x) <= GEMV_MAX_TOKENS else None
    if operands is None:
        return linear(x), False
    x2 = x.reshape(-1, x.shape[-1])
    out = gemv(x2, operands.weight, operands.scale, operands.block, bias=operands.bias, route=route)
    return out.view(*x.shape[:-1], out.shape[-1]), True


def norm_linear(norm: nn.Module, linear: GemvLinear, x: torch.Tensor, residual: torch.Tensor | None,
                want_normed: bool = False, route: RouteOutputs | None = None) -> NormLinearOut:
    """``linear(norm(h))``, ``h``, and ``norm(h)`` if ``want_normed``, for ``h = x + residual`` (``x`` where
    residual is None, the first layer): the decoder layer's ``norm(hidden, residual)`` and the linear
    layer after it. ``norm`` that is not an RMSNorm (EAGLE's first layer has none) runs as it is.
    ``route``: a router's top-k routing written by its GEMV's epilogue as well (``linear_routed``)."""
    operands = None
    rows = _rows(x)
    if isinstance(norm, RMSNorm) and 1 <= rows <= GEMV_MAX_TOKENS and envs.FUSED_NORM_GEMV.get():
        operands = linear.gemv_operands(x)
    if operands is None:
        if residual is None:
            normed, residual = norm(x), x
        else:
            normed, residual = norm(x, residual)
        out, routed = linear_routed(linear, normed, route)
        return NormLinearOut(out, residual, normed, routed)
    assert isinstance(norm, RMSNorm)
    shape = x.shape
    x2 = x.reshape(rows, shape[-1])
    out, new_residual, normed = gemv_rmsnorm(
        x2, norm.weight, norm.eps, operands.weight, operands.scale, operands.block,
        residual=residual.reshape(rows, shape[-1]) if residual is not None else None, want_normed=want_normed,
        bias=operands.bias, route=route)
    return NormLinearOut(out.view(*shape[:-1], out.shape[-1]), new_residual.view(shape),
                         normed.view(shape) if normed is not None else None, route is not None)
