"""ForwardMode and ForwardBatch: the device-side description of one model forward.

A ForwardBatch lives on the ground floor of the package because attention backends, models and the
executor all read it. It carries its own attention-plan state: a pre-planner records on the batch
that it planned, and forward paths ask the batch whether to plan, instead of trusting a
``skip_attn_backend_init`` flag threaded through call levels.

The core fields stay flat, with SGLang's names; the rest is grouped into typed parts: ``extend``
(an ExtendInfo, None for DECODE/IDLE), ``spec_info`` (a SpecInput, None without speculation) and
``mlp_sync`` (the DP-attention MLP-sync metadata, empty without DP attention). The objects higher
floors wire onto a batch (the attention backend, the hidden-state capture, the sampling state, the
DP row exchange) and the speculative input are typed here by Protocols of what is reached through
the batch, so this module imports nothing above it.

Shapes (T = number of tokens in this forward, bs = number of requests):
  input_ids, positions, out_cache_loc: [T]; req_pool_indices, seq_lens: [bs].
  ``seq_lens`` are total lengths after this forward (prefix + new tokens).
"""

from __future__ import annotations

import enum
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from plait.transfer import ints_to_device


class AttentionLayer(Protocol):
    """What a backend reads from the calling layer (plait.layers.radix_attention.RadixAttention)."""

    layer_id: int
    num_heads: int  # query heads on this rank
    num_kv_heads: int  # KV heads on this rank
    head_dim: int
    scaling: float
    logit_cap: float
    sliding_window: int | None  # W: a query at position i sees keys at j > i - W; None = full
    # [num_heads] per-head sink logits in the model dtype (gpt-oss): they join each softmax
    # denominator and attend to nothing; None = no sinks
    sinks: torch.Tensor | None


class BatchAttentionBackend(Protocol):
    """What a layer reaches through ``fb.attn_backend``: attention over the batch's paged KV, planned
    for this batch before the forward (plait.attention.base.AttentionBackend implements it)."""

    def rope_kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch
                             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(k_buffer, v_buffer) of ``layer`` when the backend stores the new K/V plainly at
        ``fb.out_cache_loc`` (the rotary kernel may then write them), else None."""
        ...

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """q [T, Hq*D], k/v [T, Hkv*D] -> output [T, Hq*D]."""
        ...


class BatchHiddenCapture(Protocol):
    """Where the model writes the target hidden states an EAGLE head reads, during the forward (so a
    graph replay writes them too); plait.layers.hidden_capture.HiddenCapture implements it."""

    @property
    def slots(self) -> Mapping[int, Sequence[int]]:
        """Captured layer index (-1: the final normed hidden) -> its column blocks."""
        ...

    def begin(self, num_tokens: int) -> None:
        """A forward of ``num_tokens`` tokens starts."""
        ...

    def store(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden [T, hidden_size] of capture layer ``layer`` into its columns."""
        ...


class BatchSamplingInfo(Protocol):
    """The per-request sampling state the scheduler attaches for the runner's sampler
    (plait.sampling.SamplingBatchInfo); the batch only carries it from one to the other."""

    @property
    def vocab_size(self) -> int: ...

    @property
    def all_greedy(self) -> bool:
        """Every row greedy: the sampler skips the random draw without a device read."""
        ...


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


class SpecInput(Protocol):
    """What floors 1-4 read from ``fb.spec_info``, the speculative input of a batch (the verify
    trees of plait.speculative.verify_batch.VerifyInput, a graph runner's static verify input)."""

    @property
    def num_tokens_per_req(self) -> int | Sequence[int]:
        """Tokens per request (root included): one width, or one per request (widths differ
        between requests and steps)."""
        ...

    @property
    def custom_mask(self) -> torch.Tensor | None:
        """Flattened bool tree mask, layout of plait.attention.base.custom_mask_of; None when every
        request's nodes form a chain (causal attention)."""
        ...


class ShardedMLP(Protocol):
    """A TP-sharded MLP whose row-parallel output can be reduced by the caller."""

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums of the output rows of ``x``, bias not yet added."""
        ...

    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor:
        """The output of rows whose partial sums were reduced over the ranks."""
        ...


class RowExchange(Protocol):
    """The DP-attention runner's symmetric-memory row exchange around the MLP
    (plait.distributed.copy_engine_rows.CopyEngineRows), as plait.distributed.dp_mlp uses it."""

    def fits(self, counts: list[int]) -> bool:
        """Whether per-rank row counts ``counts`` fit the exchange's buffers."""
        ...

    def mlp(self, mlp: ShardedMLP, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """The MLP over every rank's rows (uneven ``counts``, SUM_LEN); this rank's output rows."""
        ...

    def mlp_equal(self, mlp: ShardedMLP, hidden: torch.Tensor) -> torch.Tensor:
        """The MLP over every rank's rows, each rank holding as many as ``hidden`` (MAX_LEN)."""
        ...


class MLPSyncSource(Protocol):
    """What ``init_mlp_sync_metadata`` reads: the step's exchanged per-rank counts (a ScheduleBatch,
    the DP-attention runner's per-step counts, or what a custom worker builds)."""

    @property
    def global_num_tokens(self) -> list[int] | None:
        """Every rank's count this step (request counts for decode and verify); None: no DP sync."""
        ...

    @property
    def global_num_tokens_for_logprob(self) -> list[int] | None: ...

    @property
    def can_run_dp_cuda_graph(self) -> bool: ...


@dataclass(frozen=True, slots=True)
class ExtendInfo:
    """The extend part of a batch (modes that run the extend kernels): per request, the new-token
    counts and cached-prefix lengths, on the device and their host copies. Every field is set
    together: a batch either extends, with all of them, or has ``extend = None``."""

    num_tokens: int  # sum of seq_lens
    seq_lens: torch.Tensor  # [bs] new tokens per request
    prefix_lens: torch.Tensor  # [bs] cached tokens before them
    start_loc: torch.Tensor  # [bs] offset of each request's first new token in the batch
    seq_lens_cpu: list[int]  # host copies: backends plan from them without a device sync
    prefix_lens_cpu: list[int]


@dataclass(frozen=True, slots=True)
class InputLogprobRows:
    """Prompt positions of an extend batch whose next-token logprobs requests asked for (SGLang's
    logprob_start_len). Their hidden rows are in ``logits_indices`` next to the sampled rows, so the
    LM head runs once; indices below are into the resulting logits rows."""

    rows: torch.Tensor  # [n] logits rows of the scored positions
    next_ids: torch.Tensor  # [n] the prompt token that follows each scored position
    sample_rows: torch.Tensor  # [num_sampled] logits rows the sampler reads, in entry order
    counts: list[int]  # scored positions per batch entry (host)
    top_k: int  # top logprobs per position (the largest any of these requests asked for)


@dataclass(slots=True)
class MLPSyncMetadata:
    """DP attention's per-step MLP-sync state, filled by ``ForwardBatch.init_mlp_sync_metadata``
    (all None / False without DP attention)."""

    # Per-rank token counts as the MLP sync uses them (scaled by the per-request width under
    # speculative decoding), and the raw per-rank counts (request counts for decode and verify).
    global_num_tokens_cpu: list[int] | None = None
    global_num_tokens_gpu: torch.Tensor | None = None
    global_num_tokens_for_logprob_cpu: list[int] | None = None
    global_num_tokens_for_logprob_gpu: torch.Tensor | None = None
    original_global_num_tokens_cpu: list[int] | None = None
    can_run_dp_cuda_graph: bool = False
    padding_mode: DPPaddingMode | None = None  # chosen per step from the global counts
    # Two-batch overlap: the two micro-batches' own MLP sync (each rank's rows of child A, of child
    # B), decided from the exchanged counts so every rank splits alike (an empty half of a rank is an
    # IDLE child). None: the step runs whole on every rank.
    micro_batches: tuple[MLPSyncMetadata, MLPSyncMetadata] | None = None

    def fill(self, tokens: list[int], for_logprob: list[int], original: list[int], can_run_dp_cuda_graph: bool,
             device: torch.device | str) -> None:
        """Set the per-rank counts: ``tokens`` as the MLP sync uses them, ``original`` the raw ones."""
        self.original_global_num_tokens_cpu = list(original)
        self.global_num_tokens_cpu = list(tokens)
        self.global_num_tokens_for_logprob_cpu = list(for_logprob)
        self.global_num_tokens_gpu, self.global_num_tokens_for_logprob_gpu = ints_to_device([tokens, for_logprob],
                                                                                            device)
        self.can_run_dp_cuda_graph = can_run_dp_cuda_graph


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
    # Rows of the hidden states whose logits are needed ([num_sampled], indices into T). None means
    # every row (decode). Only these rows go through the LM head.
    logits_indices: torch.Tensor | None = None
    # Prompt positions scored for their logprobs (rows of logits_indices besides the sampled ones).
    input_logprobs: InputLogprobRows | None = None
    # During graph replay the padded view runs in the captured mode; this is the runtime mode.
    actual_forward_mode: ForwardMode | None = None
    # The extend part; None for DECODE/IDLE.
    extend: ExtendInfo | None = None
    # Speculative decoding input (draft tree, custom mask); None for plain decoding.
    spec_info: SpecInput | None = None
    # True for a verify launched before its predecessor's result was read (BaseSpecWorker.launch_ahead):
    # seq_lens and extend.prefix_lens are exact on the device only, and the host lists hold lower
    # bounds (the lengths before that result). Only the verify graphs run such a batch, which plan
    # from the device tensors.
    lens_on_device: bool = False
    # DP attention's MLP sync; empty without DP attention.
    mlp_sync: MLPSyncMetadata = field(default_factory=MLPSyncMetadata)

    # --- wiring owned by the model runner ---
    # The backend that serves this forward.
    attn_backend: BatchAttentionBackend | None = None
    sampling_info: BatchSamplingInfo | None = None
    # Graph runners' static float32 [>= rows, >= vocab] buffer the LM head writes the logits into:
    # every captured graph of a runner then shares one output (a logits tensor per graph, over every
    # decode and verify bucket, grows with the vocabulary to many GiB). None: a new tensor.
    next_token_logits_buffer: torch.Tensor | None = None
    # Target hidden states an EAGLE head reads (the model writes them; see plait.layers.hidden_capture).
    # None for engines without EAGLE.
    hidden_capture: BatchHiddenCapture | None = None
    # The DP-attention runner's symmetric-memory row exchange (plait.distributed.copy_engine_rows);
    # None: NCCL collectives.
    dp_row_exchange: RowExchange | None = None

    # --- attention plan marker ---
    forward_metadata_ready: bool = False
    forward_metadata_planned_bs: int | None = None
    forward_metadata_planned_num_tokens: int | None = None
    forward_metadata_replan_equivalent: bool = False
    # Two-batch overlap: the two micro-batches this batch runs as (plait.two_batch_overlap builds
    # them; each has its own attention backend and plan). None: the batch runs whole.
    tbo_children: tuple[ForwardBatch, ForwardBatch] | None = None

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

    # --- MLP sync ----------------------------------------------------------------------------------
    def init_mlp_sync_metadata(self, batch: MLPSyncSource, device: torch.device | str) -> None:
        """Fill the DP-attention MLP-sync counts (``self.mlp_sync``) from ``batch``. The one entry
        for this: ``ScheduleBatch.to_forward_batch`` calls it, and so do workers that build a
        ForwardBatch themselves. No-op without global counts."""
        if batch.global_num_tokens is None:
            return
        assert batch.global_num_tokens_for_logprob is not None, "global counts come in pairs"
        if self.spec_info is not None:
            tokens, for_logprob = spec_scale_global_num_tokens(
                self.spec_info, batch.global_num_tokens, batch.global_num_tokens_for_logprob)
        else:
            tokens, for_logprob = list(batch.global_num_tokens), list(batch.global_num_tokens_for_logprob)
        # Raw counts size the DP graph batch; scaled counts size the MLP-sync buffers.
        self.mlp_sync.fill(tokens, for_logprob, batch.global_num_tokens, bool(batch.can_run_dp_cuda_graph), device)


class DPPaddingMode(enum.IntEnum):
    """How the tokens of all DP ranks are laid out around the TP-sharded MLP."""

    MAX_LEN = enum.auto()  # every rank padded to the max: all-gather before, reduce-scatter after
    SUM_LEN = enum.auto()  # a buffer of the summed length, rows at each rank's offset: all-reduce

    @classmethod
    def choose(cls, global_num_tokens: list[int], any_extend: bool) -> DPPaddingMode:
        """SUM_LEN whenever a rank extends (prefill lengths vary too much to pad); otherwise MAX_LEN
        when padding wastes at most half the buffer (``sum * 2 >= max * dp_size``)."""
        if any_extend:
            return cls.SUM_LEN
        total, longest = sum(global_num_tokens), max(global_num_tokens, default=0)
        return cls.MAX_LEN if total * 2 >= longest * len(global_num_tokens) else cls.SUM_LEN


def spec_request_width(spec_info: SpecInput) -> int:
    """Tokens per request of a speculative batch, from ``spec_info.num_tokens_per_req`` (an int, or
    a per-request list that must be uniform to scale other ranks' request counts)."""
    width = spec_info.num_tokens_per_req
    if isinstance(width, int):
        return width
    widths = set(width)
    if len(widths) > 1:
        raise ValueError(f"per-request widths {sorted(widths)} differ: the per-rank request counts cannot "
                         "be scaled; report token counts in global_num_tokens and pass spec_info=None")
    return widths.pop() if widths else 1


def spec_scale_global_num_tokens(spec_info: SpecInput, global_num_tokens: list[int],
                                 global_num_tokens_for_logprob: list[int]) -> tuple[list[int], list[int]]:
    """Per-rank request counts -> token counts, by the per-request width."""
    w = spec_request_width(spec_info)
    return [n * w for n in global_num_tokens], [n * w for n in global_num_tokens_for_logprob]


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
