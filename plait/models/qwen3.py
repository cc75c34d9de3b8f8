"""Qwen3: the Llama decoder plus a per-head RMSNorm on q and k before rotary (on CUDA inside the
rotary kernel: one launch normalises, rotates and stores K/V)."""

from __future__ import annotations

import torch

from plait.distributed.parallel_state import TPGroup
from plait.layers.norm import RMSNorm
from plait.layers.rotary import QKNorm
from plait.models.llama import DecoderConfig, LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM


class Qwen3Attention(LlamaAttention):
    def __init__(self, cfg: DecoderConfig, layer_id: int, tp: TPGroup, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__(cfg, layer_id, tp, qkv_bias, o_bias)
        self.q_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, cfg.rms_norm_eps)

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if q.is_cuda:  # the rotary kernel normalises both first, in its own launch (rope_qk_norm)
            return q, k
        t = q.shape[0]
        q = self.q_norm(q.reshape(t, -1, self.head_dim)).view(t, -1)
        k = self.k_norm(k.reshape(t, -1, self.head_dim)).view(t, -1)
        return q, k


    def rope_qk_norm(self, q: torch.Tensor) -> QKNorm | None:
        # q_norm and k_norm share eps (the config's rms_norm_eps).
        return QKNorm(self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if q.is_cuda else None


class Qwen3DecoderLayer(LlamaDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3ForCausalLM(LlamaForCausalLM):
    layer_cls = Qwen3DecoderLayer
