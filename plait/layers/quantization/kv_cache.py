"""Checkpoint KV-cache scales: ``self_attn.k_scale`` / ``self_attn.v_scale`` (and the older single
``self_attn.kv_scale``, and ModelOpt's ``self_attn.k_proj.k_scale`` / ``v_proj.v_scale``) are the
per-layer multipliers of an FP8 KV cache (``stored = k / k_scale``). They land on the layer's
``RadixAttention`` (``self_attn.attn``) as Python floats; the KV pool applies them only when it stores
FP8 (plait.mem.pools)."""

from __future__ import annotations

import re

import torch
from torch import nn

_KV_SCALE = re.compile(r"^(?P<prefix>.*\.self_attn)\.(?:[kv]_proj\.)?(?P<which>k_scale|v_scale|kv_scale)$")


def load_kv_scale(model: nn.Module, name: str, tensor: torch.Tensor) -> bool:
    """If ``name`` is a KV-cache scale, set it on its attention layer and return True."""
    match = _KV_SCALE.match(name)
    if match is None:
        return False
    attn = model.get_submodule(match["prefix"] + ".attn")
    if not isinstance(tensor, torch.Tensor):  # a tensor-parallel LazySlice
        tensor = tensor.materialize()
    value = float(tensor.reshape(-1).float().max())
    if value <= 0 or value != value:
        raise ValueError(f"{name}: a KV-cache scale must be a positive number, got {value}")
    which = match["which"]
    if which in ("k_scale", "kv_scale"):
        attn.k_scale = value
    if which in ("v_scale", "kv_scale"):
        attn.v_scale = value
    return True
