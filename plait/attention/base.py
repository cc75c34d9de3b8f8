"""The attention backend contract (docs/architecture.md).

Three planning methods:
  init_forward_metadata(fb)                        eager entry: out_graph(fb) then in_graph(fb)
  init_forward_metadata_out_graph(fb, in_capture)  host-side, dynamic-shape preparation; runs before a
                                                   capture (in_capture=True), before every replay and
                                                   eagerly
  init_forward_metadata_in_graph(fb)               static-shape device work recorded inside a capture
                                                   and re-run by every replay: no host syncs, no
                                                   dynamically sized allocations, no host branching
                                                   on data
There is no capture- or replay-specific method and no side channel: whatever a backend needs during
replay comes from the batch (or padded view) handed to ``out_graph``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING

import torch

# AttentionLayer is declared next to ForwardBatch (the floor below) and re-exported here.
from plait.forward_batch import AttentionLayer, ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool


class AttentionBackend(ABC):
    """Base class. ``name`` is the effective kernel name, stamped by the registry."""

    name: str = "unnamed"

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.kv_pool = kv_pool

    # --- planning -------------------------------------------------------------------------------
    def init_forward_metadata(self, fb: ForwardBatch) -> None:
        self.init_forward_metadata_out_graph(fb)
        self.init_forward_metadata_in_graph(fb)

    @abstractmethod
    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None: ...

    @abstractmethod
    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None: ...

    # --- which kernels serve a batch -----------------------------------------------------------
    def serving_backend(self, mode: ForwardMode) -> AttentionBackend:
        """The backend whose kernels serve a batch of ``mode``: this one. A backend that hands its
        batches to others (the hybrid's halves, a wrapper's inner backend) answers theirs, so the
        answer is always a leaf, never a dispatcher or a wrapper."""
        return self

    # --- CUDA graphs ----------------------------------------------------------------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise RuntimeError(
            f"attention backend {self.name!r} cannot run under CUDA graphs; "
            "use --attention-backend triton or --disable-cuda-graph"
        )

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len written into padded rows of a graph batch (they read the dummy request row)."""
        return 1

    # --- compute --------------------------------------------------------------------------------
    def rope_kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """Where this backend stores ``fb``'s new K/V when it stores them plainly into the paged pool:
        ``(k_buffer, v_buffer)`` of ``layer`` (``[num_slots, Hkv, D]``), written at ``fb.out_cache_loc``.
        Then the rotary kernel may write them itself (one launch fewer per layer) and the forward runs
        with ``save_kv_cache=False``. None (the default): the backend stores K/V its own way."""
        return None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer: AttentionLayer,
        fb: ForwardBatch,
        save_kv_cache: bool = True,
    ) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> output [T, Hq*D]."""
        if fb.forward_mode.is_idle():
            return q.new_empty(0, layer.num_heads * layer.head_dim)
        if fb.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, fb, save_kv_cache)
        return self.forward_extend(q, k, v, layer, fb, save_kv_cache)

    @abstractmethod
    def forward_decode(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
        fb: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor: ...

    @abstractmethod
    def forward_extend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
        fb: ForwardBatch, save_kv_cache: bool = True,
    ) -> torch.Tensor: ...


def custom_mask_of(fb: ForwardBatch) -> torch.Tensor | None:
    """The speculative tree mask, if any: flattened bool, per request a row-major block
    [extend_len, prefix_len + extend_len]. Plain extends have none (causal)."""
    return getattr(fb.spec_info, "custom_mask", None) if fb.spec_info is not None else None
