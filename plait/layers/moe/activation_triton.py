"""The MoE activations as a Triton device function, shared by the expert kernels' epilogues
(``fused_moe_triton``, ``small_batch``); ``reference.apply_moe_activation`` defines them."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def activate(gate, up, ACTIVATION: tl.constexpr, ALPHA: tl.constexpr, LIMIT: tl.constexpr):
    """fp32 gate, up -> act(gate) * up: ACTIVATION 0 is silu, 1 gpt-oss's clamped
    (up + 1) * gate * sigmoid(ALPHA * gate) with gate <= LIMIT and up in [-LIMIT, LIMIT]
    (the codes are the indices in ``reference.ACTIVATIONS``)."""
    if ACTIVATION == 0:
        return gate / (1.0 + tl.exp(-gate)) * up
    else:
        gate = tl.minimum(gate, LIMIT)
        up = tl.minimum(tl.maximum(up, -LIMIT), LIMIT)
        return (up + 1.0) * gate / (1.0 + tl.exp(-ALPHA * gate))
