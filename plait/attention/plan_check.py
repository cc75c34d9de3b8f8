"""``PLAIT_CHECK_PLANS=1``: a debug wrapper that raises when a forward runs on the wrong plan.

Attention backends keep the metadata of their last plan. The wrapper records the shape
(batch size, token count) of every plan and checks, at each attention call, that the batch it is
given has that shape: a plan made before padding, or a stale plan left by another batch, fails
loudly instead of reading the wrong indices. It also catches a pre-planning site that forgot to mark
its batch (docs/architecture.md): such a batch is planned a second time by the forward path, which the
wrapper sees as the same batch object planned twice without a mark in between.
"""

from __future__ import annotations

import torch

from plait import envs
from plait.attention.base import AttentionBackend, AttentionLayer
from plait.forward_batch import ForwardBatch, ForwardMode


def plan_checks_enabled() -> bool:
    return envs.CHECK_PLANS.get()


class PlanMismatchError(RuntimeError):
    pass


class PlanCheckingBackend(AttentionBackend):
    def __init__(self, inner: AttentionBackend) -> None:
        super().__init__(inner.req_to_token_pool, inner.kv_pool)
        self.inner = inner
        self.name = inner.name  # wrappers copy the stamp of what they wrap
        self._plan_shape: tuple[int, int] | None = None
        self._last_planned: ForwardBatch | None = None

    def serving_backend(self, mode: ForwardMode) -> AttentionBackend:
        return self.inner.serving_backend(mode)

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        if fb is self._last_planned and not fb.forward_metadata_ready:
            raise PlanMismatchError(
                "the same ForwardBatch was planned twice without being marked: the pre-planning site "
                "must call fb.mark_forward_metadata_ready() right after it plans")
        self.inner.init_forward_metadata_out_graph(fb, in_capture)
        self._plan_shape = (fb.batch_size, fb.num_tokens)
        self._last_planned = fb

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        self.inner.init_forward_metadata_in_graph(fb)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        self.inner.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.inner.get_cuda_graph_seq_len_fill_value()

    def _check(self, fb: ForwardBatch) -> None:
        shape = (fb.batch_size, fb.num_tokens)
        if fb.forward_mode.is_idle():
            return
        if self._plan_shape is None:
            raise PlanMismatchError(f"attention ran on a batch of shape {shape} with no plan at all")
        if shape != self._plan_shape:
            raise PlanMismatchError(
                f"attention ran on a batch of (batch size, tokens) {shape} with a plan made for "
                f"{self._plan_shape}: plan after the final (padded) shape")
        if fb.forward_metadata_ready and not fb.forward_metadata_replan_equivalent:
            snap = (fb.forward_metadata_planned_bs, fb.forward_metadata_planned_num_tokens)
            if snap != shape:
                raise PlanMismatchError(f"batch marked planned at {snap} but runs at {shape}")

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        self._check(fb)
        return self.inner.forward(q, k, v, layer, fb, save_kv_cache)

    def rope_kv_store_target(self, layer, fb):
        return self.inner.rope_kv_store_target(layer, fb)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        self._check(fb)
        return self.inner.forward_decode(q, k, v, layer, fb, save_kv_cache)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        self._check(fb)
        return self.inner.forward_extend(q, k, v, layer, fb, save_kv_cache)


def maybe_check_plans(backend: AttentionBackend) -> AttentionBackend:
    """The backend itself, or wrapped in the checker when PLAIT_CHECK_PLANS=1."""
    return PlanCheckingBackend(backend) if plan_checks_enabled() else backend
