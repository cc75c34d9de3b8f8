"""The reference expert computation: a loop over experts in plain torch.

It defines the semantics the fused Triton kernel (``fused_moe_triton.fused_experts_triton``) must
match, and it is what runs on the CPU. Shapes (E experts, I intermediate per rank, H hidden, T
tokens, K experts per token):

- ``w13`` [E, 2*I, H]: rows [0, I) project to the gate, rows [I, 2I) to the up half;
- ``w2`` [E, H, I];
- ``topk_weights`` [T, K] float32, already normalised as the architecture wants;
- ``topk_ids`` [T, K] expert ids; an id outside [0, E) (under expert parallelism, an expert another
  rank holds) contributes nothing.

Under tensor parallelism each rank holds its intermediate shard, so the result is a partial sum
the caller all-reduces (and passes ``b2`` on one rank only).

Block-FP8 experts: ``w13`` / ``w2`` float8_e4m3fn with ``w13_scale`` [E, ceil(2I/128), ceil(H/128)]
and ``w2_scale`` [E, ceil(H/128), ceil(I/128)], multipliers (``W = q * s`` per 128 x 128 block,
``EXPERT_FP8_BLOCK``). The loop dequantizes each routed expert to fp32 and runs as above: that is
the CPU path (activations as they are, like the dense FP8 layers' CPU path). With
``quantize_activations`` it also quantizes the GEMMs' inputs per token per 128 columns as the GPU's
aligned pipeline does (its kernels' reference).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from plait.layers.quantization.fp8_kernels import dequantize_weight, quantize_dequantize_rows

ACTIVATIONS = ("silu", "swiglu_oai")

# gpt-oss's clamped SwiGLU constants (transformers' GptOssExperts: alpha 1.702, limit 7.0).
SWIGLU_OAI_ALPHA = 1.702
SWIGLU_OAI_LIMIT = 7.0

# The block of FP8 expert scales (rows x columns of one scale), and of the activations' groups.
EXPERT_FP8_BLOCK = 128


def apply_moe_activation(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """[N, 2*I] (gate | up) -> [N, I]."""
    n = gate_up.shape[-1] // 2
    gate, up = gate_up[..., :n], gate_up[..., n:]
    if activation == "silu":
        return F.silu(gate) * up
    if activation == "swiglu_oai":
        gate = gate.clamp(max=SWIGLU_OAI_LIMIT)
        up = up.clamp(min=-SWIGLU_OAI_LIMIT, max=SWIGLU_OAI_LIMIT)
        return (up + 1) * gate * torch.sigmoid(SWIGLU_OAI_ALPHA * gate)
    raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, got {activation!r}")


def fused_experts_reference(
    hidden_states: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    activation: str = "silu",
    b13: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    quantize_activations: bool = False,
) -> torch.Tensor:
    """[T, H] -> [T, H] in hidden_states' dtype: sum_k w[t,k] * down_k(act(gate_up_k(x_t))).
    ``w13_scale`` / ``w2_scale``: block-FP8 experts (module doc), dequantized per routed expert;
    ``quantize_activations``: the inputs of both GEMMs quantized per token per 128 columns first."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, got {activation!r}")
    num_tokens, hidden = hidden_states.shape
    num_experts = w13.shape[0]
    if w13.shape[2] != hidden or w2.shape[1] != hidden or w2.shape[2] * 2 != w13.shape[1]:
        raise ValueError(f"expert weights do not match: hidden {hidden}, w13 {tuple(w13.shape)}, "
                         f"w2 {tuple(w2.shape)} (want w13 [E, 2*I, H] and w2 [E, H, I])")
    if topk_ids.shape != topk_weights.shape or topk_ids.shape[0] != num_tokens:
        raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights {tuple(topk_weights.shape)} "
                         f"must both be [T={num_tokens}, K]")
    out = torch.zeros(num_tokens, hidden, dtype=torch.float32, device=hidden_states.device)
    if num_tokens == 0:
        return out.to(hidden_states.dtype)
    flat_ids = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1).float()
    token_of = torch.arange(num_tokens, device=hidden_states.device).repeat_interleave(topk_ids.shape[1])
    valid = (flat_ids >= 0) & (flat_ids < num_experts)
    flat_ids, flat_weights, token_of = flat_ids[valid], flat_weights[valid], token_of[valid]
    # One pass per expert that received tokens; the host sync of unique() is fine on the reference path.
    for e in torch.unique(flat_ids).tolist():
        sel = flat_ids == e
        tokens = token_of[sel]
        x = hidden_states[tokens]
        w13_e, w2_e = expert_weight(w13, w13_scale, e), expert_weight(w2, w2_scale, e)
        if quantize_activations:
            x = quantize_dequantize_rows(x, EXPERT_FP8_BLOCK)
        gate_up = F.linear(x.to(w13_e.dtype), w13_e, None if b13 is None else b13[e].to(w13_e.dtype))
        act = apply_moe_activation(gate_up, activation)
        if quantize_activations:
            act = quantize_dequantize_rows(act, EXPERT_FP8_BLOCK)
        y = F.linear(act.to(w2_e.dtype), w2_e, None if b2 is None else b2[e].to(w2_e.dtype))
        out.index_add_(0, tokens, y.float() * flat_weights[sel, None])
    return out.to(hidden_states.dtype)


def expert_weight(w: torch.Tensor, scale: torch.Tensor | None, e: int) -> torch.Tensor:
    """Expert ``e``'s matrix of ``w`` [E, N, K]: as stored, or fp32 ``q * s`` for a block-FP8 one."""
    if scale is None:
        return w[e]
    return dequantize_weight(w[e], scale[e], (EXPERT_FP8_BLOCK, EXPERT_FP8_BLOCK))
