"""Vocabulary-parallel input embedding and LM head (vocab split across TP ranks)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from plait.distributed.parallel_state import SINGLE, TPGroup


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp: TPGroup = SINGLE,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings
        self.per_rank = -(-num_embeddings // tp.size)
        self.vocab_start = tp.rank * self.per_rank
        self.weight = nn.Parameter(torch.zeros(self.per_rank, embedding_dim, dtype=dtype), requires_grad=False)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        part = loaded[self.vocab_start : self.vocab_start + self.per_rank]
        param.data[: part.shape[0]].copy_(part)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        local = input_ids - self.vocab_start
        in_range = (local >= 0) & (local < self.per_rank)
        out = F.embedding(local.clamp(0, self.per_rank - 1), self.weight) * in_range.unsqueeze(-1)
        return self.tp.all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Same sharding as the embedding; applied by the LogitsProcessor, never as forward()."""

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor")
