"""Triton attention backend: split-KV flash decoding and prefix-aware extend over the paged cache.

Planning follows the three-method contract (plait.attention.base; docs/architecture.md):
  out_graph: host-side and per-step device prep that a replay must redo before the graph runs:
             choose the buffers, the per-request KV split count (a device tensor), extend offsets.
  in_graph:  static-shape device work: ``kv_indptr = cumsum(seq_lens)`` and the gather of
             ``kv_indices`` from ``req_to_token`` (a Triton kernel), into max-size buffers.
Once ``init_cuda_graph_state`` ran, every decode batch that fits uses the static buffers, eager or
replayed, so a replay only copies ``req_pool_indices``/``seq_lens`` and recomputes the split count.

EXTEND and MIXED batches whose extend requests are fresh prompts of one length (no cached prefix)
attend through one batched SDPA call instead of the extend kernel (``PREFILL_VIA_FLASH``).

EXTEND and MIXED batches run their leading one-token requests (a mixed step's decode rows, which the
scheduler puts first) through the decode kernel as well, over the cache that holds their new tokens'
K/V by then, and the extend kernel over the other requests (``MixedRowsMetadata``): in the extend
kernel each such request costs a program per query head whose tile has one live row.

TARGET_VERIFY (W tokens per request: the root and its draft tree, under the custom tree mask) runs
through the split-KV decode kernel: each verify token is one decode row whose KV list is its
request's cached prefix followed by the slots (``out_cache_loc``) of the draft tokens the mask lets
it see. The new tokens' K/V are stored in the cache before attention, so the rows read only the
cache; a few query tokens over a long prefix thus get the decode kernel's KV splits and fused split
merge instead of the extend kernel's one program per query block, which leaves most of the GPU idle
at small batches. out_graph writes ``qo_indptr`` and
``mask_indptr``; in_graph builds the rows (``build_verify_kv_indices``: row lengths, their cumsum, the
fill) and their split counts. Layers with a sliding window keep the extend kernel (it applies the
window; the rows do not), so a windowed model plans both. Windows are per layer (gpt-oss alternates
windowed and full layers; a model may mix several window sizes): decode plans one window plan per
distinct window and each layer reads the plan of its own window; PLAIT_TRITON_VERIFY_EXTEND=1 sends every
verify layer to the extend kernel (A/B measurement). TARGET_VERIFY batches that fit use static
buffers the same way as decode (verify graphs): the row buffers sized for ``max_num_tokens`` rows,
and the extend indptrs/prefix indices; the custom tree mask is the batch's (the graph runner hands a
view whose mask is its static mask buffer). DRAFT_EXTEND batches with a custom mask (tree-draft
steps, whose new tokens' KV goes to the dummy slot) plan the same way but take the extend kernel
only, so tree-draft graphs (plait.speculative.tree_draft_graph) get the static buffers too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from plait import envs
from plait.attention.base import AttentionBackend, AttentionLayer, custom_mask_of
from plait.attention.sinks import Float32Cache
from plait.attention.torch_flash import PackedGroup, flash_attention_fits, run_packed, sdpa_has_gqa
from plait.attention.triton.decode import DEFAULT_PROGRAMS_PER_SM
from plait.attention.triton.kernels import (
    build_kv_indices,
    build_verify_kv_indices,
    decode_attention_fwd,
    extend_attention_fwd,
    get_num_kv_splits,
    store_kv,
)
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool
from plait.transfer import copy_to_device_

MAX_KV_SPLITS = 32  # long contexts at bs=1 need many splits to fill the GPU
# The decode split planner's stage-1 programs per SM (PLAIT_DECODE_PROGRAMS_PER_SM: A/B measurement).
DECODE_PROGRAMS_PER_SM = envs.DECODE_PROGRAMS_PER_SM.get() or DEFAULT_PROGRAMS_PER_SM
# Decode merges its KV splits inside the split kernel (one launch per layer instead of two);
# PLAIT_TRITON_DECODE_TWO_STAGE=1 restores the separate merge kernel (A/B measurement, debugging).
FUSED_SPLIT_MERGE = not envs.TRITON_DECODE_TWO_STAGE.get()
# TARGET_VERIFY runs through the decode kernel, one row per verify token (module docstring);
# PLAIT_TRITON_VERIFY_EXTEND=1 sends it through the extend kernel instead (A/B measurement, debugging).
VERIFY_VIA_DECODE = not envs.TRITON_VERIFY_EXTEND.get()
# ... for batches of at most this many requests. Decode rows re-read a request's prefix once per
# verify token; the extend kernel reads it once per query block but with one program per (request,
# head): the rows win when the extend grid is too small to fill the GPU, and lose once the prefix
# reads dominate; past this batch size the extend kernel was the faster of the two.
VERIFY_ROWS_MAX_BS = 8
# A verify batch has W >= 2 rows per request, so it reaches the split heuristic's program target with
# fewer splits per row than decode does: half the decode cap loses nothing at W >= 2 and halves the
# per-row workspace (attn_logits is rows x Hq x splits x D fp32).
VERIFY_MAX_KV_SPLITS = MAX_KV_SPLITS // 2
# EXTEND / MIXED batches: their leading one-token requests (a MIXED step's decode rows, chunks of one
# token) attend through the decode kernel, and the extend kernel takes the rest. In the extend kernel
# a one-token request costs one program per query head whose BLOCK_M-row tile has a single live row
# and walks the whole prefix alone (no KV split): a mixed step of a full chunk and a few hundred
# decode rows spent most of its attention there, and one decode row over a long context outlasts the
# chunk's programs. The price of the split is one more launch per layer and three small planning
# kernels per step. PLAIT_TRITON_MIXED_EXTEND=1 keeps every row in the extend kernel.
MIXED_VIA_DECODE = not envs.TRITON_MIXED_EXTEND.get()
# EXTEND / MIXED batches whose extend requests all start from an empty cache and have one length (an
# offline run's prefill chunks of equal prompts, a single new prompt beside decode rows) need no paged
# read: their attention is plain causal attention over their own new tokens, one batched SDPA call
# (PyTorch's flash kernel), which outruns the extend kernel's causal tiles on prompts of a few hundred
# tokens. Ragged lengths keep the extend kernel: varlen_attn, the fused kernel that takes them, was the
# slower of the two there (docs/attention-backends.md). Layers with sinks, a logit cap or a window keep
# the extend kernel too. CUDA only: on the CPU (interpreter tests) the extend kernel stays the one under
# test unless a test (or PLAIT_TRITON_PREFILL_FLASH=1) turns this on. PLAIT_TRITON_PREFILL_FLASH=0 turns it
# off (A/B measurement, debugging).
_PREFILL_FLASH_ENV = envs.TRITON_PREFILL_FLASH.get()
PREFILL_VIA_FLASH = True if _PREFILL_FLASH_ENV is None else _PREFILL_FLASH_ENV
# The split cap in the Triton interpreter (CPU tests): stage 1's grid has max_kv_splits programs per
# (request, kv head), idle ones included, and the interpreter runs each one in Python; 4 still splits.
INTERPRETER_MAX_KV_SPLITS = 4


@dataclass
class DecodeBuffers:
    """Decode metadata. Owned by the backend; in graph mode these are the static buffers."""

    kv_indptr: torch.Tensor  # int32 [>= bs + 1]
    kv_indices: torch.Tensor  # int32 [>= sum(seq_lens)]
    num_kv_splits: torch.Tensor  # int32 [>= bs]
    attn_logits: torch.Tensor  # fp32 [>= bs, Hq, MAX_KV_SPLITS, D] workspace
    attn_lse: torch.Tensor  # fp32 [>= bs, Hq, MAX_KV_SPLITS]
    # int32 [>= bs * Hq], zero between kernels (the decode kernel re-zeroes what it counts): with it,
    # the last split of each (request, kv head) merges the splits, and stage 2 is not launched.
    split_counters: torch.Tensor | None


@dataclass
class ExtendMetadata:
    qo_indptr: torch.Tensor  # int32 [bs + 1] over the new tokens (the whole batch: absolute token rows)
    kv_indptr: torch.Tensor  # int32 [bs - first_request + 1] over the cached prefixes of the extend requests
    kv_indices: torch.Tensor  # int32 [sum of those prefix lens]
    max_len_extend: int  # over the requests the extend kernel takes
    custom_mask: torch.Tensor | None
    mask_indptr: torch.Tensor | None
    # The extend kernel takes requests [first_request, bs); the ones before it are decode rows
    # (``MixedRowsMetadata``), whose prefixes the extend plan does not gather.
    first_request: int = 0
    # Set when in_graph computes qo_indptr / kv_indptr from the batch's lengths (``LensIndptrs``).
    lens_indptrs: LensIndptrs | None = None


@dataclass
class MixedRowsMetadata:
    """An EXTEND / MIXED batch's leading ``num_rows`` one-token requests as decode rows: each attends
    over ``req_to_token[row, :seq_len]``, its own new token included (stored before attention).
    ``bufs`` is indexed by request; eager plans only."""

    bufs: DecodeBuffers
    num_rows: int


@dataclass
class VerifyRowsMetadata:
    """TARGET_VERIFY as decode rows: row ``qo_indptr[b] + i`` is verify token i of request b, and
    ``bufs`` is indexed by row (kv_indptr ``[num_rows + 1]``, num_kv_splits ``[num_rows]``, workspaces
    and split counters for >= num_rows rows). Filled by in_graph; eager plans own fresh buffers,
    graph-sized plans views of ``VerifyBuffers``."""

    bufs: DecodeBuffers
    row_lens: torch.Tensor  # int32 [num_rows]: prefix + visible draft tokens of each row
    num_rows: int  # = the batch's token count
    max_width: int  # host int >= every request's verify width (the index builder's grid)
    qo_indptr: torch.Tensor  # int32 [bs + 1] over the verify tokens
    mask_indptr: torch.Tensor | None  # int32 [bs + 1]: request b's mask block starts at mask_indptr[b]
    lens_indptrs: LensIndptrs | None = None  # as ExtendMetadata's


@dataclass(frozen=True)
class LensIndptrs:
    """qo / kv indptrs that in_graph computes from a chain batch's lengths on the device: a plan of a
    batch in the graph buffers then issues no work of its own (its metadata depends on the batch's
    shape only), and a replay recomputes them from the lengths its static buffers hold. Column 0 of
    each indptr stays 0."""

    qo_out: torch.Tensor  # int32 [bs]: qo_indptr[1:]
    kv_out: torch.Tensor  # int32 [bs]: kv_indptr[1:]

    def fill(self, fb: ForwardBatch) -> None:
        assert fb.extend is not None
        torch.cumsum(fb.extend.seq_lens, 0, dtype=torch.int32, out=self.qo_out)
        torch.cumsum(fb.extend.prefix_lens, 0, dtype=torch.int32, out=self.kv_out)


@dataclass
class VerifyBuffers:
    """Static metadata of TARGET_VERIFY graphs. ``kv_indices`` (the extend path's prefixes) is the
    decode buffer: a decode forward and a verify forward never overlap, and each rebuilds it before
    reading it. ``rows``/``row_lens`` (the decode-row path) are the verify rows' own: there are
    ``max_num_tokens`` of them, more than the decode buffers hold."""

    qo_indptr: torch.Tensor  # int32 [max_bs + 1]  (packed[0])
    kv_indptr: torch.Tensor  # int32 [max_bs + 1]  (packed[1])
    mask_indptr: torch.Tensor  # int32 [max_bs + 1]  (packed[2])
    packed: torch.Tensor  # int32 [3, max_bs + 1]: the storage of the three indptrs above
    kv_indices: torch.Tensor  # int32 [max_bs * max_context]
    # Decode-row buffers for row_cap = VERIFY_ROWS_MAX_BS * W rows (kv_indices [row_cap * max_context]);
    # None: extend only
    rows: DecodeBuffers | None
    row_lens: torch.Tensor | None  # int32 [row_cap]
    max_rows: int  # max_num_tokens of init_cuda_graph_state


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0)
    return out


class TritonAttnBackend(AttentionBackend):
    name = "triton"

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_q_heads: int,
                 sliding_window: int | Sequence[int] | None = None, verify_via_decode: bool | None = None) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        self.num_q_heads = num_q_heads
        # The distinct windows of the model's windowed layers (a layer with window W reads only the
        # last W keys), ascending: decode plans one more set of indices per window, covering just
        # that window, so a windowed layer reads W keys, not the whole context.
        windows = [sliding_window] if isinstance(sliding_window, int) else list(sliding_window or ())
        if any(w <= 0 for w in windows):
            raise ValueError(f"sliding windows must be positive, got {windows}")
        self.sliding_windows: tuple[int, ...] = tuple(sorted(set(windows)))
        # TARGET_VERIFY through the decode kernel (module docstring); None: VERIFY_VIA_DECODE.
        self.verify_via_decode = VERIFY_VIA_DECODE if verify_via_decode is None else verify_via_decode
        self.head_dim = kv_pool.head_dim
        self.device = kv_pool.k_buffer[0].device
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 8  # interpreter runs (tests): any positive value
        # Split caps of decode and of verify rows (plans, workspaces and kernel launches agree on them).
        self.max_kv_splits = MAX_KV_SPLITS if self.device.type == "cuda" else INTERPRETER_MAX_KV_SPLITS
        self.verify_max_kv_splits = max(1, self.max_kv_splits * VERIFY_MAX_KV_SPLITS // MAX_KV_SPLITS)
        self.graph_buffers: DecodeBuffers | None = None
        self.graph_window_buffers: dict[int, DecodeBuffers] = {}  # window -> static buffers
        self.graph_verify_buffers: VerifyBuffers | None = None
        # Plans of chain batches in the graph buffers, by shape (``_plan_verify``): views of those buffers.
        self._static_chain_plans: dict[tuple[int, int, int, bool, bool],
                                       tuple[ExtendMetadata | None, VerifyRowsMetadata | None]] = {}
        self.graph_max_bs = 0
        # Data pointers of the graph runner's static tensors that in_graph reads, recorded at capture:
        # (req_pool_indices, seq_lens) for decode; (req_pool_indices, extend.prefix_lens) for verify,
        # plus (out_cache_loc, custom mask) when it builds decode rows. in_graph checks it reads those
        # (a replay cannot feed it anything else).
        self._capture_input_ptrs: tuple[int, ...] | None = None
        self.decode_md: tuple[DecodeBuffers, int] | None = None
        self.window_md: dict[int, DecodeBuffers] = {}  # window -> plan, same bs as decode_md
        # Extend plans: extend_md for the extend kernel, verify_md for TARGET_VERIFY's decode rows
        # (a verify plan may hold both: windowed layers take the extend kernel).
        self.extend_md: ExtendMetadata | None = None
        self.verify_md: VerifyRowsMetadata | None = None
        self.mixed_rows_md: MixedRowsMetadata | None = None
        self.mixed_via_decode = MIXED_VIA_DECODE
        # The extend requests of an EXTEND / MIXED plan as one batched SDPA group (PREFILL_VIA_FLASH),
        # its token_start counted from the batch's first token.
        self.flash_prefill_md: PackedGroup | None = None
        self.prefill_via_flash = bool(_PREFILL_FLASH_ENV) if self.device.type != "cuda" else PREFILL_VIA_FLASH
        # SDPA's FlashAttention-2 kernel runs bf16 / fp16 on CUDA, on sm80+ at head dims it takes; the CPU's
        # SDPA (tests) any dtype.
        half = kv_pool.dtype in (torch.float16, torch.bfloat16)
        self.flash_usable = (not kv_pool.is_fp8 and sdpa_has_gqa() and (self.device.type != "cuda" or (
            half and flash_attention_fits(torch.cuda.get_device_capability(self.device), kv_pool.head_dim))))
        # Sink logits in fp32 (plait.attention.sinks); the current plan was made for a graph capture,
        # whose forward must convert them inside the graph.
        self.sinks_fp32 = Float32Cache()
        self._planned_for_capture = False

    # --- graph state ------------------------------------------------------------------------------
    def _decode_buffers(self, bs: int, kv_tokens: int, max_kv_splits: int | None = None) -> DecodeBuffers:
        max_kv_splits = max_kv_splits or self.max_kv_splits
        f32 = dict(dtype=torch.float32, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        return DecodeBuffers(
            kv_indptr=torch.zeros(bs + 1, **i32),
            kv_indices=torch.zeros(max(1, kv_tokens), **i32),
            num_kv_splits=torch.ones(bs, **i32),
            attn_logits=torch.empty(bs, self.num_q_heads, max_kv_splits, self.head_dim, **f32),
            attn_lse=torch.empty(bs, self.num_q_heads, max_kv_splits, **f32),
            split_counters=torch.zeros(bs * self.num_q_heads, **i32) if FUSED_SPLIT_MERGE else None,
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static buffers for graphs of up to ``max_bs`` requests; ``max_num_tokens > max_bs`` means
        multi-token (TARGET_VERIFY) graphs of up to ``max_num_tokens`` tokens are captured too.
        Grow-only: buffers a captured graph reads are never reallocated, so the decode and verify graph
        runners may both call this (the first call must already carry the largest ``max_bs``, the first
        verify call the largest ``max_num_tokens``)."""
        if self.graph_buffers is not None and max_bs > self.graph_max_bs:
            raise RuntimeError(f"init_cuda_graph_state: max_bs {max_bs} exceeds the {self.graph_max_bs} of the "
                               "buffers captured graphs already read")
        verify = self.graph_verify_buffers
        if max_num_tokens > max_bs and verify is not None and max_num_tokens > verify.max_rows:
            raise RuntimeError(f"init_cuda_graph_state: max_num_tokens {max_num_tokens} exceeds the {verify.max_rows} "
                               "of the verify buffers captured graphs already read")
        max_context = self.req_to_token_pool.max_context_len
        if self.graph_buffers is None:
            self.graph_buffers = self._decode_buffers(max_bs, max_bs * max_context)
            self.graph_window_buffers = {w: self._decode_buffers(max_bs, max_bs * min(w, max_context))
                                         for w in self.sliding_windows}
            self.graph_max_bs = max_bs
        if max_num_tokens > max_bs and verify is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            n = self.graph_max_bs + 1
            rows = row_lens = None
            if self.verify_via_decode:
                # Rows only serve buckets of <= VERIFY_ROWS_MAX_BS requests of <= W tokens each. One
                # KV list per verify token, each <= max_context slots (prefix + W <= the context):
                # kv_indices costs row_cap * max_context * 4 B (8 requests x W 4 at a 128k context:
                # 16 MiB); the fp32 workspaces row_cap * Hq * VERIFY_MAX_KV_SPLITS * (D + 1) * 4 B.
                width = max(1, max_num_tokens // max_bs)
                row_cap = min(max_num_tokens, VERIFY_ROWS_MAX_BS * width)
                rows = self._decode_buffers(row_cap, row_cap * max_context, self.verify_max_kv_splits)
                row_lens = torch.zeros(row_cap, **i32)
            # The three per-request indptrs in one buffer: a plan fills them with one host-to-device copy.
            packed = torch.zeros(3, n, **i32)
            self.graph_verify_buffers = VerifyBuffers(
                qo_indptr=packed[0], kv_indptr=packed[1], mask_indptr=packed[2], packed=packed,
                kv_indices=self.graph_buffers.kv_indices, rows=rows, row_lens=row_lens, max_rows=max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # --- planning ---------------------------------------------------------------------------------
    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        self._planned_for_capture = in_capture
        self.mixed_rows_md = None  # only an EXTEND / MIXED plan below sets it
        self.flash_prefill_md = None  # nor this
        if fb.forward_mode.is_decode() or fb.forward_mode.is_idle():
            bs = fb.batch_size
            static = self.graph_buffers is not None and bs <= self.graph_max_bs
            bufs = self.graph_buffers if static else self._decode_buffers(bs, fb.seq_lens_sum)
            self.window_md = {w: self.graph_window_buffers[w] if static else self._decode_buffers(bs, bs * w)
                              for w in self.sliding_windows}
            # Capture planning arms the check in in_graph; any other planning disarms it.
            self._capture_input_ptrs = (
                (fb.req_pool_indices.data_ptr(), fb.seq_lens.data_ptr()) if in_capture else None)
            num_kv_heads = self.kv_pool.num_kv_heads
            get_num_kv_splits(fb.seq_lens, bufs.num_kv_splits, self.max_kv_splits, self.num_sms, num_kv_heads,
                              DECODE_PROGRAMS_PER_SM)
            for w, win in self.window_md.items():
                get_num_kv_splits(fb.seq_lens.clamp(max=w), win.num_kv_splits, self.max_kv_splits, self.num_sms,
                                  num_kv_heads, DECODE_PROGRAMS_PER_SM)
            self.decode_md = (bufs, bs)
            return
        assert fb.extend is not None
        mask = custom_mask_of(fb)
        if fb.forward_mode.is_target_verify():
            self._plan_verify(fb, mask, in_capture)
            return
        if fb.forward_mode.is_draft_extend() and mask is not None:
            # Tree-draft steps (plait.speculative.draft_tree): a custom mask, KV into the dummy slot.
            # The verify plan's static buffers serve their graphs; the extend kernel only, as decode
            # rows would read the new tokens' K/V back from the cache.
            self._plan_verify(fb, mask, in_capture, allow_rows=False)
            return
        self._capture_input_ptrs = None
        self.verify_md = None
        mask_indptr = None
        if mask is not None:
            sizes = [e * (e + p) for e, p in zip(fb.extend.seq_lens_cpu, fb.extend.prefix_lens_cpu, strict=True)]
            mask_indptr = _indptr(torch.tensor(sizes, dtype=torch.int64, device=self.device))
        # Decode rows and the SDPA group apply neither a custom mask nor a window, and not to
        # DRAFT_EXTEND: a draft step's new tokens may write their K/V elsewhere (the dummy slot).
        splittable = (mask is None and not self.sliding_windows
                      and fb.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED))
        rows = self._leading_decode_rows(fb) if splittable and self.mixed_via_decode else 0
        if rows:
            bufs = self._decode_buffers(rows, sum(fb.extend.prefix_lens_cpu[:rows]) + rows)
            get_num_kv_splits(fb.seq_lens[:rows], bufs.num_kv_splits, self.max_kv_splits, self.num_sms,
                              self.kv_pool.num_kv_heads, DECODE_PROGRAMS_PER_SM)
            self.mixed_rows_md = MixedRowsMetadata(bufs=bufs, num_rows=rows)
        self.flash_prefill_md = (self._plan_flash_prefill(fb, rows)
                                 if splittable and self.prefill_via_flash and self.flash_usable and not in_capture
                                 else None)
        self.extend_md = ExtendMetadata(
            qo_indptr=_indptr(fb.extend.seq_lens),
            kv_indptr=_indptr(fb.extend.prefix_lens[rows:]),
            kv_indices=torch.empty(max(1, sum(fb.extend.prefix_lens_cpu[rows:])), dtype=torch.int32,
                                   device=self.device),
            max_len_extend=max(fb.extend.seq_lens_cpu[rows:], default=0),
            custom_mask=mask,
            mask_indptr=mask_indptr,
            first_request=rows,
        )

    def _plan_verify(self, fb: ForwardBatch, mask: torch.Tensor | None, in_capture: bool,
                     allow_rows: bool = True) -> None:
        """TARGET_VERIFY: the decode-row plan (``verify_md``) and, when windowed layers or the A/B switch
        need it, the extend plan (``extend_md``). A batch that fits the graph buffers plans into them,
        eager or replayed, so a graph captured on them sees every later plan. Device ops only on the
        per-request indptrs: no host sync. ``allow_rows=False`` (tree-draft steps): extend plan only."""
        assert fb.extend is not None
        bs = fb.batch_size
        num_rows = sum(fb.extend.seq_lens_cpu)
        max_width = max(fb.extend.seq_lens_cpu)
        static = self.graph_verify_buffers
        use_rows = allow_rows and self.verify_via_decode and bs <= VERIFY_ROWS_MAX_BS  # bs: the padded bucket
        if static is not None and (bs > self.graph_max_bs or (
                use_rows and static.rows is not None and num_rows > static.rows.num_kv_splits.shape[0])):
            static = None
        use_extend = not use_rows or bool(self.sliding_windows)

        # qo / kv / mask indptrs. A verify step's planning runs while the GPU idles, so it costs what
        # the host spends issuing it. Request b's mask block is ext_b x (prefix_b + ext_b).
        ext, pre = fb.extend.seq_lens_cpu, fb.extend.prefix_lens_cpu
        if fb.lens_on_device and (static is None or mask is not None):
            # Launched ahead of its predecessor's result: the host's prefix lengths are lower bounds.
            raise RuntimeError("a verify batch with its lengths on the device only runs as a chain batch in "
                               "a verify graph")
        if static is not None and mask is None:
            # A chain batch in the graph buffers: qo and kv from the lengths already on the device, in
            # in_graph (``LensIndptrs``; a host-to-device copy costs the host several times their
            # launches). The plan depends on the batch's shape only: made once per shape, reused.
            key = (bs, num_rows, max_width, use_rows, use_extend)
            plan = self._static_chain_plans.get(key)
            if plan is None:
                packed = static.packed
                lens = LensIndptrs(qo_out=packed[0, 1 : bs + 1], kv_out=packed[1, 1 : bs + 1])
                plan = self._static_chain_plans[key] = self._verify_plan(
                    fb, static, packed[0, : bs + 1], packed[1, : bs + 1], None, None, use_rows, use_extend, lens)
            self.extend_md, self.verify_md = plan
        else:
            # From the host lists, in one pinned copy (not three cumsums and their stores).
            packed = static.packed if static is not None else torch.empty(3, bs + 1, dtype=torch.int32,
                                                                          device=self.device)
            host = np.zeros(tuple(packed.shape), dtype=np.int32)
            np.cumsum(ext, out=host[0, 1 : bs + 1])
            np.cumsum(pre, out=host[1, 1 : bs + 1])
            np.cumsum(np.multiply(ext, np.add(pre, ext)), out=host[2, 1 : bs + 1])
            copy_to_device_(packed, torch.from_numpy(host))
            mask_indptr = packed[2, : bs + 1] if mask is not None else None
            self.extend_md, self.verify_md = self._verify_plan(fb, static, packed[0, : bs + 1], packed[1, : bs + 1],
                                                               mask, mask_indptr, use_rows, use_extend, None)
        # Capture planning arms the check in in_graph; any other planning disarms it.
        self._capture_input_ptrs = self._verify_input_ptrs(fb) if in_capture else None

    def _verify_plan(self, fb: ForwardBatch, static: VerifyBuffers | None, qo_indptr: torch.Tensor,
                     kv_indptr: torch.Tensor, mask: torch.Tensor | None, mask_indptr: torch.Tensor | None,
                     use_rows: bool, use_extend: bool, lens: LensIndptrs | None
                     ) -> tuple[ExtendMetadata | None, VerifyRowsMetadata | None]:
        """The extend and decode-row metadata of a verify plan over the given indptrs (``_plan_verify``)."""
        assert fb.extend is not None
        ext, pre = fb.extend.seq_lens_cpu, fb.extend.prefix_lens_cpu
        num_rows, max_width = sum(ext), max(ext)
        extend_md = None
        if use_extend:
            if static is not None:
                kv_indices = static.kv_indices
            else:
                kv_indices = torch.empty(max(1, sum(pre)), dtype=torch.int32, device=self.device)
            extend_md = ExtendMetadata(qo_indptr=qo_indptr, kv_indptr=kv_indptr, kv_indices=kv_indices,
                                       max_len_extend=max_width, custom_mask=mask, mask_indptr=mask_indptr,
                                       lens_indptrs=lens)
        verify_md = None
        if use_rows:
            if static is not None:
                assert static.rows is not None and static.row_lens is not None
                bufs, row_lens = static.rows, static.row_lens[:num_rows]
            else:
                # Row b,i holds at most prefix_b + ext_b slots: the mask size bounds the total.
                kv_tokens = sum(e * (p + e) for e, p in zip(ext, pre, strict=True))
                bufs = self._decode_buffers(num_rows, kv_tokens, self.verify_max_kv_splits)
                row_lens = torch.empty(num_rows, dtype=torch.int32, device=self.device)
            verify_md = VerifyRowsMetadata(bufs=bufs, row_lens=row_lens, num_rows=num_rows, max_width=max_width,
                                           qo_indptr=qo_indptr, mask_indptr=mask_indptr, lens_indptrs=lens)
        return extend_md, verify_md

    @staticmethod
    def _leading_decode_rows(fb: ForwardBatch) -> int:
        """How many of an EXTEND / MIXED batch's first requests attend as decode rows (``MIXED_VIA_DECODE``):
        the leading run of one-token requests (the scheduler puts a MIXED step's decode rows first)."""
        assert fb.extend is not None
        rows = 0
        for n in fb.extend.seq_lens_cpu:
            if n != 1:
                break
            rows += 1
        return rows

    @staticmethod
    def _plan_flash_prefill(fb: ForwardBatch, rows: int) -> PackedGroup | None:
        """Requests ``[rows, bs)`` as one batched SDPA group (``PREFILL_VIA_FLASH``), or None when there are
        none or one of them has a cached prefix or another length (the extend kernel then takes them all)."""
        assert fb.extend is not None
        ext, pre = fb.extend.seq_lens_cpu[rows:], fb.extend.prefix_lens_cpu[rows:]
        if not ext or any(p != 0 for p in pre) or any(e != ext[0] for e in ext):
            return None
        return PackedGroup(length=ext[0], count=len(ext), token_start=sum(fb.extend.seq_lens_cpu[:rows]), q_src=None)

    def _verify_input_ptrs(self, fb: ForwardBatch) -> tuple[int, ...]:
        """The tensors of ``fb`` that in_graph reads for a verify plan (see ``_capture_input_ptrs``)."""
        assert fb.extend is not None
        ptrs: tuple[int, ...] = (fb.req_pool_indices.data_ptr(), fb.extend.prefix_lens.data_ptr())
        if self._lens_indptrs() is not None:
            ptrs += (fb.extend.seq_lens.data_ptr(),)
        if self.verify_md is not None:
            mask = custom_mask_of(fb)
            ptrs += (fb.out_cache_loc.data_ptr(), mask.data_ptr() if mask is not None else 0)
        return ptrs

    def _lens_indptrs(self) -> LensIndptrs | None:
        """The current verify plan's indptrs that in_graph computes (a chain batch in the graph buffers)."""
        md = self.extend_md if self.extend_md is not None else self.verify_md
        return md.lens_indptrs if md is not None else None

    def _check_capture_inputs(self, ptrs: tuple[int, ...]) -> None:
        if self._capture_input_ptrs is not None and ptrs != self._capture_input_ptrs:
            raise RuntimeError("init_forward_metadata_in_graph must read the graph runner's static buffers "
                               "(req_pool_indices / seq_lens or extend.prefix_lens, extend.seq_lens for a chain "
                               "plan, and for verify rows out_cache_loc / the custom mask), not a per-step tensor")

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode() or fb.forward_mode.is_idle():
            assert self.decode_md is not None, "out_graph plans before in_graph"
            bufs, bs = self.decode_md
            self._check_capture_inputs((fb.req_pool_indices.data_ptr(), fb.seq_lens.data_ptr()))
            bufs.kv_indptr[1 : bs + 1] = torch.cumsum(fb.seq_lens, 0)
            build_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                             bufs.kv_indptr, bufs.kv_indices)
            for w, win in self.window_md.items():
                lens = fb.seq_lens.clamp(max=w)
                win.kv_indptr[1 : bs + 1] = torch.cumsum(lens, 0)
                build_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices, lens, win.kv_indptr,
                                 win.kv_indices, kv_start_idx=fb.seq_lens - lens)
            return
        assert fb.extend is not None
        if fb.forward_mode.is_target_verify():
            self._check_capture_inputs(self._verify_input_ptrs(fb))
        else:
            self._check_capture_inputs((fb.req_pool_indices.data_ptr(), fb.extend.prefix_lens.data_ptr()))
        md = self.extend_md
        assert md is not None or self.verify_md is not None, "out_graph plans before in_graph"
        lens = self._lens_indptrs()
        if lens is not None:  # before anything reads the indptrs
            lens.fill(fb)
        if md is not None:
            first = md.first_request
            build_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices[first:],
                             fb.extend.prefix_lens[first:], md.kv_indptr, md.kv_indices)
        mixed = self.mixed_rows_md
        if mixed is not None:
            n, bufs = mixed.num_rows, mixed.bufs
            bufs.kv_indptr[1 : n + 1] = torch.cumsum(fb.seq_lens[:n], 0)
            build_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices[:n], fb.seq_lens[:n],
                             bufs.kv_indptr, bufs.kv_indices)
        rows = self.verify_md
        if rows is not None:
            build_verify_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.extend.prefix_lens,
                                    rows.qo_indptr, fb.out_cache_loc, custom_mask_of(fb), rows.mask_indptr,
                                    rows.max_width, rows.row_lens, rows.bufs.kv_indptr, rows.bufs.kv_indices)
            # From the row lengths just built: in the graph, so a replay recomputes them too.
            get_num_kv_splits(rows.row_lens, rows.bufs.num_kv_splits, self.verify_max_kv_splits, self.num_sms,
                              self.kv_pool.num_kv_heads)

    # --- compute ----------------------------------------------------------------------------------
    def _sinks(self, layer: AttentionLayer) -> torch.Tensor | None:
        """The layer's sinks in fp32 (plait.attention.sinks): converted inside a capture, else cached."""
        if layer.sinks is None:
            return None
        return self.sinks_fp32.get(layer.sinks, capturing=self._planned_for_capture)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        k_buf = self.kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer.layer_id)
        k_scale, v_scale = self.kv_pool.kv_scales_of(layer.layer_id)
        if save_kv_cache:
            store_kv(k_buf, v_buf, fb.out_cache_loc, k.view(-1, hkv, d), v.view(-1, hkv, d), k_scale, v_scale)
        assert self.decode_md is not None
        bufs, bs = self.decode_md
        if layer.sliding_window:
            assert layer.sliding_window in self.window_md, (
                f"layer {layer.layer_id}'s sliding window {layer.sliding_window} is not among the backend's "
                f"{self.sliding_windows}: build it with every window of the model")
            bufs = self.window_md[layer.sliding_window]
        q3 = q.view(-1, hq, d)
        o = torch.empty_like(q3)
        decode_attention_fwd(q3, k_buf, v_buf, o, bufs.kv_indptr[: bs + 1], bufs.kv_indices, bufs.attn_logits,
                             bufs.attn_lse, bufs.num_kv_splits[:bs], self.max_kv_splits, layer.scaling, layer.logit_cap,
                             split_counters=bufs.split_counters, sinks=self._sinks(layer),
                             k_scale=k_scale, v_scale=v_scale)
        return o.view(-1, hq * d)

    def rope_kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Decode and every extend mode store the new tokens with store_kv at out_cache_loc; the
        # extend kernel reads the new tokens' K/V from the (rotated in place) k/v tensors, verify rows
        # read them from the cache (stored before attention either way).
        # An FP8 cache stores scaled, saturated values: store_kv writes it, not the rotary kernel.
        if fb.forward_mode.is_idle() or self.kv_pool.is_fp8:
            return None
        return self.kv_pool.get_key_buffer(layer.layer_id), self.kv_pool.get_value_buffer(layer.layer_id)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        k_buf = self.kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer.layer_id)
        # Views into the fused qkv projection's output (token stride > Hkv * D): the kernels take
        # strides, so nothing is copied.
        k3, v3 = k.view(-1, hkv, d), v.view(-1, hkv, d)
        k_scale, v_scale = self.kv_pool.kv_scales_of(layer.layer_id)
        if save_kv_cache:
            store_kv(k_buf, v_buf, fb.out_cache_loc, k3, v3, k_scale, v_scale)
        k3, v3 = self.kv_pool.as_stored(layer.layer_id, k3, v3)
        q3 = q.view(-1, hq, d)
        o = torch.empty_like(q3)
        rows = self.verify_md
        if fb.forward_mode.is_target_verify() and rows is not None and not layer.sliding_window:
            # The new tokens' K/V are in the cache now (stored above, or by the rotary kernel when
            # save_kv_cache is False): each verify token attends over its row's slots only.
            bufs = rows.bufs
            decode_attention_fwd(q3, k_buf, v_buf, o, bufs.kv_indptr[: rows.num_rows + 1], bufs.kv_indices,
                                 bufs.attn_logits, bufs.attn_lse, bufs.num_kv_splits[: rows.num_rows],
                                 self.verify_max_kv_splits, layer.scaling, layer.logit_cap,
                                 split_counters=bufs.split_counters, sinks=self._sinks(layer),
                                 k_scale=k_scale, v_scale=v_scale)
            return o.view(-1, hq * d)
        md = self.extend_md
        assert md is not None, ("a windowed layer needs the extend plan: build the backend with every window of "
                                "the model")
        mixed = self.mixed_rows_md
        if mixed is not None:
            # The leading one-token requests: decode rows over the cache, which holds their new tokens'
            # K/V now (stored above, or by the rotary kernel when save_kv_cache is False).
            n, bufs = mixed.num_rows, mixed.bufs
            decode_attention_fwd(q3[:n], k_buf, v_buf, o[:n], bufs.kv_indptr[: n + 1], bufs.kv_indices,
                                 bufs.attn_logits, bufs.attn_lse, bufs.num_kv_splits[:n], self.max_kv_splits,
                                 layer.scaling, layer.logit_cap, split_counters=bufs.split_counters,
                                 sinks=self._sinks(layer), k_scale=k_scale, v_scale=v_scale)
        flash = self.flash_prefill_md
        if flash is not None and layer.sinks is None and layer.logit_cap <= 0:
            run_packed(flash, q3, k3, v3, layer.scaling, None, o)
            return o.view(-1, hq * d)
        extend_attention_fwd(q3, k3, v3, o, k_buf, v_buf, md.qo_indptr[md.first_request:], md.kv_indptr, md.kv_indices,
                             md.custom_mask, md.mask_indptr, md.max_len_extend, layer.scaling,
                             is_causal=md.custom_mask is None, logit_cap=layer.logit_cap,
                             sliding_window=layer.sliding_window, sinks=self._sinks(layer),
                             k_scale=k_scale, v_scale=v_scale)
        return o.view(-1, hq * d)
