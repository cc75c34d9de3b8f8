"""What a ModelRunner is sized and placed by: the rank's device, the KV capacity the memory budget
allows, the TARGET_VERIFY widths to capture, and the EAGLE hidden-state capture. Pure functions of
the config and the model's config (and the device's free memory), so they are read without a runner.
"""

from __future__ import annotations

import gc

import torch

from plait.config import EngineConfig
from plait.distributed.parallel_state import TPGroup
from plait.layers.hidden_capture import HiddenCapture
from plait.mem.pools import MHATokenToKVPool, kv_cache_dtype
from plait.models.eagle import eagle3_capture_layers
from plait.models.loader import ModelConfig, weight_bytes

# On the CPU there is no device-memory query worth trusting: size the KV cache from this budget.
CPU_KV_BUDGET_BYTES = 256 << 20


def kv_capacity_tokens(config: EngineConfig, mc: ModelConfig, device: str, tp_size: int = 1,
                       draft: ModelConfig | None = None) -> int:
    """KV slots from the memory budget: after the weights are loaded, ``mem_fraction_static`` of the
    device memory (minus what is already used) goes to the KV cache; ``max_total_tokens`` caps it.

    ``draft``: a STANDALONE draft model, loaded later, unsharded, with a KV pool of the same slot count
    (its slots mirror the target's): its weights come off the budget and its per-token bytes are
    added, so both pools fit."""
    # Bytes per token of the pool's own storage: an FP8 cache (--kv-cache-dtype) fits twice the tokens.
    per_token = MHATokenToKVPool.bytes_per_token(kv_cache_dtype(config.kv_cache_dtype, mc.dtype), mc.num_layers,
                                                 mc.num_kv_heads_per_rank(tp_size), mc.head_dim)
    draft_weights = 0
    if draft is not None:
        per_token += MHATokenToKVPool.bytes_per_token(draft.dtype, draft.num_layers, draft.num_kv_heads,
                                                      draft.head_dim)
        draft_weights = weight_bytes(draft)
    if device == "cuda":
        # An earlier engine of this process may be unreachable but not yet collected (its runner,
        # graph runner and backend form reference cycles), and freed blocks stay in the caching
        # allocator: both would count as used below unless released first.
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info()
        used = total - free
        budget = total * config.mem_fraction_static - used - draft_weights
    else:
        budget = CPU_KV_BUDGET_BYTES
    tokens = int(budget // per_token)
    if config.max_total_tokens is not None:
        tokens = min(tokens, config.max_total_tokens) if device == "cuda" else config.max_total_tokens
    if tokens < 16:
        raise RuntimeError(
            f"not enough memory for the KV cache ({tokens} tokens of {per_token} bytes fit); raise "
            f"mem_fraction_static (now {config.mem_fraction_static}), use a smaller model or dtype"
        )
    return tokens


def verify_graph_widths(config: EngineConfig) -> list[int]:
    """TARGET_VERIFY widths to capture: every width a step may verify (2 .. num_draft_tokens, since
    drafts are shortened adaptively). EAGLE engines too: the model writes the hidden states their
    heads read into a HiddenCapture buffer, which replays write as well."""
    if config.speculative_algorithm is None or not config.speculative_num_draft_tokens:
        return []
    if config.enable_dp_attention:
        # DP attention pads every verify block to num_draft_tokens (one width on every rank).
        return [config.speculative_num_draft_tokens]
    return list(range(2, config.speculative_num_draft_tokens + 1))


def eagle_hidden_capture(config: EngineConfig, mc: ModelConfig, static_rows: int, device: str) -> HiddenCapture | None:
    """The target hidden states an EAGLE / EAGLE3 head reads (None for other engines): EAGLE the final
    normed hidden, EAGLE3 the residual-stream inputs of layers [2, L // 2, L - 3]."""
    if config.speculative_algorithm not in ("EAGLE", "EAGLE3"):
        return None
    if config.speculative_algorithm == "EAGLE3":
        layers = eagle3_capture_layers(mc.num_layers)
        if min(layers) < 0 or mc.num_layers < 3:
            raise ValueError(f"EAGLE3 captures target layers {layers}: the target needs >= 3 layers")
    else:
        layers = [-1]
    return HiddenCapture(layers, mc.hidden_size, static_rows, mc.dtype, device)


def use_rank_device(config: EngineConfig, tp: TPGroup) -> str:
    """The device rank ``tp.rank`` runs on; on CUDA its GPU is made current (idempotent)."""
    device = config.resolved_device()
    if device == "cuda" and not torch.cuda.is_available():
        raise RuntimeError("device cuda: torch sees no CUDA device here (a CPU build of torch, no driver, or an "
                           "empty CUDA_VISIBLE_DEVICES); use --device cpu, or --device auto to take what there is")
    if device == "cuda":
        # A node's ranks are consecutive: the local GPU is the rank modulo the node's GPU count.
        # Rank r of this engine (or data-parallel replica) uses GPU base_gpu_id + r.
        torch.cuda.set_device((config.base_gpu_id + tp.rank) % torch.cuda.device_count())
    return device
