"""gpt-oss (GptOssForCausalLM), checked detail by detail against transformers' implementation:

- attention: q/k/v/o with biases, per-head attention sinks, sliding-window (``sliding_window``,
  128) and full layers alternating per ``layer_types`` (layer 0 sliding), YaRN rotary;
- router: a biased linear; top-k of the logits, then a softmax over the k chosen;
- experts: ``gate_up_proj`` [E, H, 2I] with gate and up interleaved in even / odd columns
  (de-interleaved at load into plait's gate-rows-then-up-rows ``w13``), ``down_proj`` [E, I, H],
  biases on both; activation ``(clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g)``, g = clamp(gate, max=7).

Published checkpoints store the expert projections as MXFP4 (``*_blocks`` + ``*_scales``, rows in
the layout above before transformers' transpose: gate_up [E, 2I, H], down [E, H, I]); they are
dequantized at load into the model dtype (plait.models.mxfp4).
"""

from __future__ import annotations

from typing import Any

import torch

from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.layers.moe.layer import FusedMoE
from plait.models.llama import DecoderConfig, LlamaAttention
from plait.models.moe import MoEDecoderLayer, MoEForCausalLM
from plait.models.mxfp4 import dequantize_mxfp4


class GptOssAttention(LlamaAttention):
    has_sinks = True


class GptOssDecoderLayer(MoEDecoderLayer):
    attention_cls = GptOssAttention
    scoring = "topk_softmax"
    activation = "swiglu_oai"
    expert_bias = True
    router_bias = True


def _materialize(t: Any) -> torch.Tensor:
    return t if isinstance(t, torch.Tensor) else t[:]


class GptOssForCausalLM(MoEForCausalLM):
    decoder_base = GptOssDecoderLayer
    renames = ((".mlp.router.", ".mlp.gate."),)

    def __init__(self, cfg: DecoderConfig, tp: TPGroup = SINGLE, attn_tp: TPGroup | None = None,
                 ep_size: int = 1, moe_a2a_backend: str = "none") -> None:
        limit, alpha = float(getattr(cfg, "swiglu_limit", 7.0)), float(getattr(cfg, "swiglu_alpha", 1.702))
        if (limit, alpha) != (7.0, 1.702):
            raise ValueError(f"gpt-oss with swiglu_limit {limit} / swiglu_alpha {alpha} is not supported "
                             "(plait's kernels implement 7.0 / 1.702)")
        self.attn_tp = attn_tp or tp
        # MXFP4 halves of one expert tensor, kept until both arrived: (layer prefix, proj) -> {part: tensor}
        self._pending_mxfp4: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
        super().__init__(cfg, tp, attn_tp, ep_size, moe_a2a_backend)

    @staticmethod
    def attention_biases(cfg: DecoderConfig) -> tuple[bool, bool]:
        bias = bool(getattr(cfg, "attention_bias", True))
        return bias, bias

    def route_other(self, name: str, tensor: torch.Tensor, loaded: set[str]) -> tuple[str, torch.Tensor] | None:
        if not name.endswith(".self_attn.sinks"):
            return name, tensor
        target = name.replace(".self_attn.sinks", ".self_attn.attn.sinks")
        param = self.get_parameter(target)
        n = param.shape[0]
        # copy_ on the parameter (not .data) bumps its _version, so the backends' fp32 sink cache
        # sees a reload (plait.attention.sinks).
        with torch.no_grad():
            param.copy_(tensor.narrow(0, self.attn_tp.rank * n, n).to(param.dtype))
        loaded.add(target)
        return None

    def load_fused_experts(self, experts: FusedMoE, proj: str, suffix: str, tensor: Any) -> None:
        dtype = experts.w13_weight.dtype
        if suffix in ("_blocks", "_scales"):
            key = (str(id(experts)), proj)
            parts = self._pending_mxfp4.setdefault(key, {})
            parts[suffix] = _materialize(tensor)
            if len(parts) < 2:
                return
            del self._pending_mxfp4[key]
            # Dequantized rows: gate_up [E, 2I, H] (gate even rows, up odd rows), down [E, H, I].
            full = dequantize_mxfp4(parts["_blocks"], parts["_scales"], dtype)
            for e in range(experts.num_experts):
                if experts.local_expert(e) is None:
                    continue
                if proj == "gate_up_proj":
                    experts.load_expert_weight(e, "gate", full[e, 0::2])
                    experts.load_expert_weight(e, "up", full[e, 1::2])
                else:
                    experts.load_expert_weight(e, "down", full[e])
            return
        for e in range(experts.num_experts):
            if experts.local_expert(e) is None:
                continue
            t = tensor.narrow(0, e, 1)[0].to(dtype)
            if proj == "gate_up_proj" and suffix == "":  # [H, 2I], interleaved columns
                experts.load_expert_weight(e, "gate", t[:, 0::2].t())
                experts.load_expert_weight(e, "up", t[:, 1::2].t())
            elif proj == "gate_up_proj":  # bias [2I], interleaved
                experts.load_expert_bias(e, "gate", t[0::2])
                experts.load_expert_bias(e, "up", t[1::2])
            elif suffix == "":  # down [I, H]
                experts.load_expert_weight(e, "down", t.t())
            else:  # down bias [H]
                experts.load_expert_bias(e, "down", t)

    def load_weights(self, weights: Any) -> set[str]:
        loaded = super().load_weights(weights)
        if self._pending_mxfp4:
            raise ValueError(f"MXFP4 expert tensors without their other half: {sorted(self._pending_mxfp4)}")
        return loaded
