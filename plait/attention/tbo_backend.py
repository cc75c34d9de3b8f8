"""TboAttnBackend: two-batch overlap's attention backend, one child backend per micro-batch.

Planning decides the split: ``init_forward_metadata_out_graph`` asks the split policy whether
``fb`` (the eager batch, or a graph replay's padded view) runs as two micro-batches; if so it builds
the two children (``plait.two_batch_overlap.split_forward_batch``, each child with its own backend
and an unset plan marker) and plans each child with its own backend, else it plans the whole batch
with the primary backend. ``init_forward_metadata_in_graph`` runs the same backends' in-graph part.
The children's forwards reach their own backends through ``child.attn_backend``; a whole batch's
forward reaches the primary. An IDLE child (under DP attention, a rank's empty half) is not planned:
it attends over nothing.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from plait.attention.base import AttentionBackend
from plait.forward_batch import AttentionLayer, ForwardBatch, ForwardMode
from plait.two_batch_overlap import TboSplit, split_forward_batch

SplitPolicy = Callable[[ForwardBatch], TboSplit | None]


class TboAttnBackend(AttentionBackend):
    def __init__(self, primary: AttentionBackend, children: tuple[AttentionBackend, AttentionBackend],
                 split_policy: SplitPolicy) -> None:
        super().__init__(primary.req_to_token_pool, primary.kv_pool)
        self.primary = primary
        self.children = children
        self.split_policy = split_policy
        self.name = primary.name
        # Batches planned as two micro-batches, by forward mode name (server info, tests).
        self.split_counts: Counter[str] = Counter()

    def serving_backend(self, mode: ForwardMode) -> AttentionBackend:
        return self.primary.serving_backend(mode)

    def _split(self, fb: ForwardBatch) -> None:
        if fb.tbo_children is None:
            split = self.split_policy(fb)
            if split is not None:
                fb.tbo_children = split_forward_batch(fb, split, self.children)
                self.split_counts[fb.forward_mode.name] += 1

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        self._split(fb)
        if fb.tbo_children is None:
            self.primary.init_forward_metadata_out_graph(fb, in_capture)
            return
        for child, backend in zip(fb.tbo_children, self.children, strict=True):
            if not child.forward_mode.is_idle():  # an empty half (DP attention) attends over nothing
                backend.init_forward_metadata_out_graph(child, in_capture)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        if fb.tbo_children is None:
            self.primary.init_forward_metadata_in_graph(fb)
            return
        for child, backend in zip(fb.tbo_children, self.children, strict=True):
            if not child.forward_mode.is_idle():
                backend.init_forward_metadata_in_graph(child)
                child.mark_forward_metadata_ready()

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.primary.init_cuda_graph_state(max_bs, max_num_tokens)
        for backend in self.children:
            backend.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.primary.get_cuda_graph_seq_len_fill_value()

    def rope_kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.primary.rope_kv_store_target(layer, fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer, fb: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        return self.primary.forward(q, k, v, layer, fb, save_kv_cache)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        return self.primary.forward_decode(q, k, v, layer, fb, save_kv_cache)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        return self.primary.forward_extend(q, k, v, layer, fb, save_kv_cache)
