"""Reference attention backend in plain PyTorch: exact, slow, runs anywhere.

It gathers each request's K/V from the paged cache through ``req_to_token`` and computes attention
in float32. It is the correctness reference for the Triton kernels and the CPU backend.
"""

from __future__ import annotations

import torch

from plait.attention.base import AttentionBackend, AttentionLayer, custom_mask_of
from plait.attention.sinks import Float32Cache
from plait.forward_batch import ForwardBatch
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool


def _softmax_with_sinks(scores: torch.Tensor, sink_logits: torch.Tensor | None) -> torch.Tensor:
    """Softmax over the last dim of ``scores``; ``sink_logits`` (fp32, broadcastable to
    ``scores.shape[:-1] + (1,)``: one logit per head) joins each denominator and is dropped after."""
    if sink_logits is None:
        return torch.softmax(scores, dim=-1)
    sink = sink_logits.expand(*scores.shape[:-1], 1)
    return torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
            scaling: float, logit_cap: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [n, Hq, D], k/v [m, Hkv, D], allowed [n, m] bool or None, sinks [Hq] fp32 or None
    -> [n, Hq, D] in q's dtype."""
    group = q.shape[1] // k.shape[1]
    qf = q.float().transpose(0, 1)  # [Hq, n, D]
    kf = k.float().repeat_interleave(group, dim=1).transpose(0, 1)  # [Hq, m, D]
    vf = v.float().repeat_interleave(group, dim=1).transpose(0, 1)
    scores = torch.matmul(qf, kf.transpose(1, 2)) * scaling
    if logit_cap > 0:
        scores = logit_cap * torch.tanh(scores / logit_cap)
    if allowed is not None:
        scores = scores.masked_fill(~allowed, float("-inf"))
    out = torch.matmul(_softmax_with_sinks(scores, None if sinks is None else sinks.view(-1, 1, 1)), vf)
    return out.transpose(0, 1).to(q.dtype)


class TorchNativeAttnBackend(AttentionBackend):
    name = "torch_native"

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool) -> None:
        super().__init__(req_to_token_pool, kv_pool)
        self.sinks_fp32 = Float32Cache()

    def _sinks(self, layer: AttentionLayer) -> torch.Tensor | None:
        # This backend never runs under a graph capture.
        return None if layer.sinks is None else self.sinks_fp32.get(layer.sinks, capturing=False)

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        # Everything this backend needs is on the batch (host lists included); nothing to plan.
        return None

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        return None

    def _kv_of(self, layer: AttentionLayer, row: int, length: int, dtype: torch.dtype
               ) -> tuple[torch.Tensor, torch.Tensor]:
        slots = self.req_to_token_pool.req_to_token[row, :length].long()
        return self._read_kv(layer, slots, dtype)

    def _read_kv(self, layer: AttentionLayer, slots: torch.Tensor, dtype: torch.dtype
                 ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V at ``slots`` (any shape) in ``dtype``; an FP8 cache is dequantized."""
        pool = self.kv_pool
        k_scale, v_scale = pool.kv_scales_of(layer.layer_id)
        return (pool.dequantize(pool.get_key_buffer(layer.layer_id)[slots], k_scale, dtype),
                pool.dequantize(pool.get_value_buffer(layer.layer_id)[slots], v_scale, dtype))

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        if save_kv_cache:
            self.kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        k, v = self.kv_pool.as_stored(layer.layer_id, k, v)
        assert fb.extend is not None
        mask = custom_mask_of(fb)
        rows = fb.req_pool_indices.tolist()
        sinks = self._sinks(layer)
        out = torch.empty_like(q)
        start, mask_start = 0, 0
        for i, (ext, pre) in enumerate(zip(fb.extend.seq_lens_cpu, fb.extend.prefix_lens_cpu, strict=True)):
            # Prefix from the cache, new tokens from k/v (correct with save_kv_cache=False too).
            pk, pv = self._kv_of(layer, rows[i], pre, k.dtype)
            keys = torch.cat([pk, k[start : start + ext]])
            vals = torch.cat([pv, v[start : start + ext]])
            qpos = torch.arange(ext, device=q.device).unsqueeze(1) + pre
            if mask is not None:
                allowed = mask[mask_start : mask_start + ext * (pre + ext)].view(ext, pre + ext).bool()
                mask_start += ext * (pre + ext)
            else:
                allowed = torch.arange(pre + ext, device=q.device).unsqueeze(0) <= qpos
            if layer.sliding_window:
                kpos = torch.arange(pre + ext, device=q.device).unsqueeze(0)
                allowed = allowed & (kpos > qpos - layer.sliding_window)
            out[start : start + ext] = _attend(q[start : start + ext], keys, vals, allowed,
                                               layer.scaling, layer.logit_cap, sinks)
            start += ext
        return out.view(-1, hq * d)

    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q, k, v = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        if save_kv_cache:
            self.kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k, v)
        # One padded gather for the whole batch: rows shorter than the longest are masked.
        max_len = max(fb.seq_lens_cpu)
        slots = self.req_to_token_pool.req_to_token[fb.req_pool_indices, :max_len].long()  # [bs, L]
        keys, vals = self._read_kv(layer, slots, torch.float32)  # [bs, L, Hkv, D]
        pos = torch.arange(max_len, device=q.device).unsqueeze(0)
        valid = pos < fb.seq_lens.unsqueeze(1)  # [bs, L]
        if layer.sliding_window:  # the new token sits at seq_len - 1
            valid = valid & (pos > fb.seq_lens.unsqueeze(1) - 1 - layer.sliding_window)
        group = hq // hkv
        qf = q.float().view(-1, hkv, group, d)
        scores = torch.einsum("bhgd,blhd->bhgl", qf, keys.float()) * layer.scaling
        if layer.logit_cap > 0:
            scores = layer.logit_cap * torch.tanh(scores / layer.logit_cap)
        scores = scores.masked_fill(~valid[:, None, None, :], float("-inf"))
        sinks = self._sinks(layer)
        probs = _softmax_with_sinks(scores, None if sinks is None else sinks.view(hkv, group, 1))
        out = torch.einsum("bhgl,blhd->bhgd", probs, vals.float())
        return out.reshape(-1, hq * d).to(q.dtype)
