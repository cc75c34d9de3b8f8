"""Llama-family decoder: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM (qkv bias).

Qwen3 (per-head q/k RMSNorm) subclasses the attention in ``qwen3.py``. Weight names follow the
Hugging Face checkpoints; q/k/v and gate/up land in fused projections through
``packed_modules_mapping``.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from plait.distributed.dp_mlp import dp_gathered_mlp, dp_mlp_ops
from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.forward_batch import ForwardBatch
from plait.layers.activation import SiluAndMul
from plait.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from plait.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from plait.layers.logits import LogitsProcessor
from plait.layers.norm import RMSNorm
from plait.layers.overlap import LayerOps, run_overlapped
from plait.layers.quantization.kv_cache import load_kv_scale
from plait.layers.radix_attention import RadixAttention
from plait.layers.rotary import QKNorm, RotaryEmbedding, rope_settings


@dataclass
class LogitsOutput:
    next_token_logits: torch.Tensor  # [num_sampled, vocab] float32
    hidden_states: torch.Tensor | None = None  # final hidden states of the sampled rows (for drafts)
    # int64 [num_sampled]: the logits' argmax, when the forward computed it (TARGET_VERIFY graphs do,
    # inside the graph: acceptance then launches nothing before its copy to the host).
    greedy_ids: torch.Tensor | None = None


class DecoderConfig(Protocol):
    """The fields of a model config (Hugging Face's, or an EAGLE head's config.json) the decoder reads
    directly. Optional ones (head_dim, sliding_window, layer_types, attention_bias, mlp_bias,
    tie_word_embeddings, the rope settings) are read with getattr and a default."""

    hidden_size: int
    intermediate_size: int
    max_position_embeddings: int
    num_attention_heads: int
    num_hidden_layers: int
    num_key_value_heads: int
    rms_norm_eps: float
    vocab_size: int


def sliding_window_of(cfg: DecoderConfig, layer_id: int) -> int | None:
    """The layer's attention window: ``layer_types`` when the config has them (Qwen2/3: only
    "sliding_attention" layers), else Mistral's model-wide ``sliding_window``."""
    window = getattr(cfg, "sliding_window", None)
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is not None:
        return window if layer_types[layer_id] == "sliding_attention" else None
    return window


def head_dim_of(cfg: DecoderConfig) -> int:
    return getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads


class LlamaAttention(nn.Module):
    # Per-head attention sinks (gpt-oss): a learned logit per query head that joins the softmax
    # denominator; the RadixAttention holds the parameter.
    has_sinks = False

    def __init__(self, cfg: DecoderConfig, layer_id: int, tp: TPGroup, qkv_bias: bool, o_bias: bool) -> None:
        super().__init__()
        self.head_dim = head_dim_of(cfg)
        self.qkv_proj = QKVParallelLinear(cfg.hidden_size, self.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, bias=qkv_bias, tp=tp)
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * self.head_dim, cfg.hidden_size,
                                        bias=o_bias, tp=tp)
        theta, scaling = rope_settings(cfg)
        self.rotary_emb = RotaryEmbedding(self.head_dim, cfg.max_position_embeddings, theta, scaling)
        self.attn = RadixAttention(layer_id, self.num_heads, self.num_kv_heads, self.head_dim,
                                   scaling=self.head_dim**-0.5, sliding_window=sliding_window_of(cfg, layer_id),
                                   sinks=self.has_sinks)

    def qk_transform(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Hook before rotary (Qwen3 normalizes each head here off CUDA)."""
        return q, k

    def rope_qk_norm(self, q: torch.Tensor) -> QKNorm | None:
        """A per-head q/k norm for the rotary kernel to apply first (Qwen3 on CUDA), or None."""
        return None

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        # q, k and v stay views into the fused projection's output (row stride q_size + 2 * kv_size):
        # the rotary kernel, the KV stores and every backend take strided rows, so nothing is copied.
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_transform(q, k)
        return self.o_proj(self.attn(q, k, v, fb, rope=self.rotary_emb, positions=positions,
                                     qk_norm=self.rope_qk_norm(q)))

    def forward_partial(self, positions: torch.Tensor, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """This rank's unreduced, bias-free output projection (the caller reduces, then adds
        ``o_proj.add_bias``)."""
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.qk_transform(q, k)
        return self.o_proj.partial(self.attn(q, k, v, fb, rope=self.rotary_emb, positions=positions,
                                             qk_norm=self.rope_qk_norm(q)))


class LlamaMLP(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TPGroup, bias: bool, intermediate_size: int | None = None) -> None:
        """``intermediate_size``: another width than the config's (a MoE model's shared expert)."""
        super().__init__()
        inter = intermediate_size or cfg.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(cfg.hidden_size, [inter] * 2, bias=bias, tp=tp)
        self.down_proj = RowParallelLinear(inter, cfg.hidden_size, bias=bias, tp=tp)
        self.act_fn = SiluAndMul()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's unreduced, bias-free down projection (the caller reduces, then adds
        ``add_bias``)."""
        return self.down_proj.partial(self.act_fn(self.gate_up_proj(x)))

    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor:
        return self.down_proj.add_bias(reduced)


class ShardedMLPModule(Protocol):
    """A decoder layer's MLP: called whole (it reduces over its TP group itself), or as this rank's
    partial sums plus ``add_bias`` (DP attention reduces them its own way)."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...
    def forward_partial(self, x: torch.Tensor) -> torch.Tensor: ...
    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor: ...


class LlamaDecoderLayer(nn.Module):
    attention_cls: type[LlamaAttention] = LlamaAttention

    def __init__(self, cfg: DecoderConfig, layer_id: int, tp: TPGroup, qkv_bias: bool, o_bias: bool,
                 attn_tp: TPGroup | None = None) -> None:
        super().__init__()
        # DP attention: attention runs unsharded on each rank's own tokens (attn_tp of size 1) while
        # the MLP is sharded over all ranks, so the tokens of every rank meet around it.
        attn_tp = attn_tp or tp
        self.dp_group = tp if attn_tp.size != tp.size else None
        self.tp = tp  # the group of both sums of forward_ops under tensor parallelism
        self.self_attn = self.attention_cls(cfg, layer_id, attn_tp, qkv_bias, o_bias)
        self.mlp = self.build_mlp(cfg, layer_id, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def build_mlp(self, cfg: DecoderConfig, layer_id: int, tp: TPGroup) -> ShardedMLPModule:
        """The layer's MLP (mixture-of-experts decoders build theirs here)."""
        return LlamaMLP(cfg, tp, bias=bool(getattr(cfg, "mlp_bias", False)))

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, fb)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.run_mlp(hidden, fb), residual

    def run_mlp(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The MLP over this rank's rows: under DP attention around the gather of every rank's rows,
        else whole (it reduces over its TP group itself)."""
        if self.dp_group is not None:
            return dp_gathered_mlp(self.mlp, hidden, fb, self.dp_group)
        return self.mlp(hidden)

    def forward_ops(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                    fb: ForwardBatch) -> LayerOps:
        """The same forward cut at its collectives: yields each one to launch and is sent its result
        (``plait.layers.overlap`` runs two batches' ops interleaved, one's collective in flight while
        the other computes). Tensor parallelism: the two sums (the attention output projection's, the
        MLP's down projection's). DP attention: attention has none (it runs on this rank's own
        requests); the MLP's gather and reduce-scatter (``dp_mlp_ops``). An IDLE micro-batch (a DP
        rank's empty half) has no rows to attend over and joins the MLP's collectives only."""
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if self.dp_group is not None:
            if not fb.forward_mode.is_idle():
                hidden = self.self_attn(positions, hidden, fb)
        else:
            partial = self.self_attn.forward_partial(positions, hidden, fb)
            hidden = self.self_attn.o_proj.add_bias((yield functools.partial(self.tp.all_reduce_start, partial)))
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        if self.dp_group is not None:
            return (yield from dp_mlp_ops(self.mlp, hidden, fb, self.dp_group)), residual
        partial = self.mlp.forward_partial(hidden)
        return self.mlp.add_bias((yield functools.partial(self.tp.all_reduce_start, partial))), residual


class LlamaModel(nn.Module):
    def __init__(self, cfg: DecoderConfig, tp: TPGroup, layer_cls: type[LlamaDecoderLayer], qkv_bias: bool,
                 o_bias: bool, attn_tp: TPGroup | None = None) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, attn_tp or tp)
        self.layers = nn.ModuleList(
            layer_cls(cfg, i, tp, qkv_bias, o_bias, attn_tp) for i in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        cap = fb.hidden_capture  # EAGLE's target hidden states: written here, so graph replays write them
        if cap is not None:
            cap.begin(hidden.shape[0])
        for i, layer in enumerate(self.layers):
            if cap is not None and i in cap.slots:  # layer i's residual-stream input
                cap.store(i, hidden if residual is None else hidden + residual)
            hidden, residual = layer(positions, hidden, residual, fb)
        hidden, _ = self.norm(hidden, residual)
        if cap is not None and -1 in cap.slots:
            cap.store(-1, hidden)
        return hidden

    def forward_two_batches(self, fb: ForwardBatch) -> torch.Tensor:
        """``forward`` over ``fb``'s two TBO children, layer by layer: child A's layer, then child
        B's (B's first request may continue A's last: A's KV of each layer is stored before B
        attends). Returns the parent's hidden states [T, H], the children's rows concatenated."""
        assert fb.tbo_children is not None
        a, b = fb.tbo_children
        hidden = [self.embed_tokens(a.input_ids), self.embed_tokens(b.input_ids)]
        residual: list[torch.Tensor | None] = [None, None]
        cap = fb.hidden_capture
        if cap is not None:
            cap.begin(fb.num_tokens)
        for i, layer in enumerate(self.layers):
            if cap is not None and i in cap.slots:
                cap.store(i, torch.cat([h if r is None else h + r for h, r in zip(hidden, residual, strict=True)]))
            (hidden[0], residual[0]), (hidden[1], residual[1]) = run_overlapped(
                layer.forward_ops(a.positions, hidden[0], residual[0], a),
                layer.forward_ops(b.positions, hidden[1], residual[1], b))
        assert residual[0] is not None and residual[1] is not None, "a model has at least one layer"
        out, _ = self.norm(torch.cat(hidden), torch.cat([residual[0], residual[1]]))
        if cap is not None and -1 in cap.slots:
            cap.store(-1, out)
        return out


class LlamaForCausalLM(nn.Module):
    layer_cls: type[LlamaDecoderLayer] = LlamaDecoderLayer
    # checkpoint name fragment -> (fused parameter fragment, shard id)
    packed_modules_mapping: dict[str, tuple[str, str | int]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, cfg: DecoderConfig, tp: TPGroup = SINGLE, attn_tp: TPGroup | None = None) -> None:
        """``attn_tp``: the group of attention, embedding and LM head when it differs from the MLP's
        ``tp`` (DP attention: size 1, each rank embeds, attends and samples its own requests)."""
        super().__init__()
        self.config = cfg
        self.tp = tp
        head_tp = attn_tp or tp
        qkv_bias, o_bias = self.attention_biases(cfg)
        self.model = LlamaModel(cfg, tp, self.layer_cls, qkv_bias, o_bias, attn_tp)
        self.tie_word_embeddings = bool(getattr(cfg, "tie_word_embeddings", False))
        self.lm_head = None if self.tie_word_embeddings else ParallelLMHead(cfg.vocab_size, cfg.hidden_size, head_tp)
        self.logits_processor = LogitsProcessor(cfg.vocab_size, head_tp)

    @staticmethod
    def attention_biases(cfg: DecoderConfig) -> tuple[bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", False))
        return bias, bias

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> LogitsOutput:
        hidden = self.forward_hidden(input_ids, positions, fb) if fb.tbo_children is None \
            else self.model.forward_two_batches(fb)
        return self.compute_logits(hidden, fb)

    # The two halves of ``forward`` (a piecewise graph captures the first per token bucket and runs
    # the LM head eagerly over the live batch's rows).
    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """The final normed hidden states [T, H] of every token."""
        return self.model(input_ids, positions, fb)

    def compute_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> LogitsOutput:
        """The LM head over ``hidden``'s rows that ``fb`` samples or scores (``fb.logits_indices``)."""
        return LogitsOutput(next_token_logits=self.logits_processor(hidden, self.lm_head_weight, fb))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """Copy checkpoint tensors into parameters; returns the names of parameters loaded."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            if "rotary_emb.inv_freq" in name:
                continue
            if name == "lm_head.weight" and self.lm_head is None:
                continue  # tied: the embedding serves as the head
            if load_kv_scale(self, name, tensor):
                continue  # an FP8 KV-cache scale: a float on the layer's RadixAttention
            target, shard_id = name, None
            for ckpt, (fused, sid) in self.packed_modules_mapping.items():
                if f".{ckpt}." in name:
                    target, shard_id = name.replace(f".{ckpt}.", f".{fused}."), sid
                    break
            if target not in params:
                raise ValueError(f"checkpoint tensor {name!r} has no matching parameter in {type(self).__name__}")
            param = params[target]
            owner = self.get_submodule(target.rsplit(".", 1)[0])
            # A quantized layer's scales bring their own loader (plait.layers.quantization.fp8).
            loader = getattr(param, "weight_loader", None) or getattr(owner, "weight_loader", None)
            if loader is None:
                if param.shape != tensor.shape:
                    raise ValueError(
                        f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
                param.data.copy_(tensor)
            else:
                loader(param, tensor.to(param.dtype), shard_id)
            loaded.add(target)
        return loaded


class MistralForCausalLM(LlamaForCausalLM):
    pass


class Qwen2ForCausalLM(LlamaForCausalLM):
    @staticmethod
    def attention_biases(cfg: DecoderConfig) -> tuple[bool, bool]:
        return True, False  # Qwen2: q/k/v carry a bias, o_proj does not
