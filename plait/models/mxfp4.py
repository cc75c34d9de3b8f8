"""MXFP4 (OCP microscaling FP4) weights, as gpt-oss's published checkpoints store their experts.

A tensor ``W`` [..., N] is stored as ``W_blocks`` uint8 [..., N / 32, 16] (two E2M1 values per byte,
the low nibble first) and ``W_scales`` uint8 [..., N / 32] (one E8M0 exponent per 32 values,
bias 127): ``W[..., 32 g + j] = e2m1(nibble j of block g) * 2 ** (scale[g] - 127)``. plait
dequantizes them at load; serving MXFP4 natively is later work.
"""

from __future__ import annotations

import torch

# E2M1 code -> value (sign bit 3, exponent bits 2-1, mantissa bit 0).
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
MXFP4_BLOCK = 32
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """blocks uint8 [..., G, 16], scales uint8 [..., G] -> [..., G * 32] in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
                         f"(want blocks [..., G, {MXFP4_BLOCK // 2}] and scales [..., G])")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    b = blocks.to(torch.uint8)
    values = torch.stack([lut[(b & 0x0F).long()], lut[(b >> 4).long()]], dim=-1).flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponent.unsqueeze(-1)).flatten(-2).to(dtype)


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N] (N a multiple of 32) -> (blocks, scales): round to the nearest E2M1 value after
    scaling each block of 32 by a power of two that puts its largest magnitude at <= 6. Exact for
    values that are E2M1 values times one power of two per block (how tests write checkpoints)."""
    if w.shape[-1] % MXFP4_BLOCK:
        raise ValueError(f"MXFP4 needs the last dimension ({w.shape[-1]}) to be a multiple of {MXFP4_BLOCK}")
    g = w.float().reshape(*w.shape[:-1], w.shape[-1] // MXFP4_BLOCK, MXFP4_BLOCK)
    amax = g.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, 127)
    scaled = g / torch.exp2(exponent).unsqueeze(-1)
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32)
    codes = (scaled.unsqueeze(-1) - lut).abs().argmin(dim=-1).to(torch.uint8)  # [..., G, 32]
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks, (exponent + SCALE_BIAS).to(torch.uint8)
