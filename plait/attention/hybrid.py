"""HybridAttnBackend: one backend for prefill-like modes, another for decode (docs/architecture.md)."""

from __future__ import annotations

from plait.attention.base import AttentionBackend
from plait.forward_batch import ForwardBatch, ForwardMode


def select_half(mode: ForwardMode, speculative_attention_mode: str) -> str:
    """'prefill' or 'decode': the one rule for which half serves a forward mode."""
    if mode in (ForwardMode.DECODE, ForwardMode.IDLE):
        return "decode"
    if mode == ForwardMode.TARGET_VERIFY:
        return "decode" if speculative_attention_mode == "decode" else "prefill"
    return "prefill"


def serving_attention_backend(backend: AttentionBackend, fb: ForwardBatch) -> AttentionBackend:
    """The leaf backend that serves ``fb``: through wrappers (the plan checker) and, for a hybrid, the
    half its dispatch selects (the same table). For code outside the backend that needs to know
    (e.g. capabilities)."""
    return backend.serving_backend(fb.forward_mode)


def hybrid_name(prefill: str, decode: str) -> str:
    return f"hybrid(prefill={prefill},decode={decode})"


def serving_backend_name(backend: AttentionBackend) -> str:
    """The attention backend a server reports (/v1/models, /server_info): the names of the leaves
    ``serving_attention_backend`` answers for prefill-like and for decode batches; one name when
    they are the same kernel."""
    prefill = backend.serving_backend(ForwardMode.EXTEND).name
    decode = backend.serving_backend(ForwardMode.DECODE).name
    return prefill if prefill == decode else hybrid_name(prefill, decode)


class HybridAttnBackend(AttentionBackend):
    def __init__(self, prefill: AttentionBackend, decode: AttentionBackend,
                 speculative_attention_mode: str = "prefill") -> None:
        super().__init__(prefill.req_to_token_pool, prefill.kv_pool)
        if speculative_attention_mode not in ("prefill", "decode"):
            raise ValueError(
                f"speculative_attention_mode must be 'prefill' or 'decode', got {speculative_attention_mode!r}"
            )
        self.prefill_backend = prefill
        self.decode_backend = decode
        self.speculative_attention_mode = speculative_attention_mode
        self.name = hybrid_name(prefill.name, decode.name)

    def selected(self, fb: ForwardBatch) -> AttentionBackend:
        return self._half(fb.forward_mode)

    def _half(self, mode: ForwardMode) -> AttentionBackend:
        half = select_half(mode, self.speculative_attention_mode)
        return self.decode_backend if half == "decode" else self.prefill_backend

    def serving_backend(self, mode: ForwardMode) -> AttentionBackend:
        return self._half(mode).serving_backend(mode)

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        self.selected(fb).init_forward_metadata_out_graph(fb, in_capture)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        self.selected(fb).init_forward_metadata_in_graph(fb)

    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        # DECODE graphs are served by the decode half; multi-token graphs (max_num_tokens > max_bs:
        # TARGET_VERIFY) by the half the verify rule selects, which needs graph state too. The decode
        # half sees max_num_tokens only when it serves verify: verify buffers are sized per token
        # (the Triton backend's verify rows cost max_num_tokens x the context), for nothing otherwise.
        verify = self.decode_backend if self.speculative_attention_mode == "decode" else self.prefill_backend
        self.decode_backend.init_cuda_graph_state(max_bs, max_num_tokens if verify is self.decode_backend else max_bs)
        if max_num_tokens > max_bs and verify is not self.decode_backend:
            verify.init_cuda_graph_state(max_bs, max_num_tokens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.decode_backend.get_cuda_graph_seq_len_fill_value()

    def rope_kv_store_target(self, layer, fb):
        return self.selected(fb).rope_kv_store_target(layer, fb)

    def forward(self, q, k, v, layer, fb, save_kv_cache=True):
        return self.selected(fb).forward(q, k, v, layer, fb, save_kv_cache)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        return self.decode_backend.forward_decode(q, k, v, layer, fb, save_kv_cache)

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        return self.prefill_backend.forward_extend(q, k, v, layer, fb, save_kv_cache)
