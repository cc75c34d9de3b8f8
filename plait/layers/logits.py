"""LogitsProcessor: the LM head over the rows that are sampled, in float32."""

from __future__ import annotations

import functools

import torch
from torch import nn

from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.forward_batch import ForwardBatch


def _matmul_fp32(h: torch.Tensor, w: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """h [n, H] @ w[V, H]^T with float32 output (into ``out`` [n, V] when given). Half-precision
    GEMMs accumulate in float32 already; asking for a float32 output keeps that precision without
    upcasting the whole weight."""
    if h.dtype == torch.float32:
        return torch.matmul(h, w.t(), out=out)
    if h.is_cuda and _mm_out_dtype_ok(h.device, out is not None):
        if out is None:
            return torch.mm(h, w.t(), out_dtype=torch.float32)
        return torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
    logits = h.float() @ w.float().t()
    return logits if out is None else out.copy_(logits)


@functools.cache
def _mm_out_dtype_ok(device: torch.device, with_out: bool) -> bool:
    """Whether this torch has ``mm(..., out_dtype=float32)`` for bf16/fp16 inputs (and its ``out=``
    form). Probed once per device outside any graph capture (graph runners warm up first)."""
    a = torch.ones(2, 8, dtype=torch.bfloat16, device=device)
    try:
        if with_out:
            torch.mm(a, a.t(), out_dtype=torch.float32, out=torch.empty(2, 2, device=device))
        else:
            torch.mm(a, a.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):
        return False
    return True


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """hidden [T, H] (already normed) -> logits [num_sampled, vocab] float32 (a view of
        ``fb.next_token_logits_buffer`` when the batch carries one)."""
        if fb.logits_indices is not None:
            hidden = hidden[fb.logits_indices]
        buf = fb.next_token_logits_buffer
        if buf is not None and self.tp.size == 1:
            return _matmul_fp32(hidden, lm_head_weight, out=buf[: hidden.shape[0], : lm_head_weight.shape[0]]
                                )[:, : self.vocab_size]
        logits = self.tp.all_gather_last_dim(_matmul_fp32(hidden, lm_head_weight))[:, : self.vocab_size]
        if buf is not None:
            return buf[: logits.shape[0], : logits.shape[1]].copy_(logits)
        return logits
