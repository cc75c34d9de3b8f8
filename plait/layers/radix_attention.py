"""The attention layer a model calls: shapes plus a call into the batch's attention backend."""

from __future__ import annotations

import torch
from torch import nn

from plait.forward_batch import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, layer_id: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scaling: float, logit_cap: float = 0.0) -> None:
        super().__init__()
        self.layer_id = layer_id
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scaling = scaling
        self.logit_cap = logit_cap

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        assert fb.attn_backend is not None, "the model runner sets fb.attn_backend before forward"
        return fb.attn_backend.forward(q, k, v, self, fb)
