"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from plait.models.gpt_oss import GptOssForCausalLM
from plait.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from plait.models.moe import MixtralForCausalLM, Qwen2MoeForCausalLM, Qwen3MoeForCausalLM
from plait.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
    "Qwen2MoeForCausalLM": Qwen2MoeForCausalLM,
    "Qwen3MoeForCausalLM": Qwen3MoeForCausalLM,
    "MixtralForCausalLM": MixtralForCausalLM,
    "GptOssForCausalLM": GptOssForCausalLM,
}

# Checkpoint quantization methods a model class dequantizes at load (others are refused).
DEQUANTIZED_AT_LOAD: dict[str, tuple[str, ...]] = {"GptOssForCausalLM": ("mxfp4",)}

# Config fields that mark a mixture-of-experts model (for the error naming an unsupported one).
MOE_CONFIG_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(MODEL_REGISTRY))
