"""Triton attention backend: split-KV flash decoding and prefix-aware extend over the paged cache.

Planning follows the three-method contract (DESIGN 3.2):
  out_graph: host-side and per-step device prep that a replay must redo before the graph runs:
             choose the buffers, the per-request KV split count (a device tensor), extend offsets.
  in_graph:  static-shape device work: ``kv_indptr = cumsum(seq_lens)`` and the gather of
             ``kv_indices`` from ``req_to_token`` (a Triton kernel), into max-size buffers.
Once ``init_cuda_graph_state`` ran, every decode batch that fits uses the static buffers, eager or
replayed, so a replay only copies ``req_pool_indices``/``seq_lens`` and recomputes the split count.
TARGET_VERIFY batches that fit use static extend buffers the same way (verify graphs): out_graph
writes the three indptrs into them, in_graph gathers the prefix indices; the custom tree mask is the
batch's (the graph runner hands a view whose mask is its static mask buffer).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from plait.attention.base import AttentionBackend, AttentionLayer, custom_mask_of
from plait.attention.triton.kernels import (
    build_kv_indices,
    decode_attention_fwd,
    extend_attention_fwd,
    get_num_kv_splits,
    store_kv,
)
from plait.forward_batch import ForwardBatch
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool

MAX_KV_SPLITS = 32  # long contexts at bs=1 need many splits (measured: 32k ctx 61 -> 56 us)
# Decode merges its KV splits inside the split kernel (one launch per layer instead of two);
# PLAIT_TRITON_DECODE_TWO_STAGE=1 restores the separate merge kernel (A/B measurement, debugging).
FUSED_SPLIT_MERGE = os.environ.get("PLAIT_TRITON_DECODE_TWO_STAGE") != "1"


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
    qo_indptr: torch.Tensor  # int32 [bs + 1] over the new tokens
    kv_indptr: torch.Tensor  # int32 [bs + 1] over cached prefixes
    kv_indices: torch.Tensor  # int32 [sum(prefix lens)]
    max_len_extend: int
    custom_mask: torch.Tensor | None
    mask_indptr: torch.Tensor | None


@dataclass
class VerifyBuffers:
    """Static extend metadata of TARGET_VERIFY graphs. ``kv_indices`` is the decode buffer: a decode
    forward and a verify forward never overlap, and each rebuilds it before reading it."""

    qo_indptr: torch.Tensor  # int32 [max_bs + 1]
    kv_indptr: torch.Tensor  # int32 [max_bs + 1]
    mask_indptr: torch.Tensor  # int32 [max_bs + 1]
    kv_indices: torch.Tensor  # int32 [max_bs * max_context]


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    out = torch.zeros(lengths.shape[0] + 1, dtype=torch.int32, device=lengths.device)
    out[1:] = torch.cumsum(lengths, 0)
    return out


def _indptr_into(out: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """``_indptr`` written into the prefix of a static buffer (same storage at every replay)."""
    bs = lengths.shape[0]
    view = out[: bs + 1]
    view[0] = 0
    view[1:] = torch.cumsum(lengths, 0)
    return view


class TritonAttnBackend(AttentionBackend):
    name = "triton"

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_q_heads: int,
                 sliding_window: int | None = None) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        self.num_q_heads = num_q_heads
        # The model's window (layers with one read only the last W keys): decode plans a second set
        # of indices covering just the window, so windowed layers read W keys, not the whole context.
        self.sliding_window = sliding_window
        self.head_dim = kv_pool.head_dim
        self.device = kv_pool.k_buffer[0].device
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 8  # interpreter runs (tests): any positive value
        self.graph_buffers: DecodeBuffers | None = None
        self.graph_window_buffers: DecodeBuffers | None = None
        self.graph_verify_buffers: VerifyBuffers | None = None
        self.graph_max_bs = 0
        # Data pointers of the graph runner's static req_pool_indices / seq_lens (decode) or
        # extend_prefix_lens (verify), recorded at capture: in_graph checks it reads those (a replay
        # cannot feed it anything else).
        self._capture_input_ptrs: tuple[int, int] | None = None
        self.decode_md: tuple[DecodeBuffers, int] | None = None
        self.window_md: DecodeBuffers | None = None  # same bs as decode_md
        self.extend_md: ExtendMetadata | None = None

    # --- graph state ------------------------------------------------------------------------------
    def _decode_buffers(self, bs: int, kv_tokens: int) -> DecodeBuffers:
        f32 = dict(dtype=torch.float32, device=self.device)
        i32 = dict(dtype=torch.int32, device=self.device)
        return DecodeBuffers(
            kv_indptr=torch.zeros(bs + 1, **i32),
            kv_indices=torch.zeros(max(1, kv_tokens), **i32),
            num_kv_splits=torch.ones(bs, **i32),
            attn_logits=torch.empty(bs, self.num_q_heads, MAX_KV_SPLITS, self.head_dim, **f32),
            attn_lse=torch.empty(bs, self.num_q_heads, MAX_KV_SPLITS, **f32),
            split_counters=torch.zeros(bs * self.num_q_heads, **i32) if FUSED_SPLIT_MERGE else None,
        )

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        """Static buffers for graphs of up to ``max_bs`` requests; ``max_num_tokens > max_bs`` means
        multi-token (TARGET_VERIFY) graphs are captured too. Grow-only: buffers a captured graph
        reads are never reallocated, so the decode and verify graph runners may both call this (the
        first call must already carry the largest ``max_bs``)."""
        if self.graph_buffers is not None and max_bs > self.graph_max_bs:
            raise RuntimeError(f"init_cuda_graph_state: max_bs {max_bs} exceeds the {self.graph_max_bs} of the "
                               "buffers captured graphs already read")
        if self.graph_buffers is None:
            max_context = self.req_to_token_pool.max_context_len
            self.graph_buffers = self._decode_buffers(max_bs, max_bs * max_context)
            if self.sliding_window:
                self.graph_window_buffers = self._decode_buffers(max_bs,
                                                                 max_bs * min(self.sliding_window, max_context))
            self.graph_max_bs = max_bs
        if max_num_tokens > max_bs and self.graph_verify_buffers is None:
            i32 = dict(dtype=torch.int32, device=self.device)
            n = self.graph_max_bs + 1
            self.graph_verify_buffers = VerifyBuffers(
                qo_indptr=torch.zeros(n, **i32), kv_indptr=torch.zeros(n, **i32),
                mask_indptr=torch.zeros(n, **i32),
                kv_indices=self.graph_buffers.kv_indices)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # --- planning ---------------------------------------------------------------------------------
    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        if fb.forward_mode.is_decode() or fb.forward_mode.is_idle():
            bs = fb.batch_size
            static = self.graph_buffers is not None and bs <= self.graph_max_bs
            bufs = self.graph_buffers if static else self._decode_buffers(bs, fb.seq_lens_sum)
            self.window_md = None
            if self.sliding_window:
                self.window_md = self.graph_window_buffers if static else self._decode_buffers(
                    bs, bs * self.sliding_window)
            # Capture planning arms the check in in_graph; any other planning disarms it.
            self._capture_input_ptrs = (
                (fb.req_pool_indices.data_ptr(), fb.seq_lens.data_ptr()) if in_capture else None)
            num_kv_heads = self.kv_pool.num_kv_heads
            get_num_kv_splits(fb.seq_lens, bufs.num_kv_splits, MAX_KV_SPLITS, self.num_sms, num_kv_heads)
            if self.window_md is not None:
                get_num_kv_splits(fb.seq_lens.clamp(max=self.sliding_window), self.window_md.num_kv_splits,
                                  MAX_KV_SPLITS, self.num_sms, num_kv_heads)
            self.decode_md = (bufs, bs)
            return
        assert fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
        assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
        mask = custom_mask_of(fb)
        static = self.graph_verify_buffers
        if fb.forward_mode.is_target_verify() and static is not None and fb.batch_size <= self.graph_max_bs:
            self._plan_verify_static(fb, static, mask, in_capture)
            return
        self._capture_input_ptrs = None
        mask_indptr = None
        if mask is not None:
            sizes = [e * (e + p) for e, p in zip(fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu, strict=True)]
            mask_indptr = _indptr(torch.tensor(sizes, dtype=torch.int64, device=self.device))
        self.extend_md = ExtendMetadata(
            qo_indptr=_indptr(fb.extend_seq_lens),
            kv_indptr=_indptr(fb.extend_prefix_lens),
            kv_indices=torch.empty(max(1, sum(fb.extend_prefix_lens_cpu)), dtype=torch.int32, device=self.device),
            max_len_extend=max(fb.extend_seq_lens_cpu),
            custom_mask=mask,
            mask_indptr=mask_indptr,
        )

    def _plan_verify_static(self, fb: ForwardBatch, static: VerifyBuffers, mask: torch.Tensor | None,
                            in_capture: bool) -> None:
        """A verify batch that fits the graph buffers plans into them, eager or replayed, so a graph
        captured on them sees every later plan. Device ops only: no host sync."""
        assert fb.extend_seq_lens is not None and fb.extend_prefix_lens is not None
        assert fb.extend_seq_lens_cpu is not None
        mask_indptr = None
        if mask is not None:
            # Request i's mask block is ext_i x (prefix_i + ext_i).
            sizes = fb.extend_seq_lens.to(torch.int64) * (fb.extend_prefix_lens + fb.extend_seq_lens)
            mask_indptr = _indptr_into(static.mask_indptr, sizes)
        self._capture_input_ptrs = (
            (fb.req_pool_indices.data_ptr(), fb.extend_prefix_lens.data_ptr()) if in_capture else None)
        self.extend_md = ExtendMetadata(
            qo_indptr=_indptr_into(static.qo_indptr, fb.extend_seq_lens),
            kv_indptr=_indptr_into(static.kv_indptr, fb.extend_prefix_lens),
            kv_indices=static.kv_indices,
            max_len_extend=max(fb.extend_seq_lens_cpu),
            custom_mask=mask,
            mask_indptr=mask_indptr,
        )

    def _check_capture_inputs(self, a: torch.Tensor, b: torch.Tensor) -> None:
        if self._capture_input_ptrs is not None and (a.data_ptr(), b.data_ptr()) != self._capture_input_ptrs:
            raise RuntimeError("init_forward_metadata_in_graph must read the graph runner's static buffers "
                               "(req_pool_indices / seq_lens or extend_prefix_lens), not a per-step tensor")

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_decode() or fb.forward_mode.is_idle():
            assert self.decode_md is not None, "out_graph plans before in_graph"
            bufs, bs = self.decode_md
            self._check_capture_inputs(fb.req_pool_indices, fb.seq_lens)
            bufs.kv_indptr[1 : bs + 1] = torch.cumsum(fb.seq_lens, 0)
            build_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.seq_lens,
                             bufs.kv_indptr, bufs.kv_indices)
            if self.window_md is not None:
                win = self.window_md
                lens = fb.seq_lens.clamp(max=self.sliding_window)
                win.kv_indptr[1 : bs + 1] = torch.cumsum(lens, 0)
                build_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices, lens, win.kv_indptr,
                                 win.kv_indices, kv_start_idx=fb.seq_lens - lens)
            return
        md = self.extend_md
        assert md is not None and fb.extend_prefix_lens is not None
        self._check_capture_inputs(fb.req_pool_indices, fb.extend_prefix_lens)
        build_kv_indices(self.req_to_token_pool.req_to_token, fb.req_pool_indices, fb.extend_prefix_lens,
                         md.kv_indptr, md.kv_indices)

    # --- compute ----------------------------------------------------------------------------------
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        k_buf = self.kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer.layer_id)
        if save_kv_cache:
            store_kv(k_buf, v_buf, fb.out_cache_loc, k.view(-1, hkv, d), v.view(-1, hkv, d))
        assert self.decode_md is not None
        bufs, bs = self.decode_md
        if layer.sliding_window:
            assert self.window_md is not None and layer.sliding_window == self.sliding_window, (
                "the backend was built for the model's sliding window")
            bufs = self.window_md
        q3 = q.view(-1, hq, d)
        o = torch.empty_like(q3)
        decode_attention_fwd(q3, k_buf, v_buf, o, bufs.kv_indptr[: bs + 1], bufs.kv_indices, bufs.attn_logits,
                             bufs.attn_lse, bufs.num_kv_splits[:bs], MAX_KV_SPLITS, layer.scaling, layer.logit_cap,
                             split_counters=bufs.split_counters)
        return o.view(-1, hq * d)

    def rope_kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        # Decode and every extend mode store the new tokens with store_kv at out_cache_loc; the
        # extend kernel reads the new tokens' K/V from the (rotated in place) k/v tensors.
        if fb.forward_mode.is_idle():
            return None
        return self.kv_pool.get_key_buffer(layer.layer_id), self.kv_pool.get_value_buffer(layer.layer_id)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                       fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        k_buf = self.kv_pool.get_key_buffer(layer.layer_id)
        v_buf = self.kv_pool.get_value_buffer(layer.layer_id)
        k3, v3 = k.view(-1, hkv, d), v.view(-1, hkv, d)
        if save_kv_cache:
            store_kv(k_buf, v_buf, fb.out_cache_loc, k3, v3)
        md = self.extend_md
        assert md is not None
        q3 = q.view(-1, hq, d)
        o = torch.empty_like(q3)
        extend_attention_fwd(q3, k3.contiguous(), v3.contiguous(), o, k_buf, v_buf, md.qo_indptr, md.kv_indptr,
                             md.kv_indices, md.custom_mask, md.mask_indptr, md.max_len_extend, layer.scaling,
                             is_causal=md.custom_mask is None, logit_cap=layer.logit_cap,
                             sliding_window=layer.sliding_window)
        return o.view(-1, hq * d)
