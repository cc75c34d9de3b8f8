"""torch_native backend: extend over a cached prefix, decode, and the custom-mask path."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from plait.attention.torch_native import TorchNativeAttnBackend
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool

HQ, HKV, D = 4, 2, 8
LAYER = SimpleNamespace(layer_id=0, num_heads=HQ, num_kv_heads=HKV, head_dim=D, scaling=D**-0.5, logit_cap=0.0,
                        sliding_window=None, sinks=None)


def setup(prefix: int, ext: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = ReqToTokenPool(4, 64, "cpu")
    kv = MHATokenToKVPool(64, torch.float32, 1, HKV, D, "cpu")
    backend = TorchNativeAttnBackend(pool, kv)
    row = 2
    slots = torch.randperm(63, generator=g)[: prefix + ext] + 1  # scattered slots, never slot 0
    pool.write(row, 0, slots)
    kv.k_buffer[0][slots[:prefix]] = torch.randn(prefix, HKV, D, generator=g)
    kv.v_buffer[0][slots[:prefix]] = torch.randn(prefix, HKV, D, generator=g)
    q = torch.randn(ext, HQ * D, generator=g)
    k = torch.randn(ext, HKV * D, generator=g)
    v = torch.randn(ext, HKV * D, generator=g)
    fb = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=torch.zeros(ext, dtype=torch.long),
        req_pool_indices=torch.tensor([row]), seq_lens=torch.tensor([prefix + ext]),
        out_cache_loc=slots[prefix:], positions=torch.arange(prefix, prefix + ext),
        seq_lens_cpu=[prefix + ext], seq_lens_sum=prefix + ext,
        extend=ExtendInfo(num_tokens=ext, seq_lens=torch.tensor([ext]), prefix_lens=torch.tensor([prefix]),
                          start_loc=torch.tensor([0]), seq_lens_cpu=[ext], prefix_lens_cpu=[prefix]))
    return backend, fb, q, k, v, slots


def explicit(q, keys, vals, allowed):
    """Per-head softmax attention written out with loops (GQA: head h reads kv head h // group)."""
    out = torch.zeros(q.shape[0], HQ, D)
    qh = q.view(-1, HQ, D)
    for h in range(HQ):
        kh = keys[:, h // (HQ // HKV)]
        vh = vals[:, h // (HQ // HKV)]
        for i in range(q.shape[0]):
            s = (kh @ qh[i, h]) * D**-0.5
            s[~allowed[i]] = float("-inf")
            out[i, h] = torch.softmax(s, 0) @ vh
    return out.view(-1, HQ * D)


def test_extend_with_prefix_is_causal_over_prefix_and_new_tokens():
    backend, fb, q, k, v, slots = setup(prefix=5, ext=4)
    out = backend.forward(q, k, v, LAYER, fb)
    keys = backend.kv_pool.k_buffer[0][slots]
    vals = backend.kv_pool.v_buffer[0][slots]
    allowed = torch.arange(9)[None, :] <= (torch.arange(4)[:, None] + 5)
    torch.testing.assert_close(out, explicit(q, keys, vals, allowed), atol=1e-5, rtol=1e-5)


def test_extend_stores_new_kv_in_its_slots():
    backend, fb, q, k, v, slots = setup(prefix=2, ext=3)
    backend.forward(q, k, v, LAYER, fb)
    torch.testing.assert_close(backend.kv_pool.k_buffer[0][slots[2:]], k.view(3, HKV, D))


def test_custom_mask_replaces_the_causal_rule():
    backend, fb, q, k, v, slots = setup(prefix=3, ext=4)
    # A draft tree: token 0 root; 1 and 2 children of 0; 3 child of 1. Each sees the prefix, its
    # ancestors and itself.
    parents = {0: [], 1: [0], 2: [0], 3: [0, 1]}
    allowed = torch.zeros(4, 7, dtype=torch.bool)
    allowed[:, :3] = True
    for i, anc in parents.items():
        allowed[i, [3 + a for a in anc] + [3 + i]] = True
    fb.spec_info = SimpleNamespace(custom_mask=allowed.flatten())
    out = backend.forward(q, k, v, LAYER, fb)
    keys = backend.kv_pool.k_buffer[0][slots]
    vals = backend.kv_pool.v_buffer[0][slots]
    torch.testing.assert_close(out, explicit(q, keys, vals, allowed), atol=1e-5, rtol=1e-5)
    causal = torch.arange(7)[None, :] <= (torch.arange(4)[:, None] + 3)
    assert not torch.allclose(out, explicit(q, keys, vals, causal), atol=1e-3)


def test_decode_attends_to_the_whole_sequence():
    backend, fb, q, k, v, slots = setup(prefix=6, ext=1)
    fb.forward_mode = ForwardMode.DECODE
    out = backend.forward(q, k, v, LAYER, fb)
    keys = backend.kv_pool.k_buffer[0][slots]
    vals = backend.kv_pool.v_buffer[0][slots]
    torch.testing.assert_close(out, explicit(q, keys, vals, torch.ones(1, 7, dtype=torch.bool)), atol=1e-5,
                               rtol=1e-5)


def test_extend_without_saving_reads_new_kv_from_arguments():
    backend, fb, q, k, v, slots = setup(prefix=3, ext=2)
    saved = backend.forward(q, k, v, LAYER, fb)
    backend.kv_pool.k_buffer[0][slots[3:]] = 0.0  # the cache no longer holds the new tokens
    unsaved = backend.forward(q, k, v, LAYER, fb, save_kv_cache=False)
    torch.testing.assert_close(saved, unsaved)


def test_sliding_window_hides_keys_older_than_the_window():
    backend, fb, q, k, v, slots = setup(prefix=6, ext=4)
    window = 3
    lay = SimpleNamespace(**{**vars(LAYER), "sliding_window": window})
    out = backend.forward(q, k, v, lay, fb)
    keys = backend.kv_pool.k_buffer[0][slots]
    vals = backend.kv_pool.v_buffer[0][slots]
    qpos = torch.arange(4)[:, None] + 6
    kpos = torch.arange(10)[None, :]
    allowed = (kpos <= qpos) & (kpos > qpos - window)
    torch.testing.assert_close(out, explicit(q, keys, vals, allowed), atol=1e-5, rtol=1e-5)
