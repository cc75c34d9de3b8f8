"""Rotary position embedding (neox / rotate-half layout, as Llama, Mistral and Qwen use), with the
Llama-3 frequency scaling. The cos/sin cache is float32 [max_positions, rotary_dim]."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import torch
from torch import nn

from plait.layers.norm import rms_norm_native


class QKNorm(NamedTuple):
    """A per-head RMSNorm of q and k applied before the rotation (Qwen3's ``q_norm`` / ``k_norm``):
    the two ``[head_dim]`` weights and their shared epsilon."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float


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


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> tuple[torch.Tensor, float]:
    """YaRN (gpt-oss: factor 32, beta_fast 32, beta_slow 1, original context 4096, no truncation):
    frequencies blend interpolation (divided by ``factor``) and extrapolation by a linear ramp over
    the dimensions between the correction bounds; returns (inv_freq, the cos/sin scale
    ``attention_factor``, by default 0.1 * ln(factor) + 1). As transformers computes it."""
    factor = float(scaling["factor"])
    original = float(scaling["original_max_position_embeddings"])
    beta_fast = float(scaling.get("beta_fast") or 32)
    beta_slow = float(scaling.get("beta_slow") or 1)
    truncate = bool(scaling.get("truncate", True))
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = scaling.get("mscale"), scaling.get("mscale_all_dim")

        def get_mscale(scale: float, m: float = 1.0) -> float:
            return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

        attention_factor = (get_mscale(factor, mscale) / get_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else get_mscale(factor))

    def correction_dim(rotations: float) -> float:
        return head_dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no singular ramp
    pos_freqs = theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear", "yarn")


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
        cos_sin_scale = 1.0
        if rope_type == "llama3":
            inv_freq = llama3_inv_freq(inv_freq, scaling)
        elif rope_type == "yarn":
            inv_freq, cos_sin_scale = _yarn_inv_freq(head_dim, theta, scaling)
        positions = torch.arange(max_position, dtype=torch.float32)
        if rope_type == "linear":
            positions = positions / float(scaling["factor"])
        freqs = torch.outer(positions, inv_freq)
        # Not a parameter or persistent buffer: never in a checkpoint, moved with the module.
        self.register_buffer("cos_sin_cache", torch.cat([freqs.cos(), freqs.sin()], dim=-1) * cos_sin_scale,
                             persistent=False)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                kv_store: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                qk_norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq*D], k [T, Hkv*D] rotated at ``positions`` [T]. On CUDA in place, by one kernel.
        ``kv_store`` (v, k_cache, v_cache, loc): the rotated k and v are written into the paged
        cache at ``loc`` too (in the same kernel on CUDA). ``qk_norm``: every head of q and k is
        normalised first (in the same kernel on CUDA)."""
        if q.is_cuda:
            from plait.layers.triton_ops import rotary_

            return rotary_(positions, q, k, self.cos_sin_cache, self.head_dim, kv_store, qk_norm)
        if qk_norm is not None:
            t, d = q.shape[0], self.head_dim
            q = rms_norm_native(q.reshape(t, -1, d), qk_norm.q_weight, qk_norm.eps).view(t, -1)
            k = rms_norm_native(k.reshape(t, -1, d), qk_norm.k_weight, qk_norm.eps).view(t, -1)
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
