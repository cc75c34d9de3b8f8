"""Rotary position embedding (neox / rotate-half layout, as Llama, Mistral and Qwen use), with the
Llama-3 frequency scaling. The cos/sin cache is float32 [max_positions, rotary_dim]."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


def rope_settings(hf_config: object) -> tuple[float, dict[str, Any]]:
    """(rope_theta, scaling dict) from a HF config, accepting both the transformers 5
    ``rope_parameters`` and the older ``rope_theta`` + ``rope_scaling`` spellings."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0)))
    rope_type = merged.get("rope_type", merged.get("type", "default"))
    merged["rope_type"] = rope_type
    return theta, merged


def llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = float(scaling["factor"])
    low = float(scaling["low_freq_factor"])
    high = float(scaling["high_freq_factor"])
    old_ctx = float(scaling["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, theta: float,
                 scaling: dict[str, Any] | None = None) -> None:
        super().__init__()
        scaling = scaling or {"rope_type": "default"}
        rope_type = scaling.get("rope_type", "default")
        if rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"rope_type {rope_type!r} is not supported; supported: {SUPPORTED_ROPE_TYPES}")
        self.head_dim = head_dim
        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if rope_type == "linear":
            positions = positions / float(scaling["factor"])
        freqs = torch.outer(positions, inv_freq)
        # Not a parameter or persistent buffer: never in a checkpoint, moved with the module.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1), persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq*D], k [T, Hkv*D] rotated at ``positions`` [T]. On CUDA in place, by one kernel.
        ``kv_store`` (v, k_cache, v_cache, loc): the rotated k and v are written into the paged
        cache at ``loc`` too (in the same kernel on CUDA)."""
        if q.is_cuda:
            from plait.layers.triton_ops import rotary_

            return rotary_(positions, q, k, self.cos_sin_cache, self.head_dim, kv_store)
        q, k = self.forward_native(positions, q, k)
        if kv_store is not None:
            v, k_cache, v_cache, loc = kv_store
            k_cache[loc] = k.view(k.shape[0], -1, self.head_dim).to(k_cache.dtype)
            v_cache[loc] = v.reshape(v.shape[0], -1, self.head_dim).to(v_cache.dtype)
        return q, k

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin_cache[positions].chunk(2, dim=-1)  # [T, D/2] each
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        t = x.shape[0]
        x = x.view(t, -1, self.head_dim)
        x1, x2 = x.float().chunk(2, dim=-1)
        c, s = cos.unsqueeze(1), sin.unsqueeze(1)
        out = torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)
        return out.to(x.dtype).view(t, -1)
