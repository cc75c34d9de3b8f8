"""The Triton attention backend against torch_native through the backend contract (CPU, Triton
interpreter): extend over cached prefixes of length 0 and > 0, decode, and the custom-mask path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from plait.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.forward_batch import ForwardMode  # noqa: E402
from tests.attn_cases import extend_batch, layer, make_pools, random_tree_mask, run  # noqa: E402

HEADS = [(2, 2), (8, 2), (8, 1)]  # GQA ratios 1, 4, 8


def make_backends(hq: int, hkv: int, d: int, seed: int = 0):
    pool, kv, g = make_pools(hkv, d, seed)
    return TorchNativeAttnBackend(pool, kv), TritonAttnBackend(pool, kv, hq), pool, g


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
    fb.spec_info = SimpleNamespace(custom_mask=random_tree_mask(prefix, ext, g))
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
