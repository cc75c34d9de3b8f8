"""Architecture name (config.json ``architectures``) -> model class."""

from __future__ import annotations

from torch import nn

from plait.models.llama import LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM
from plait.models.qwen3 import Qwen3ForCausalLM

MODEL_REGISTRY: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": MistralForCausalLM,
    "Qwen2ForCausalLM": Qwen2ForCausalLM,
    "Qwen3ForCausalLM": Qwen3ForCausalLM,
}


def supported_architectures() -> tuple[str, ...]:
    return tuple(sorted(MODEL_REGISTRY))
