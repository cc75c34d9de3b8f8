"""Top-k expert selection from router logits, in the orders the architectures define.

- ``softmax_topk`` (Qwen2-MoE, Qwen3-MoE, Mixtral): softmax over all experts, then the k largest
  probabilities; ``renormalize`` divides them by their sum (``norm_topk_prob``; Mixtral always).
- ``topk_softmax`` (gpt-oss): the k largest (biased) logits, then a softmax over those k.

Weights come back float32 (the softmax runs in float32 whatever the logits' dtype), ids int32.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

SCORINGS = ("softmax_topk", "topk_softmax")


@dataclass(frozen=True)
class RouterConfig:
    num_experts: int
    top_k: int
    scoring: str = "softmax_topk"
    renormalize: bool = False

    def __post_init__(self) -> None:
        if self.scoring not in SCORINGS:
            raise ValueError(f"router scoring must be one of {SCORINGS}, got {self.scoring!r}")
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok ({self.top_k}) must be in [1, num_experts={self.num_experts}]")


def select_experts(router_logits: torch.Tensor, cfg: RouterConfig,
                   fused: bool | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, K], topk_ids int32 [T, K]).

    ``fused``: the one-launch Triton kernel (``fused_router``), by default on CUDA tensors; else torch."""
    if router_logits.is_cuda if fused is None else fused:
        from plait.layers.moe.fused_router import fused_topk

        return fused_topk(router_logits, cfg.top_k, cfg.scoring == "softmax_topk", cfg.renormalize)
    logits = router_logits.float()
    if cfg.scoring == "topk_softmax":
        values, ids = torch.topk(logits, cfg.top_k, dim=-1)
        weights = torch.softmax(values, dim=-1)
    else:
        weights, ids = torch.topk(torch.softmax(logits, dim=-1), cfg.top_k, dim=-1)
        if cfg.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids.to(torch.int32)
