"""ForwardMode and ForwardBatch: the device-side description of one model forward.

A ForwardBatch lives on the ground floor of the package because attention backends, models and the
executor all read it. It carries its own attention-plan state (DESIGN 3.1): a pre-planner records
on the batch that it planned, and forward paths ask the batch whether to plan, instead of trusting a
``skip_attn_backend_init`` flag threaded through call levels.

Shapes (T = number of tokens in this forward, bs = number of requests):
  input_ids, positions, out_cache_loc: [T]; req_pool_indices, seq_lens: [bs].
  ``seq_lens`` are total lengths after this forward (prefix + new tokens).
"""

from __future__ import annotations

import enum
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from plait.attention.base import AttentionBackend
    from plait.sampling import SamplingBatchInfo


class ForwardMode(enum.IntEnum):
    EXTEND = enum.auto()  # prefill, possibly on top of a cached prefix, possibly one chunk
    DECODE = enum.auto()  # one new token per request
    MIXED = enum.auto()  # extend requests and decode requests in one forward
    IDLE = enum.auto()  # no work on this rank; joins collectives only
    TARGET_VERIFY = enum.auto()  # speculative: the target scores a draft tree
    DRAFT_EXTEND = enum.auto()  # speculative: the draft consumes accepted tokens

    def is_extend(self) -> bool:
        """Modes that run the extend kernels (several query tokens per request)."""
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY,
                        ForwardMode.DRAFT_EXTEND)

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_draft_extend(self) -> bool:
        return self == ForwardMode.DRAFT_EXTEND

    def is_cuda_graph(self) -> bool:
        """Modes a CUDA graph may be captured for (static shapes per request)."""
        return self in (ForwardMode.DECODE, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE)


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    out_cache_loc: torch.Tensor
    positions: torch.Tensor
    # Host copy of seq_lens: backends plan from it without a device sync.
    seq_lens_cpu: list[int] = field(default_factory=list)
    seq_lens_sum: int = 0
    # Extend-only (None for DECODE/IDLE): per-request new-token counts and cached-prefix lengths.
    extend_num_tokens: int | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_prefix_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    # Rows of the hidden states whose logits are needed ([num_sampled], indices into T). None means
    # every row (decode). Only these rows go through the LM head.
    logits_indices: torch.Tensor | None = None
    # Wiring owned by the model runner: the backend that serves this forward.
    attn_backend: AttentionBackend | None = None
    sampling_info: SamplingBatchInfo | None = None
    # Speculative decoding input (draft tree, custom mask); None for plain decoding.
    spec_info: Any = None
    # During graph replay the padded view runs in the captured mode; this is the runtime mode.
    actual_forward_mode: ForwardMode | None = None

    # --- attention plan marker (DESIGN 3.1) ---
    forward_metadata_ready: bool = False
    forward_metadata_planned_bs: int | None = None
    forward_metadata_planned_num_tokens: int | None = None
    forward_metadata_replan_equivalent: bool = False

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    def mark_forward_metadata_ready(self, replan_equivalent: bool = False) -> None:
        """Record that attention metadata was planned for this batch's current shape.

        Call right after planning. ``replan_equivalent=True`` declares that planning again would
        produce equivalent metadata, so a later shape drift (e.g. DP padding) may trigger a re-plan.
        Re-marking re-snapshots the shape.
        """
        self.forward_metadata_ready = True
        self.forward_metadata_planned_bs = self.batch_size
        self.forward_metadata_planned_num_tokens = self.num_tokens
        self.forward_metadata_replan_equivalent = replan_equivalent

    def needs_forward_metadata_init(self) -> bool:
        if not self.forward_metadata_ready:
            return True
        if not self.forward_metadata_replan_equivalent:
            return False
        return (
            self.batch_size != self.forward_metadata_planned_bs
            or self.num_tokens != self.forward_metadata_planned_num_tokens
        )

    def reset_forward_metadata_marker(self) -> None:
        """Forget the plan: used on derived batches (TBO children, per-step views)."""
        self.forward_metadata_ready = False
        self.forward_metadata_planned_bs = None
        self.forward_metadata_planned_num_tokens = None
        self.forward_metadata_replan_equivalent = False


_warned_skip_attn_backend_init = False


def apply_deprecated_skip_attn_backend_init(fb: ForwardBatch, skip_attn_backend_init: bool | None) -> None:
    """Map the deprecated keyword onto the plan marker, warning once per process.

    None: nothing (silent). True: the caller claims it planned, so the batch is marked. False: the
    caller asks for planning, which is already the default for an unmarked batch; the marker is left
    as it is.
    """
    global _warned_skip_attn_backend_init
    if skip_attn_backend_init is None:
        return
    if not _warned_skip_attn_backend_init:
        _warned_skip_attn_backend_init = True
        warnings.warn(
            "skip_attn_backend_init is deprecated: call fb.mark_forward_metadata_ready() after "
            "planning instead; forward paths ask the batch whether to plan.",
            DeprecationWarning,
            stacklevel=3,
        )
    if skip_attn_backend_init:
        fb.mark_forward_metadata_ready()
