"""The Triton attention backend against torch_native through the backend contract (CPU, Triton
interpreter): extend over cached prefixes of length 0 and > 0, decode, and the custom-mask path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from plait.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool  # noqa: E402

HEADS = [(2, 2), (8, 2), (8, 1)]  # GQA ratios 1, 4, 8


def make_backends(hq: int, hkv: int, d: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    pool = ReqToTokenPool(8, 96, "cpu")
    kv = MHATokenToKVPool(400, torch.float32, 1, hkv, d, "cpu")
    kv.k_buffer[0].copy_(torch.randn(kv.k_buffer[0].shape, generator=g))
    kv.v_buffer[0].copy_(torch.randn(kv.v_buffer[0].shape, generator=g))
    return TorchNativeAttnBackend(pool, kv), TritonAttnBackend(pool, kv, hq), pool, g


def layer(hq: int, hkv: int, d: int, window: int | None = None):
    return SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5, logit_cap=0.0,
                           sliding_window=window)


def extend_batch(pool, g, prefix: list[int], ext: list[int]) -> ForwardBatch:
    rows = list(range(2, 2 + len(prefix)))
    slots = torch.randperm(399, generator=g)[: sum(prefix) + sum(ext)] + 1  # never the dummy slot 0
    new_slots = []
    off = 0
    for row, p, e in zip(rows, prefix, ext, strict=True):
        pool.write(row, 0, slots[off : off + p + e])
        new_slots.append(slots[off + p : off + p + e])
        off += p + e
    t = sum(ext)
    starts = [sum(ext[:i]) for i in range(len(ext))]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=torch.zeros(t, dtype=torch.long),
        req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor([p + e for p, e in zip(prefix, ext, strict=True)]),
        out_cache_loc=torch.cat(new_slots), positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext,
                                                                                                      strict=True)]),
        seq_lens_cpu=[p + e for p, e in zip(prefix, ext, strict=True)], seq_lens_sum=sum(prefix) + t,
        extend_num_tokens=t, extend_seq_lens=torch.tensor(ext), extend_prefix_lens=torch.tensor(prefix),
        extend_start_loc=torch.tensor(starts), extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=prefix)


def run(backend, fb, q, k, v, lay):
    fb.reset_forward_metadata_marker()
    backend.init_forward_metadata(fb)
    return backend.forward(q.clone(), k.clone(), v.clone(), lay, fb)


@pytest.mark.parametrize(("hq", "hkv"), HEADS, ids=["gqa1", "gqa4", "gqa8"])
@pytest.mark.parametrize("d", [64, 128])
def test_extend_with_and_without_prefix_matches_torch_native(hq, hkv, d):
    native, triton_be, pool, g = make_backends(hq, hkv, d)
    fb = extend_batch(pool, g, prefix=[0, 5, 17], ext=[7, 3, 9])
    t = fb.num_tokens
    q, k, v = torch.randn(t, hq * d, generator=g), torch.randn(t, hkv * d, generator=g), torch.randn(t, hkv * d,
                                                                                                    generator=g)
    torch.testing.assert_close(run(triton_be, fb, q, k, v, layer(hq, hkv, d)),
                               run(native, fb, q, k, v, layer(hq, hkv, d)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("hq", "hkv"), HEADS, ids=["gqa1", "gqa4", "gqa8"])
def test_decode_matches_torch_native(hq, hkv):
    d = 64
    native, triton_be, pool, g = make_backends(hq, hkv, d, seed=1)
    fb = extend_batch(pool, g, prefix=[4, 30, 70], ext=[1, 1, 1])
    fb.forward_mode = ForwardMode.DECODE
    q, k, v = torch.randn(3, hq * d, generator=g), torch.randn(3, hkv * d, generator=g), torch.randn(3, hkv * d,
                                                                                                    generator=g)
    torch.testing.assert_close(run(triton_be, fb, q, k, v, layer(hq, hkv, d)),
                               run(native, fb, q, k, v, layer(hq, hkv, d)), atol=1e-4, rtol=1e-4)


def test_custom_mask_extend_matches_torch_native():
    hq, hkv, d = 8, 2, 64
    native, triton_be, pool, g = make_backends(hq, hkv, d, seed=2)
    prefix, ext = [6, 11], [4, 3]
    fb = extend_batch(pool, g, prefix=prefix, ext=ext)
    blocks = []
    for p, e in zip(prefix, ext, strict=True):
        m = torch.rand(e, p + e, generator=g) > 0.4
        m[:, :p] = True
        m[torch.arange(e), p + torch.arange(e)] = True  # every token sees itself
        blocks.append(m.flatten())
    fb.spec_info = SimpleNamespace(custom_mask=torch.cat(blocks))
    t = fb.num_tokens
    q, k, v = torch.randn(t, hq * d, generator=g), torch.randn(t, hkv * d, generator=g), torch.randn(t, hkv * d,
                                                                                                    generator=g)
    torch.testing.assert_close(run(triton_be, fb, q, k, v, layer(hq, hkv, d)),
                               run(native, fb, q, k, v, layer(hq, hkv, d)), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("window", [4, 9])
def test_sliding_window_extend_and_decode_match_torch_native(window):
    hq, hkv, d = 8, 2, 64
    native, _, pool, g = make_backends(hq, hkv, d, seed=3)
    triton_be = TritonAttnBackend(native.req_to_token_pool, native.kv_pool, hq, sliding_window=window)
    lay = layer(hq, hkv, d, window)
    fb = extend_batch(pool, g, prefix=[0, 6, 20], ext=[13, 5, 7])
    t = fb.num_tokens
    q, k, v = torch.randn(t, hq * d, generator=g), torch.randn(t, hkv * d, generator=g), torch.randn(t, hkv * d,
                                                                                                    generator=g)
    torch.testing.assert_close(run(triton_be, fb, q, k, v, lay), run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)
    dec = extend_batch(pool, g, prefix=[3, 15, 40], ext=[1, 1, 1])
    dec.forward_mode = ForwardMode.DECODE
    q, k, v = torch.randn(3, hq * d, generator=g), torch.randn(3, hkv * d, generator=g), torch.randn(3, hkv * d,
                                                                                                    generator=g)
    torch.testing.assert_close(run(triton_be, dec, q, k, v, lay), run(native, dec, q, k, v, lay), atol=1e-4,
                               rtol=1e-4)
