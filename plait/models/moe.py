"""Mixture-of-experts decoders on the Llama skeleton: Qwen2-MoE, Qwen3-MoE and Mixtral (gpt-oss is
in ``gpt_oss.py``, on the same base).

A layer's MLP is a ``SparseMoeBlock`` (plait.layers.moe.layer) or, where the config says so, the
dense ``LlamaMLP`` (Qwen's ``mlp_only_layers`` / ``decoder_sparse_step``). Checkpoints name experts
one by one (``mlp.experts.{e}.gate_proj.weight``; Mixtral ``block_sparse_moe.experts.{e}.w1.weight``)
or, as transformers 5 holds them in memory (the dummy loader's names), fused per layer
(``mlp.experts.gate_up_proj`` [E, 2I, H] gate rows first, ``mlp.experts.down_proj`` [E, H, I]);
both load into ``FusedMoE``, which keeps only this rank's experts and intermediate shard.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.forward_batch import ForwardBatch
from plait.layers.moe.fp8 import Fp8MoEMethod
from plait.layers.moe.layer import FusedMoE, SparseMoeBlock
from plait.layers.moe.router import RouterConfig
from plait.layers.quantization.fp8_kernels import FP8_DTYPE
from plait.models.llama import (
    DecoderConfig,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    ShardedMLPModule,
)
from plait.models.qwen3 import Qwen3Attention

# ``{prefix}.experts.{e}.{projection}.{weight|bias}`` -> FusedMoE.load_expert_*
_PER_EXPERT = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj|w1|w2|w3)"
                         r"\.(?P<kind>weight|bias|weight_scale_inv|weight_scale)$")
# ``{prefix}.experts.{gate_up_proj|down_proj}{suffix}``: the fused per-layer tensors
_FUSED = re.compile(r"^(?P<experts>.+\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)"
                    r"(?P<suffix>|_bias|_blocks|_scales)$")
_PROJ = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down", "w2": "down"}


def expert_weight_as_stored(name: str, tensor: Any, experts: FusedMoE) -> Any:
    """A checkpoint expert weight in the dtype ``experts`` stores: FP8 as it is for block-FP8
    experts (which refuse weights that are not FP8: they would need scales), else cast."""
    want = experts.w13_weight.dtype
    if want == FP8_DTYPE and tensor.dtype != FP8_DTYPE:  # LazySlice.dtype too
        raise ValueError(f"checkpoint tensor {name!r} is {tensor.dtype}, but the checkpoint declares FP8 experts "
                         "(quantization_config weight_block_size [128, 128]): want float8_e4m3fn with its "
                         "weight_scale_inv")
    return tensor if tensor.dtype == want else tensor.to(want)


def num_experts_of(cfg: Any) -> int:
    return int(getattr(cfg, "num_experts", None) or cfg.num_local_experts)


def moe_intermediate_of(cfg: Any) -> int:
    """Each expert's intermediate size (Qwen: ``moe_intermediate_size``; Mixtral, gpt-oss: the
    config's ``intermediate_size``)."""
    return int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size)


def is_sparse_layer(cfg: Any, layer_id: int) -> bool:
    """Qwen-MoE's rule: experts unless ``mlp_only_layers`` lists the layer, on every
    ``decoder_sparse_step``-th layer; every layer for configs without those fields."""
    if layer_id in (getattr(cfg, "mlp_only_layers", None) or []):
        return False
    step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
    return num_experts_of(cfg) > 0 and (layer_id + 1) % step == 0


def moe_mlp_params(cfg: Any) -> int:
    """Parameters of every layer's MLP (routed experts, router, shared expert, dense layers): for
    memory budgets and benchmark floors, from the config alone."""
    h, e = int(cfg.hidden_size), num_experts_of(cfg)
    inter = moe_intermediate_of(cfg)
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    biased = cfg.model_type == "gpt_oss"
    sparse = 3 * e * h * inter + e * h + (e * (3 * inter + h) + e if biased else 0)
    if shared:
        sparse += 3 * h * shared + h
    dense = 3 * h * int(cfg.intermediate_size)
    return sum(sparse if is_sparse_layer(cfg, i) else dense for i in range(int(cfg.num_hidden_layers)))


def active_mlp_params(cfg: Any) -> int:
    """Parameters one token reads in every layer's MLP (top-k experts, router, shared expert, dense
    layers): the active parameters of the FLOP floor."""
    h, k = int(cfg.hidden_size), int(cfg.num_experts_per_tok)
    inter = moe_intermediate_of(cfg)
    shared = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
    sparse = 3 * k * h * inter + num_experts_of(cfg) * h + (3 * h * shared if shared else 0)
    dense = 3 * h * int(cfg.intermediate_size)
    return sum(sparse if is_sparse_layer(cfg, i) else dense for i in range(int(cfg.num_hidden_layers)))


class MoEDecoderLayer(LlamaDecoderLayer):
    """Builds a ``SparseMoeBlock`` (or the dense MLP) from the model class's routing description."""

    # Set per architecture by the model class (see MoEForCausalLM.decoder_for).
    ep_size: int = 1
    moe_a2a_backend: str = "none"
    scoring: str = "softmax_topk"
    activation: str = "silu"
    expert_bias: bool = False
    router_bias: bool = False

    def build_mlp(self, cfg: DecoderConfig, layer_id: int, tp: TPGroup) -> ShardedMLPModule:
        if not is_sparse_layer(cfg, layer_id):
            return LlamaMLP(cfg, tp, bias=False)
        num_experts = num_experts_of(cfg)
        renormalize = bool(getattr(cfg, "norm_topk_prob", False)) or cfg.model_type == "mixtral"
        router = RouterConfig(num_experts, int(cfg.num_experts_per_tok), self.scoring, renormalize)
        experts = FusedMoE(num_experts, cfg.hidden_size, moe_intermediate_of(cfg), tp, self.ep_size,
                           self.activation, self.expert_bias)
        shared_size = int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0)
        all_to_all = self.moe_a2a_backend == "all_to_all"
        # All-to-all: each rank runs the shared expert on its own tokens, so it holds all of it.
        shared = (LlamaMLP(cfg, SINGLE if all_to_all else tp, bias=False, intermediate_size=shared_size)
                  if shared_size else None)
        return SparseMoeBlock(router, experts, cfg.hidden_size, tp, self.router_bias, shared, all_to_all)

    def run_mlp(self, hidden: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """An all-to-all MoE layer's dispatching steps: under DP attention it routes this rank's own
        rows (no gather), under plain TP its slice of the replicated rows. Other steps and dense
        layers take the gather path."""
        mlp = self.mlp
        if isinstance(mlp, SparseMoeBlock) and mlp.dispatches_all_to_all(hidden, fb):
            return mlp.forward_own_tokens(hidden) if self.dp_group is not None else mlp.forward_scattered(hidden)
        return super().run_mlp(hidden, fb)


class MoEForCausalLM(LlamaForCausalLM):
    """The loading side of every MoE architecture; subclasses say how their layers route."""

    is_moe = True  # load_model passes ep_size only to these
    decoder_base: type[LlamaDecoderLayer] = MoEDecoderLayer
    # checkpoint name fragment -> plait's (Mixtral: ``block_sparse_moe`` -> ``mlp``)
    renames: tuple[tuple[str, str], ...] = ()

    def __init__(self, cfg: DecoderConfig, tp: TPGroup = SINGLE, attn_tp: TPGroup | None = None,
                 ep_size: int = 1, moe_a2a_backend: str = "none") -> None:
        if ep_size < 1:
            raise ValueError(f"ep_size must be >= 1, got {ep_size}")
        # Set before nn.Module's init: LlamaForCausalLM's init reads layer_cls.
        self.ep_size = ep_size
        self.moe_a2a_backend = moe_a2a_backend
        super().__init__(cfg, tp, attn_tp)

    @property
    def layer_cls(self) -> type[LlamaDecoderLayer]:  # type: ignore[override]
        return type(f"{type(self).__name__}DecoderLayer", (self.decoder_base,),
                    {"ep_size": self.ep_size, "moe_a2a_backend": self.moe_a2a_backend})

    def rename(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name

    def load_fused_experts(self, experts: FusedMoE, proj: str, suffix: str, tensor: Any) -> None:
        """transformers 5's fused per-layer tensors (Qwen, Mixtral layout)."""
        if suffix:
            raise ValueError(f"unexpected fused expert tensor {proj}{suffix} for {type(self).__name__}")
        inter = tensor.shape[1] // 2 if proj == "gate_up_proj" else tensor.shape[2]
        for e in range(experts.num_experts):
            if experts.local_expert(e) is None:
                continue
            w = tensor.narrow(0, e, 1)[0]
            if proj == "gate_up_proj":  # [2I, H]: gate rows, then up rows
                experts.load_expert_weight(e, "gate", w[:inter])
                experts.load_expert_weight(e, "up", w[inter:])
            else:  # [H, I]
                experts.load_expert_weight(e, "down", w)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        loaded: set[str] = set()

        def rest() -> Iterator[tuple[str, torch.Tensor]]:
            for raw, tensor in weights:
                name = self.rename(raw)
                per_expert = _PER_EXPERT.match(name)
                fused = None if per_expert else _FUSED.match(name)
                match = per_expert or fused
                if match is None:
                    yield self.route_other(name, tensor, loaded)
                    continue
                experts = self.get_submodule(match["experts"])
                if not isinstance(experts, FusedMoE):
                    raise ValueError(f"checkpoint tensor {raw!r} names experts, but {match['experts']} is not a "
                                     "mixture-of-experts layer here")
                if per_expert:
                    e, which = int(per_expert["e"]), _PROJ[per_expert["proj"]]
                    if per_expert["kind"] == "weight":
                        experts.load_expert_weight(e, which, expert_weight_as_stored(raw, tensor, experts))
                    elif per_expert["kind"] in ("weight_scale_inv", "weight_scale"):
                        method = experts.quant_method
                        if not isinstance(method, Fp8MoEMethod) or method.config.scale_name != per_expert["kind"]:
                            raise ValueError(f"checkpoint tensor {raw!r} is an FP8 scale, but the checkpoint's "
                                             "quantization_config does not declare FP8 experts with such scales")
                        method.load_expert_scale(experts, e, which, tensor, raw)
                    else:
                        bias_dtype = experts.w13_bias.dtype if experts.w13_bias is not None else torch.float32
                        experts.load_expert_bias(e, which, tensor.to(bias_dtype))
                else:
                    assert fused is not None
                    self.load_fused_experts(experts, fused["proj"], fused["suffix"], tensor)
                prefix = match["experts"]
                loaded.update(f"{prefix}.{p}" for p, _ in experts.named_parameters())

        loaded |= super().load_weights(item for item in rest() if item is not None)
        return loaded

    def route_other(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> tuple[str, torch.Tensor] | None:
        """A non-expert tensor: passed on to the dense loader (None: the subclass loaded it)."""
        return name, tensor


class Qwen2MoeForCausalLM(MoEForCausalLM):
    """Qwen2-MoE: softmax top-k routing (``norm_topk_prob``), a shared expert with a sigmoid gate,
    q/k/v biases."""

    @staticmethod
    def attention_biases(cfg: DecoderConfig) -> tuple[bool, bool]:
        return bool(getattr(cfg, "qkv_bias", True)), False


class Qwen3MoeDecoderLayer(MoEDecoderLayer):
    attention_cls = Qwen3Attention


class Qwen3MoeForCausalLM(MoEForCausalLM):
    """Qwen3-MoE: Qwen3 attention (per-head q/k RMSNorm), softmax top-k routing with
    ``norm_topk_prob``, dense layers per ``mlp_only_layers`` / ``decoder_sparse_step``."""

    decoder_base = Qwen3MoeDecoderLayer


class MixtralForCausalLM(MoEForCausalLM):
    """Mixtral: softmax over the experts, top-2 renormalised, the config's sliding window."""

    renames = ((".block_sparse_moe.", ".mlp."),)
