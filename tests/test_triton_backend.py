"""The Triton attention backend against torch_native through the backend contract (CPU, Triton
interpreter): extend over cached prefixes of length 0 and > 0, decode, the custom-mask path, and
TARGET_VERIFY through the decode kernel (one row per verify token), eager and on graph buffers."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from plait.attention.hybrid import HybridAttnBackend  # noqa: E402
from plait.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode  # noqa: E402
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW  # noqa: E402
from plait.speculative.tree import DraftTree, build_verify_mask  # noqa: E402
from tests.attn_cases import (  # noqa: E402
    as_target_verify,
    extend_batch,
    fused_qkv,
    layer,
    make_pools,
    random_tree_mask,
    run,
)

HEADS = [(2, 2), (8, 2), (8, 1)]  # GQA ratios 1, 4, 8


def make_backends(hq: int, hkv: int, d: int, seed: int = 0, max_context: int = 96):
    pool, kv, g = make_pools(hkv, d, seed, max_context=max_context)
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


def test_extend_strided_qkv_views_equal_contiguous():
    # k/v as views into the fused qkv output (what the model passes): no copies, same result.
    hq, hkv, d = 8, 2, 64
    _, triton_be, pool, g = make_backends(hq, hkv, d, seed=4)
    fb = extend_batch(pool, g, prefix=[0, 13], ext=[9, 6])
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    assert not k.is_contiguous() and k.stride(-1) == 1
    lay = layer(hq, hkv, d)
    strided = run(triton_be, fb, q, k, v, lay, clone=False)
    torch.testing.assert_close(strided, run(triton_be, fb, q.contiguous(), k.contiguous(), v.contiguous(), lay),
                               atol=0, rtol=0)


# --- a mixed step's decode rows through the decode kernel -------------------------------------------

# Eight one-token requests (a MIXED step's decode rows, first as the scheduler orders them) over
# prefixes of 3-40 tokens, then a new prompt, a chunk over a cached prefix and one more one-token row.
MIXED_PREFIX = [12, 3, 40, 7, 25, 18, 9, 31, 0, 14, 22]
MIXED_EXT = [1] * 8 + [9, 6, 1]


def _mixed_case(hq: int, hkv: int, d: int, seed: int):
    native, triton_be, pool, g = make_backends(hq, hkv, d, seed)
    fb = extend_batch(pool, g, MIXED_PREFIX, MIXED_EXT)
    fb.forward_mode = ForwardMode.MIXED
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    return native, triton_be, fb, (q, k, v)


@pytest.mark.parametrize(("hq", "hkv"), HEADS, ids=["gqa1", "gqa4", "gqa8"])
def test_mixed_batch_decode_rows_through_the_decode_kernel_match_torch_native(hq, hkv):
    d = 64
    native, triton_be, fb, (q, k, v) = _mixed_case(hq, hkv, d, seed=11)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.mixed_rows_md is not None and triton_be.mixed_rows_md.num_rows == 8
    assert triton_be.extend_md is not None and triton_be.extend_md.first_request == 8
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_mixed_batch_equals_the_extend_kernel_alone():
    hq, hkv, d = 8, 2, 64
    _, triton_be, fb, (q, k, v) = _mixed_case(hq, hkv, d, seed=12)
    lay = layer(hq, hkv, d, logit_cap=30.0)
    split = run(triton_be, fb, q, k, v, lay)
    triton_be.mixed_via_decode = False
    whole = run(triton_be, fb, q, k, v, lay)
    assert triton_be.mixed_rows_md is None and triton_be.extend_md.first_request == 0
    torch.testing.assert_close(split, whole, atol=1e-5, rtol=1e-5)


def test_one_token_requests_after_a_longer_one_stay_in_the_extend_kernel():
    hq, hkv, d = 8, 2, 64
    native, triton_be, pool, g = make_backends(hq, hkv, d, seed=13)
    # Only a leading run of one-token requests attends as decode rows: here it is empty.
    fb = extend_batch(pool, g, prefix=[0, 5, 9, 2, 11, 4, 6, 8, 3, 7], ext=[5] + [1] * 9)
    fb.forward_mode = ForwardMode.MIXED
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.mixed_rows_md is None and triton_be.extend_md.first_request == 0
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_mixed_batch_under_a_sliding_window_keeps_the_extend_kernel():
    hq, hkv, d = 8, 2, 64
    native, _, pool, g = make_backends(hq, hkv, d, seed=14)
    triton_be = TritonAttnBackend(pool, native.kv_pool, hq, sliding_window=16)
    fb = extend_batch(pool, g, MIXED_PREFIX, MIXED_EXT)
    fb.forward_mode = ForwardMode.MIXED
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    lay = layer(hq, hkv, d, window=16)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.mixed_rows_md is None
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


# --- TARGET_VERIFY through the decode kernel ----------------------------------------------------------

VERIFY_TREE = DraftTree([5, 6, 7, 8], [-1, 0, 0, 1])  # root with two children, a grandchild under the first


def _verify_mask(kind: str, prefix: list[int], ext: list[int], g: torch.Generator) -> torch.Tensor:
    if kind == "chain":
        return build_verify_mask([DraftTree.chain(1, list(range(2, e + 1))) for e in ext], prefix, "cpu")
    if kind == "tree":
        assert all(e == VERIFY_TREE.width for e in ext)
        return build_verify_mask([VERIFY_TREE] * len(ext), prefix, "cpu")
    return random_tree_mask(prefix, ext, g)  # arbitrary subsets of the other draft tokens


def _verify_case(hq: int, hkv: int, d: int, prefix: list[int], ext: list[int], kind: str, seed: int,
                 max_context: int = 96, **backend_kw):
    native, _, pool, g = make_backends(hq, hkv, d, seed, max_context)
    triton_be = TritonAttnBackend(pool, native.kv_pool, hq, **backend_kw)
    fb = as_target_verify(extend_batch(pool, g, prefix, ext), _verify_mask(kind, prefix, ext, g))
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    return native, triton_be, fb, (q, k, v)


@pytest.mark.parametrize("kind", ["chain", "tree", "random"])
@pytest.mark.parametrize(("hq", "hkv"), HEADS, ids=["gqa1", "gqa4", "gqa8"])
def test_target_verify_rows_match_torch_native(hq, hkv, kind):
    d = 64
    # Ragged prefixes including 0; one long enough for its rows to get 2 KV splits (min split 128).
    native, triton_be, fb, (q, k, v) = _verify_case(hq, hkv, d, [0, 9, 150], [4, 4, 4], kind, seed=5,
                                                    max_context=160)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    md = triton_be.verify_md
    assert md is not None and triton_be.extend_md is None  # the decode-kernel path ran
    assert md.bufs.num_kv_splits[:12].tolist() == [1] * 8 + [2] * 4
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_target_verify_rows_ragged_widths_and_logit_cap():
    hq, hkv, d = 8, 2, 64
    native, triton_be, fb, (q, k, v) = _verify_case(hq, hkv, d, [17, 0, 6], [4, 2, 3], "chain", seed=6)
    lay = layer(hq, hkv, d, logit_cap=2.0)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.verify_md is not None and triton_be.verify_md.max_width == 4
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_target_verify_without_mask_is_a_causal_chain():
    hq, hkv, d = 8, 2, 64
    native, triton_be, fb, (q, k, v) = _verify_case(hq, hkv, d, [3, 20], [3, 4], "chain", seed=7)
    fb.spec_info = None
    lay = layer(hq, hkv, d)
    torch.testing.assert_close(run(triton_be, fb, q, k, v, lay, clone=False), run(native, fb, q, k, v, lay),
                               atol=1e-4, rtol=1e-4)


def test_target_verify_batches_above_the_rows_cap_take_the_extend_kernel(monkeypatch):
    """Large verify batches re-read every prefix once per token on the rows path: they use the extend
    kernel (VERIFY_ROWS_MAX_BS), and still match torch_native."""
    import plait.attention.triton_backend as tb

    monkeypatch.setattr(tb, "VERIFY_ROWS_MAX_BS", 2)
    hq, hkv, d = 8, 2, 64
    native, triton_be, fb, (q, k, v) = _verify_case(hq, hkv, d, [5, 30, 11], [4, 4, 4], "tree", seed=9)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.verify_md is None and triton_be.extend_md is not None
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_target_verify_extend_kernel_switch_still_matches():
    # verify_via_decode=False (PLAIT_TRITON_VERIFY_EXTEND=1): the extend kernel with the custom mask.
    hq, hkv, d = 8, 2, 64
    native, triton_be, fb, (q, k, v) = _verify_case(hq, hkv, d, [5, 30], [4, 4], "tree", seed=8,
                                                    verify_via_decode=False)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.verify_md is None and triton_be.extend_md is not None
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_target_verify_windowed_layers_take_the_extend_kernel():
    # A model with a sliding window plans both: windowed layers read extend_md, the others the rows.
    hq, hkv, d, window = 8, 2, 64, 6
    native, triton_be, fb, (q, k, v) = _verify_case(hq, hkv, d, [2, 25], [4, 4], "tree", seed=9,
                                                    sliding_window=window)
    for lay in (layer(hq, hkv, d, window), layer(hq, hkv, d)):
        got = run(triton_be, fb, q, k, v, lay, clone=False)
        assert triton_be.verify_md is not None and triton_be.extend_md is not None
        torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def _rows_plan(backend: TritonAttnBackend) -> dict[str, torch.Tensor]:
    md = backend.verify_md
    assert md is not None
    n = md.num_rows
    total = int(md.bufs.kv_indptr[n])
    return {"row_lens": md.row_lens.clone(), "kv_indptr": md.bufs.kv_indptr[: n + 1].clone(),
            "kv_indices": md.bufs.kv_indices[:total].clone(), "num_kv_splits": md.bufs.num_kv_splits[:n].clone(),
            "qo_indptr": md.qo_indptr.clone(), "mask_indptr": md.mask_indptr.clone()}


def test_target_verify_static_plan_equals_eager_plan():
    hq, hkv, d = 8, 2, 64
    _, eager_be, fb, (q, k, v) = _verify_case(hq, hkv, d, [0, 9, 41], [4, 4, 4], "random", seed=10)
    static_be = TritonAttnBackend(eager_be.req_to_token_pool, eager_be.kv_pool, hq)
    static_be.init_cuda_graph_state(4, 16)  # verify graphs of up to 4 requests x width 4
    lay = layer(hq, hkv, d)
    out_eager = run(eager_be, fb, q, k, v, lay, clone=False)
    eager_plan = _rows_plan(eager_be)
    out_static = run(static_be, fb, q, k, v, lay, clone=False)
    static_plan = _rows_plan(static_be)
    for name, tensor in eager_plan.items():
        assert torch.equal(tensor, static_plan[name]), name
    torch.testing.assert_close(out_static, out_eager, atol=0, rtol=0)
    # The static plan lives in the graph buffers (what a captured graph reads).
    bufs = static_be.graph_verify_buffers
    assert bufs is not None and bufs.rows is not None and bufs.row_lens is not None
    md = static_be.verify_md
    assert md.bufs is bufs.rows and md.row_lens.data_ptr() == bufs.row_lens.data_ptr()
    assert md.qo_indptr.data_ptr() == bufs.qo_indptr.data_ptr()
    assert md.mask_indptr.data_ptr() == bufs.mask_indptr.data_ptr()
    # A batch with more tokens than the verify buffers hold plans eagerly instead.
    _, _, big, _ = _verify_case(hq, hkv, d, [3], [17], "chain", seed=11)
    static_be.init_forward_metadata_out_graph(big)
    assert static_be.verify_md.bufs is not bufs.rows


def test_target_verify_padding_rows_are_harmless():
    # A graph batch padded from 2 to 3 requests the way VerifyGraphRunner pads: the dummy request row,
    # prefix 0, its W tokens written to the dummy slot, a W x W mask of ones. The live rows' outputs
    # equal the unpadded batch's; the padding rows are finite.
    hq, hkv, d, w = 8, 2, 64, 4
    native, triton_be, live, (q, k, v) = _verify_case(hq, hkv, d, [7, 19], [w, w], "tree", seed=12)
    triton_be.init_cuda_graph_state(4, 4 * w)
    lay = layer(hq, hkv, d)
    expect = run(native, live, q, k, v, lay)
    pad_q, pad_k, pad_v = fused_qkv(w, hq, hkv, d, torch.Generator().manual_seed(13))
    padded = ForwardBatch(  # the live batch's tensors and one dummy request after them
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=3, input_ids=torch.zeros(3 * w, dtype=torch.long),
        req_pool_indices=torch.cat([live.req_pool_indices, torch.tensor([DUMMY_REQ_ROW])]),
        seq_lens=torch.cat([live.seq_lens, torch.tensor([w])]),
        out_cache_loc=torch.cat([live.out_cache_loc, torch.full((w,), DUMMY_KV_SLOT)]),
        positions=torch.cat([live.positions, torch.zeros(w, dtype=torch.long)]),
        seq_lens_cpu=[*live.seq_lens_cpu, w], seq_lens_sum=live.seq_lens_sum + w,
        extend=ExtendInfo(num_tokens=3 * w, seq_lens=torch.tensor([w] * 3),
                          prefix_lens=torch.cat([live.extend.prefix_lens, torch.tensor([0])]),
                          start_loc=torch.arange(3) * w, seq_lens_cpu=[w] * 3,
                          prefix_lens_cpu=[*live.extend.prefix_lens_cpu, 0]))
    as_target_verify(padded, torch.cat([live.spec_info.custom_mask, torch.ones(w * w, dtype=torch.bool)]))
    got = run(triton_be, padded, torch.cat([q, pad_q]), torch.cat([k, pad_k]), torch.cat([v, pad_v]), lay)
    n = live.num_tokens
    torch.testing.assert_close(got[:n], expect, atol=1e-4, rtol=1e-4)
    assert torch.isfinite(got[n:]).all()
    md = triton_be.verify_md
    assert md is not None and md.row_lens[-w:].tolist() == [w] * w  # a dummy row sees the W dummy-slot copies


def test_target_verify_capture_check_covers_out_cache_loc_and_mask():
    hq, hkv, d = 8, 2, 64
    _, triton_be, fb, _ = _verify_case(hq, hkv, d, [4, 8], [3, 3], "chain", seed=14)
    triton_be.init_cuda_graph_state(2, 6)
    triton_be.init_forward_metadata_out_graph(fb, in_capture=True)
    triton_be.init_forward_metadata_in_graph(fb)  # the tensors planned at capture: fine
    fb.out_cache_loc = fb.out_cache_loc.clone()  # a per-step tensor instead of the static one
    with pytest.raises(RuntimeError, match="static buffers"):
        triton_be.init_forward_metadata_in_graph(fb)


@pytest.mark.parametrize(("spec_mode", "rows_on_decode_half"), [("decode", True), ("prefill", False)])
def test_hybrid_gives_verify_graph_state_only_to_the_verify_half(spec_mode, rows_on_decode_half):
    hq, hkv, d = 8, 2, 64
    pool, kv, _ = make_pools(hkv, d)
    prefill, decode = TritonAttnBackend(pool, kv, hq), TritonAttnBackend(pool, kv, hq)
    HybridAttnBackend(prefill, decode, spec_mode).init_cuda_graph_state(4, 16)
    assert decode.graph_buffers is not None
    assert (decode.graph_verify_buffers is not None) == rows_on_decode_half
    assert (prefill.graph_verify_buffers is not None) == (not rows_on_decode_half)


def test_a_verify_plan_after_a_mixed_plan_does_not_keep_its_decode_rows(monkeypatch):
    """The backend object plans every step: a TARGET_VERIFY batch through the extend kernel (above the
    rows cap) right after a mixed step must not split off the mixed step's decode rows."""
    import plait.attention.triton_backend as tb

    hq, hkv, d = 8, 2, 64
    native, triton_be, fb, (q, k, v) = _mixed_case(hq, hkv, d, seed=15)
    lay = layer(hq, hkv, d)
    run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.mixed_rows_md is not None
    monkeypatch.setattr(tb, "VERIFY_ROWS_MAX_BS", 0)  # the verify batch takes the extend kernel
    prefix, ext = [10, 20, 5], [1, 1, 1]
    vfb = as_target_verify(extend_batch(native.req_to_token_pool, torch.Generator().manual_seed(3), prefix, ext),
                           _verify_mask("chain", prefix, ext, torch.Generator().manual_seed(4)))
    vq, vk, vv = fused_qkv(vfb.num_tokens, hq, hkv, d, torch.Generator().manual_seed(5))
    got = run(triton_be, vfb, vq, vk, vv, lay, clone=False)
    assert triton_be.mixed_rows_md is None and triton_be.extend_md.first_request == 0
    torch.testing.assert_close(got, run(native, vfb, vq, vk, vv, lay), atol=1e-4, rtol=1e-4)


def test_draft_extend_batches_keep_every_row_in_the_extend_kernel():
    """A draft model's extend step may send its new tokens' K/V elsewhere than the rows would read:
    only EXTEND and MIXED batches split off decode rows."""
    hq, hkv, d = 8, 2, 64
    native, triton_be, fb, (q, k, v) = _mixed_case(hq, hkv, d, seed=16)
    fb.forward_mode = ForwardMode.DRAFT_EXTEND
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.mixed_rows_md is None and triton_be.extend_md.first_request == 0
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_an_extend_batch_of_only_one_token_requests_runs_all_rows_in_the_decode_kernel():
    """Whole-prompt cache hits leave one token each: every request is a decode row, and the extend
    kernel has nothing left to launch."""
    hq, hkv, d = 8, 2, 64
    native, triton_be, pool, g = make_backends(hq, hkv, d, seed=17)
    fb = extend_batch(pool, g, prefix=[6, 31, 12], ext=[1, 1, 1])
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.mixed_rows_md.num_rows == 3 and triton_be.extend_md.max_len_extend == 0
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


# --- fresh prompts through PyTorch's fused kernels ------------------------------------------------


def _flash_backends(hq: int, hkv: int, d: int, seed: int):
    native, triton_be, pool, g = make_backends(hq, hkv, d, seed)
    triton_be.prefill_via_flash = True
    return native, triton_be, pool, g


@pytest.mark.parametrize(("hq", "hkv"), HEADS, ids=["gqa1", "gqa4", "gqa8"])
def test_fresh_prompts_of_one_length_after_decode_rows_run_one_batched_sdpa_and_match_torch_native(hq, hkv):
    d = 64
    native, triton_be, pool, g = _flash_backends(hq, hkv, d, seed=21)
    fb = extend_batch(pool, g, prefix=[12, 30, 7] + [0] * 4, ext=[1, 1, 1] + [9] * 4)
    fb.forward_mode = ForwardMode.MIXED
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    md = triton_be.flash_prefill_md
    assert md is not None and (md.token_start, md.count, md.length) == (3, 4, 9)
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("prefix", "ext"), [([0, 5, 0], [6, 6, 6]), ([0, 0], [7, 4])],
                         ids=["one-over-a-cached-prefix", "different-lengths"])
def test_prompts_not_all_fresh_and_of_one_length_keep_the_extend_kernel(prefix, ext):
    hq, hkv, d = 8, 2, 64
    native, triton_be, pool, g = _flash_backends(hq, hkv, d, seed=22)
    fb = extend_batch(pool, g, prefix=prefix, ext=ext)
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    lay = layer(hq, hkv, d)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.flash_prefill_md is None
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_flash_prefill_is_on_by_default_on_cuda_only():
    from plait import envs

    if envs.TRITON_PREFILL_FLASH.get() is not None:
        pytest.skip("PLAIT_TRITON_PREFILL_FLASH overrides the default")
    _, triton_be, _, _ = make_backends(8, 2, 64, seed=26)
    assert triton_be.prefill_via_flash is False  # a CPU pool: the interpreter's extend kernel stays under test


def test_a_logit_capped_layer_under_a_flash_plan_takes_the_extend_kernel():
    hq, hkv, d = 8, 2, 64
    native, triton_be, pool, g = _flash_backends(hq, hkv, d, seed=24)
    fb = extend_batch(pool, g, prefix=[0, 0], ext=[8, 8])
    q, k, v = fused_qkv(fb.num_tokens, hq, hkv, d, g)
    lay = layer(hq, hkv, d, logit_cap=5.0)  # SDPA has no soft cap
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.flash_prefill_md is not None
    torch.testing.assert_close(got, run(native, fb, q, k, v, lay), atol=1e-4, rtol=1e-4)


def test_flash_prefill_is_not_planned_for_a_graph_capture_or_a_custom_mask():
    hq, hkv, d = 8, 2, 64
    _, triton_be, pool, g = _flash_backends(hq, hkv, d, seed=25)
    fb = extend_batch(pool, g, prefix=[0, 0], ext=[5, 5])
    triton_be.init_forward_metadata_out_graph(fb, in_capture=True)
    assert triton_be.flash_prefill_md is None
    fb.spec_info = SimpleNamespace(custom_mask=random_tree_mask([0, 0], [5, 5], g))
    triton_be.init_forward_metadata_out_graph(fb)
    assert triton_be.flash_prefill_md is None
