"""The attention layer a model calls: shapes plus a call into the batch's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from plait.forward_batch import ForwardBatch
from plait.layers.rotary import QKNorm, RotaryEmbedding


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, logit_cap: float = 0.0, sliding_window: int | None = None,
                 sinks: bool = False) -> None:
        """``sinks``: the layer has per-head attention sinks (gpt-oss), a learned logit per query head
        on this rank (``sinks`` [num_heads], in the model dtype) that joins the softmax denominator
        and attends to nothing."""
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.logit_cap = logit_cap
        self.sliding_window = sliding_window
        # FP8 KV cache multipliers (stored = k / k_scale), from the checkpoint when it has them
        # (plait.layers.quantization.kv_cache); read by the KV pool only when it stores FP8.
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.sinks: nn.Parameter | None
        self.register_parameter(
            "sinks", nn.Parameter(torch.empty(num_heads), requires_grad=False) if sinks else None)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch,
                rope: RotaryEmbedding | None = None, positions: torch.Tensor | None = None,
                qk_norm: QKNorm | None = None) -> torch.Tensor:
        """Attention over the batch's KV; with ``rope`` (and ``positions``) q and k are rotated first
        (normalised per head before that with ``qk_norm``, in the rotary kernel), and when the serving
        backend stores K/V plainly into the paged pool, the rotary kernel writes them there itself
        (one kernel fewer per layer)."""
        backend = fb.attn_backend
        assert backend is not None, "the model runner sets fb.attn_backend before forward"
        if rope is None:
            return backend.forward(q, k, v, self, fb)
        assert positions is not None
        target = backend.rope_kv_store_target(self, fb)
        if target is None:
            q, k = rope(positions, q, k, qk_norm=qk_norm)
            return backend.forward(q, k, v, self, fb)
        q, k = rope(positions, q, k, kv_store=(v, target[0], target[1], fb.out_cache_loc), qk_norm=qk_norm)
        return backend.forward(q, k, v, self, fb, save_kv_cache=False)


def model_sliding_windows(model: nn.Module) -> tuple[int, ...]:
    """The distinct windows of the model's windowed attention layers, ascending (empty when every
    layer is full). Layers may differ: each backend applies a layer's own window."""
    return tuple(sorted({m.sliding_window for m in model.modules()
                         if isinstance(m, RadixAttention) and m.sliding_window}))


def model_kv_scales(model: nn.Module) -> tuple[list[float], list[float]]:
    """Per-layer ``(k_scales, v_scales)`` of the model's attention layers, by layer id (the FP8 KV
    pool's multipliers: the checkpoint's, or 1.0)."""
    layers = sorted((m for m in model.modules() if isinstance(m, RadixAttention)), key=lambda m: m.layer_id)
    return [m.k_scale for m in layers], [m.v_scale for m in layers]


def model_has_sinks(model: nn.Module) -> bool:
    """Whether any attention layer of the model has attention sinks."""
    return any(isinstance(m, RadixAttention) and m.sinks is not None for m in model.modules())
