"""Top-k expert selection in one Triton launch (``router.select_experts`` on the GPU).

The torch form is five to six launches (upcast, softmax, top-k, sum, divide, id cast); at decode
batch sizes each costs more than its bytes. One program per token loads its E logits (any float
dtype), and in fp32:

- ``softmax_topk``: softmax over the E logits, then K rounds of (max, lowest index holding it,
  masked out); ``renormalize`` divides the K weights by their sum;
- ``topk_softmax``: the same K rounds on the logits, then a softmax over the K chosen.

Ties go to the lowest expert index (torch.topk leaves the order of ties unspecified). Weights are
written float32 [T, K], ids int32 [T, K], as ``router.select_experts`` returns them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait.layers.pdl import pdl_prologue, use_pdl


@triton.jit
def _fused_topk_kernel(Logits, Weights, Ids, E, stride_l, TOP_K: tl.constexpr, TOP_K_PAD: tl.constexpr,
                       SOFTMAX_FIRST: tl.constexpr, RENORMALIZE: tl.constexpr, BLOCK_E: tl.constexpr,
                       USE_PDL: tl.constexpr = False):
    pdl_prologue(USE_PDL)
    token = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_E)
    in_e = offs < E
    scores = tl.load(Logits + token * stride_l + offs, mask=in_e, other=-float("inf")).to(tl.float32)
    if SOFTMAX_FIRST:
        scores = tl.exp(scores - tl.max(scores, axis=0))
        scores = scores / tl.sum(scores, axis=0)
    slot = tl.arange(0, TOP_K_PAD)
    chosen = tl.zeros((TOP_K_PAD,), dtype=tl.float32)
    chosen_ids = tl.zeros((TOP_K_PAD,), dtype=tl.int32)
    remaining = tl.where(in_e, scores, -float("inf"))
    for k in tl.static_range(TOP_K):
        best = tl.max(remaining, axis=0)
        best_id = tl.min(tl.where(remaining == best, offs, BLOCK_E), axis=0)
        chosen = tl.where(slot == k, best, chosen)
        chosen_ids = tl.where(slot == k, best_id, chosen_ids)
        remaining = tl.where(offs == best_id, -float("inf"), remaining)
    in_k = slot < TOP_K
    if SOFTMAX_FIRST:
        if RENORMALIZE:
            chosen = chosen / tl.sum(tl.where(in_k, chosen, 0.0), axis=0)
    else:
        chosen = tl.exp(chosen - tl.max(tl.where(in_k, chosen, -float("inf")), axis=0))
        chosen = tl.where(in_k, chosen, 0.0)
        chosen = chosen / tl.sum(chosen, axis=0)
    tl.store(Weights + token * TOP_K + slot, chosen, mask=in_k)
    tl.store(Ids + token * TOP_K + slot, chosen_ids, mask=in_k)


def fused_topk(router_logits: torch.Tensor, top_k: int, softmax_first: bool,
               renormalize: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (topk_weights float32 [T, K], topk_ids int32 [T, K]): ``softmax_first``
    is ``softmax_topk`` scoring, else ``topk_softmax`` (``renormalize`` applies to the former); see
    the module doc."""
    if router_logits.dim() != 2 or router_logits.stride(-1) != 1:
        raise ValueError(f"router_logits must be [T, E] with E contiguous, got shape "
                         f"{tuple(router_logits.shape)} strides {router_logits.stride()}")
    num_tokens, num_experts = router_logits.shape
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k ({top_k}) must be in [1, num_experts={num_experts}]")
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=router_logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int32, device=router_logits.device)
    if num_tokens:
        block_e = triton.next_power_of_2(num_experts)
        pdl = use_pdl(router_logits)
        _fused_topk_kernel[(num_tokens,)](
            router_logits, weights, ids, num_experts, router_logits.stride(0), TOP_K=top_k,
            TOP_K_PAD=triton.next_power_of_2(top_k), SOFTMAX_FIRST=softmax_first,
            RENORMALIZE=renormalize, BLOCK_E=block_e, USE_PDL=pdl, num_warps=1 if block_e <= 256 else 4,
            launch_pdl=pdl)
    return weights, ids
