"""LogitsProcessor: the LM head over the rows that are sampled, in float32."""

from __future__ import annotations

import torch
from torch import nn

from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.forward_batch import ForwardBatch


def _matmul_fp32(h: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """h [n, H] @ w[V, H]^T with float32 output. Half-precision GEMMs accumulate in float32 already;
    asking for a float32 output keeps that precision without upcasting the whole weight."""
    if h.dtype == torch.float32:
        return h @ w.t()
    if h.is_cuda:
        try:
            return torch.mm(h, w.t(), out_dtype=torch.float32)
        except (TypeError, RuntimeError):
            pass
    return h.float() @ w.float().t()


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, tp: TPGroup = SINGLE) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        self.tp = tp

    def forward(self, hidden: torch.Tensor, lm_head_weight: torch.Tensor, fb: ForwardBatch) -> torch.Tensor:
        """hidden [T, H] (already normed) -> logits [num_sampled, vocab] float32."""
        if fb.logits_indices is not None:
            hidden = hidden[fb.logits_indices]
        logits = _matmul_fp32(hidden, lm_head_weight)
        logits = self.tp.all_gather_last_dim(logits)
        return logits[:, : self.vocab_size]
