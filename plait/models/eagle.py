"""EAGLE and EAGLE3 draft heads over the target's hidden states, in their public
checkpoint formats (checked against SGLang's ``llama_eagle.py`` / ``llama_eagle3.py`` loaders, which
follow the EAGLE repository's ``cnets.py``).

EAGLE (``LlamaForCausalLMEagle``): ``fc`` [h, 2h] (+ bias) maps [embedding, target hidden state] to h;
``num_hidden_layers`` Llama decoder layers (``layers.N.*``), layer 0 without ``input_layernorm``;
the output is hidden + residual (no final norm). The embedding and the LM head are the target's.

EAGLE3 (``LlamaForCausalLMEagle3``): the target's residual-stream inputs of layers
[2, L//2, L-3] are concatenated (3 * target hidden) and ``fc`` [h, 3h] (bias only when config
``bias``) maps them to h; one decoder layer ``midlayer.*`` whose attention input is
[input_layernorm(embedding), hidden_norm(h)] (q, k, v take 2h) with the fc output as residual; its
own ``norm``; a reduced-vocabulary ``lm_head`` [draft_vocab_size, h]; ``d2t`` [draft_vocab_size]
offsets (target id = draft id + d2t[draft id]); ``t2d`` is not used. The embedding is the target's
unless the checkpoint ships ``embed_tokens.weight``.

Checkpoints ship ``model.safetensors`` or ``pytorch_model.bin``; ``.bin`` is read with
``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import pathlib
import types
from collections.abc import Iterator
from typing import cast

import torch
from torch import nn

from plait.forward_batch import ForwardBatch
from plait.layers.linear import QKVParallelLinear
from plait.layers.norm import RMSNorm
from plait.models.llama import DecoderConfig, LlamaDecoderLayer


def eagle3_capture_layers(num_target_layers: int) -> list[int]:
    """Target layers whose residual-stream *input* EAGLE3 concatenates (SGLang's choice)."""
    return [2, num_target_layers // 2, num_target_layers - 3]


def iter_checkpoint(path: str | pathlib.Path) -> Iterator[tuple[str, torch.Tensor]]:
    root = pathlib.Path(path)
    st = sorted(root.glob("*.safetensors"))
    if st:
        from safetensors.torch import load_file

        for f in st:
            yield from load_file(str(f)).items()
        return
    bins = sorted(root.glob("*.bin"))
    if not bins:
        raise FileNotFoundError(f"{path!r} holds no *.safetensors or *.bin draft-head weights")
    for f in bins:
        yield from torch.load(f, map_location="cpu", weights_only=True).items()


def load_head_config(path: str | pathlib.Path) -> DecoderConfig:
    """A head's config.json as attributes, with the Llama defaults the decoder layer reads; a field
    the file lacks and no default covers fails when read."""
    defaults = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
                "mlp_bias": False, "max_position_embeddings": 4096}
    fields = {**defaults, **json.loads((pathlib.Path(path) / "config.json").read_text())}
    return cast(DecoderConfig, types.SimpleNamespace(**fields))


class _Eagle3Layer(LlamaDecoderLayer):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__(cfg, 0, _single(), qkv_bias=False, o_bias=False)
        attn = self.self_attn
        attn.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, attn.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward_eagle3(self, positions: torch.Tensor, embeds: torch.Tensor, hidden: torch.Tensor,
                       fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, fb)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


def _single():
    from plait.distributed.parallel_state import SINGLE

    return SINGLE


_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


def _load_into(module: nn.Module, weights: Iterator[tuple[str, torch.Tensor]], skip: tuple[str, ...] = ()
               ) -> dict[str, torch.Tensor]:
    """Copy tensors into parameters (fusing q/k/v and gate/up); returns the tensors that are not
    parameters (buffers such as d2t) for the caller."""
    params = dict(module.named_parameters())
    extra: dict[str, torch.Tensor] = {}
    for name, tensor in weights:
        if name in skip:
            continue
        target, shard = name, None
        for ckpt, (fused, sid) in _PACKED.items():
            if f".{ckpt}." in name:
                target, shard = name.replace(f".{ckpt}.", f".{fused}."), sid
                break
        if target not in params:
            extra[name] = tensor
            continue
        param = params[target]
        owner = module.get_submodule(target.rsplit(".", 1)[0])
        loader = getattr(owner, "weight_loader", None)
        if loader is None or shard is None:
            if param.shape != tensor.shape:
                raise ValueError(f"{name}: checkpoint shape {tuple(tensor.shape)} != parameter {tuple(param.shape)}")
            param.data.copy_(tensor)
        else:
            loader(param, tensor.to(param.dtype), shard)
    return extra


class EagleHead(nn.Module):
    """EAGLE: embeddings and LM head are the target's (passed to ``forward``)."""

    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=bool(getattr(cfg, "bias", True)))
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, i, _single(), False, False)
                                    for i in range(cfg.num_hidden_layers))
        del self.layers[0].input_layernorm  # EAGLE's first layer reads the fc output unnormalised
        self.layers[0].input_layernorm = nn.Identity()

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        extra = _load_into(self, weights)
        unknown = set(extra) - {"embed_tokens.weight", "lm_head.weight"}
        if unknown:
            raise ValueError(f"EAGLE checkpoint tensors with no parameter: {sorted(unknown)}")

    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, target_hidden], dim=-1))
        residual = None
        for i, layer in enumerate(self.layers):
            if i == 0:
                residual = x
                x = layer.self_attn(positions, x, fb)
                x, residual = layer.post_attention_layernorm(x, residual)
                x = layer.mlp(x)
            else:
                x, residual = layer(positions, x, residual, fb)
        return x + residual


class Eagle3Head(nn.Module):
    def __init__(self, cfg: DecoderConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        target_h = getattr(cfg, "target_hidden_size", None) or h
        self.draft_vocab_size = getattr(cfg, "draft_vocab_size", None) or cfg.vocab_size
        self.fc = nn.Linear(3 * target_h, h, bias=bool(getattr(cfg, "bias", False)))
        self.midlayer = _Eagle3Layer(cfg)
        self.norm = RMSNorm(h, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(h, self.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.embed_tokens: nn.Embedding | None = None  # the target's unless the checkpoint has one

    def load_weights(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        extra = _load_into(self, weights, skip=("t2d",))
        if "d2t" in extra:
            self.d2t.copy_(extra.pop("d2t").to(torch.int64))
        if "embed_tokens.weight" in extra:
            self.embed_tokens = nn.Embedding.from_pretrained(extra.pop("embed_tokens.weight"), freeze=True)
        if extra:
            raise ValueError(f"EAGLE3 checkpoint tensors with no parameter: {sorted(extra)}")

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def forward(self, embeds: torch.Tensor, target_hidden: torch.Tensor, positions: torch.Tensor,
                fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """target_hidden: [T, 3 * target_h] (captured layers) or [T, h] (the head's own output at a
        later draft step). Returns (draft-vocab logits in float32, pre-norm hidden for the next step)."""
        hidden = self.fc(target_hidden) if target_hidden.shape[-1] != embeds.shape[-1] else target_hidden
        x, residual = self.midlayer.forward_eagle3(positions, embeds, hidden, fb)
        normed, pre_norm = self.norm(x, residual)
        return self.lm_head(normed).float(), pre_norm
