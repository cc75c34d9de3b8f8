"""Triton attention kernels vs. the plain-torch references, on CPU under TRITON_INTERPRET=1.

Shapes are tiny (the interpreter is slow); on CPU the kernels pick 16-token tiles so these shapes still
cover several tiles per split / query block, tails, empty splits and the causal diagonal.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    # Must be set before triton.jit decorates the kernels (decoration time decides interpret mode).
    os.environ["TRITON_INTERPRET"] = "1"

pytest.importorskip("triton")


if os.environ.get("TRITON_INTERPRET") == "1":
    from plait.triton_utils import patch_interpreter_for_numpy

    patch_interpreter_for_numpy()

from plait.attention.triton import kernels as K  # noqa: E402
from plait.attention.triton import reference as R  # noqa: E402

# Extend with the G heads of a KV group packed into one 16-row tile (the GPU default for short
# extends): G = 8 leaves 2 tokens per tile, G = 3 leaves 5 tokens and one padding row.
PACKED = K.LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1, pack_gqa=True)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ATOL = 1e-4
RTOL = 1e-4

# (num_q_heads, num_kv_heads): GQA ratios 1, 4, 8.
HEADS = [(2, 2), (8, 2), (8, 1)]
HEAD_IDS = ["gqa1", "gqa4", "gqa8"]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device="cpu").manual_seed(seed)


def _randn(*shape: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=gen).to(dtype=dtype, device=DEVICE)


def _paged_layout(
    lens: list[int], num_slots: int, gen: torch.Generator, max_reqs: int = 8
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scatter each request's tokens over random, distinct slots (page size 1).

    Returns (req_to_token [max_reqs, max_ctx] int32, req_pool_indices [bs] (non-contiguous rows),
    kv_indptr [bs + 1] int32, kv_indices [sum(lens)] int32)."""
    bs = len(lens)
    max_ctx = max(max(lens), 1) + 8
    perm = torch.randperm(num_slots, generator=gen).to(torch.int32)
    assert sum(lens) <= num_slots
    rows = torch.randperm(max_reqs, generator=gen)[:bs]  # arbitrary, non-contiguous pool rows
    req_to_token = torch.full((max_reqs, max_ctx), -1, dtype=torch.int32)
    indices, used = [], 0
    for i, n in enumerate(lens):
        slots = perm[used : used + n]
        used += n
        req_to_token[rows[i], :n] = slots
        indices.append(slots)
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens, dtype=torch.int64), 0).to(torch.int32)
    kv_indices = torch.cat(indices) if indices else torch.zeros(0, dtype=torch.int32)
    return (
        req_to_token.to(DEVICE),
        rows.to(torch.int64).to(DEVICE),
        indptr.to(DEVICE),
        kv_indices.to(DEVICE),
    )


# ----------------------------------------------------------------------------------------------------
# build_kv_indices / store_kv / get_num_kv_splits
# ----------------------------------------------------------------------------------------------------


def test_build_kv_indices_non_contiguous_rows() -> None:
    gen = _gen(0)
    lens = [7, 0, 1000, 33]  # 1000 > one 512-slot copy block; 0: empty request
    req_to_token, rows, indptr, expect = _paged_layout(lens, num_slots=2048, gen=gen, max_reqs=16)
    assert not torch.equal(rows.sort().values, torch.arange(len(lens), device=DEVICE))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    out = torch.full((int(indptr[-1]) + 5,), -7, dtype=torch.int32, device=DEVICE)
    ref = out.clone()
    K.build_kv_indices(req_to_token, rows, seq_lens, indptr, out)
    R.build_kv_indices(req_to_token, rows, seq_lens, indptr, ref)
    assert torch.equal(out, ref)
    assert torch.equal(out[: int(indptr[-1])], expect)
    assert torch.all(out[int(indptr[-1]) :] == -7)  # nothing written past the end


def test_build_kv_indices_with_start_offset() -> None:
    gen = _gen(1)
    full = [40, 90, 17]
    req_to_token, rows, _, _ = _paged_layout(full, num_slots=256, gen=gen)
    start = torch.tensor([10, 0, 16], dtype=torch.int64, device=DEVICE)
    seq_lens = torch.tensor([30, 90, 1], dtype=torch.int64, device=DEVICE)
    indptr = torch.zeros(4, dtype=torch.int32, device=DEVICE)
    indptr[1:] = torch.cumsum(seq_lens, 0).to(torch.int32)
    out = torch.zeros(int(indptr[-1]), dtype=torch.int32, device=DEVICE)
    ref = out.clone()
    K.build_kv_indices(req_to_token, rows, seq_lens, indptr, out, kv_start_idx=start)
    R.build_kv_indices(req_to_token, rows, seq_lens, indptr, ref, kv_start_idx=start)
    assert torch.equal(out, ref)
    assert torch.equal(out[:30], req_to_token[rows[0], 10:40])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_store_kv_strided_views(dtype: torch.dtype) -> None:
    gen = _gen(2)
    num_slots, hkv, d, t = 64, 2, 64, 9
    k_buf = torch.zeros(num_slots, hkv, d, dtype=dtype, device=DEVICE)
    v_buf = torch.zeros(num_slots, hkv, d, dtype=dtype, device=DEVICE)
    # k and v as views into one fused [T, 8 + 2 + 2, D] qkv tensor (non-trivial token stride).
    qkv = _randn(t, 12, d, gen=gen, dtype=dtype)
    k, v = qkv[:, 8:10], qkv[:, 10:12]
    loc = torch.randperm(num_slots, generator=gen)[:t].to(DEVICE)
    K.store_kv(k_buf, v_buf, loc, k, v)
    k_ref, v_ref = torch.zeros_like(k_buf), torch.zeros_like(v_buf)
    R.store_kv(k_ref, v_ref, loc, k, v)
    assert torch.equal(k_buf, k_ref)
    assert torch.equal(v_buf, v_ref)


def test_get_num_kv_splits_matches_reference_and_bounds() -> None:
    cases = [
        ([384], 16),
        ([32768], 16),
        ([640] * 256, 16),
        ([32768] + [100] * 255, 16),
        ([1, 0, 5000, 12000, 700], 8),
        ([9000] + [300] * 299, 16),  # more requests than one pass of the planner covers
    ]
    for lens, max_splits in cases:
        seq_lens = torch.tensor(lens, dtype=torch.int64, device=DEVICE)
        out = torch.full((len(lens) + 3,), -1, dtype=torch.int32, device=DEVICE)
        ref = out.clone()
        K.get_num_kv_splits(seq_lens, out, max_splits, num_sms=132, num_kv_heads=8)
        R.get_num_kv_splits(seq_lens, ref, max_splits, num_sms=132, num_kv_heads=8)
        assert torch.equal(out, ref), (lens[:4], out[:8], ref[:8])
        got = out[: len(lens)]
        assert int(got.min()) >= 1 and int(got.max()) <= max_splits
        assert torch.all(out[len(lens) :] == -1)
    # A single long request is split as far as allowed; a big uniform batch is not split at all.
    one = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    K.get_num_kv_splits(torch.tensor([32768], device=DEVICE), one, 16, num_sms=132, num_kv_heads=8)
    assert int(one[0]) == 16
    many = torch.zeros(256, dtype=torch.int32, device=DEVICE)
    K.get_num_kv_splits(torch.full((256,), 640, device=DEVICE), many, 16, num_sms=132, num_kv_heads=8)
    assert int(many.max()) == 1


def test_num_kv_splits_defaults_agree() -> None:
    import inspect

    kernel = inspect.signature(K.get_num_kv_splits).parameters
    ref = inspect.signature(R.get_num_kv_splits).parameters
    for name in ("num_kv_heads", "programs_per_sm", "min_split_len"):
        assert kernel[name].default == ref[name].default, name


# ----------------------------------------------------------------------------------------------------
# decode
# ----------------------------------------------------------------------------------------------------


def _run_decode(
    lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    splits: list[int],
    max_splits: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    logit_cap: float = 0.0,
    split_counters: torch.Tensor | None = None,
    config: K.LaunchConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(seed)
    num_slots = sum(lens) + 37
    _, _, indptr, indices = _paged_layout(lens, num_slots, gen)
    k_buf = _randn(num_slots, hkv, d, gen=gen, dtype=dtype)
    v_buf = _randn(num_slots, hkv, d, gen=gen, dtype=dtype)
    bs = len(lens)
    q = _randn(bs, hq, d, gen=gen, dtype=dtype)
    o = torch.full((bs, hq, d), float("nan"), dtype=dtype, device=DEVICE)
    o_ref = torch.zeros_like(o)
    attn_logits = torch.full((bs, hq, max_splits, d), float("nan"), dtype=torch.float32, device=DEVICE)
    attn_lse = torch.full((bs, hq, max_splits), float("nan"), dtype=torch.float32, device=DEVICE)
    num_kv_splits = torch.tensor(splits, dtype=torch.int32, device=DEVICE)
    scale = d**-0.5
    K.decode_attention_fwd(
        q, k_buf, v_buf, o, indptr, indices, attn_logits, attn_lse, num_kv_splits, max_splits, scale, logit_cap,
        split_counters=split_counters, config=config,
    )
    R.decode_attention_fwd(
        q, k_buf, v_buf, o_ref, indptr, indices, attn_logits, attn_lse, num_kv_splits, max_splits, scale, logit_cap
    )
    return o, o_ref


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_decode_single_split(heads: tuple[int, int], d: int) -> None:
    hq, hkv = heads
    lens = [1, 50, 16, 93]
    o, o_ref = _run_decode(lens, hq, hkv, d, splits=[1] * 4, max_splits=1, seed=10)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_decode_split_kv(heads: tuple[int, int], d: int) -> None:
    hq, hkv = heads
    # Per-request split counts below, at and (clamped) above the max; lengths that leave trailing
    # splits empty (17 tokens over 3 splits of 16) and splits spanning several 16-token tiles.
    lens = [130, 17, 64, 5, 71]
    splits = [4, 3, 2, 1, 9]
    o, o_ref = _run_decode(lens, hq, hkv, d, splits=splits, max_splits=4, seed=11)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused-merge"])
def test_decode_with_the_split_layout_and_first_slots_loaded_before_the_pdl_wait_matches_reference(
        monkeypatch: pytest.MonkeyPatch, fused: bool) -> None:
    # PLAIT_PDL_PRELOAD: the first tile's slots come from before the wait, later tiles from the loop:
    # multi-tile splits, trailing empty splits, an empty request, two KV heads per program.
    monkeypatch.setenv("PLAIT_PDL_PRELOAD", "1")
    lens, splits = [130, 17, 0, 5, 71], [4, 3, 2, 1, 9]
    counters = torch.zeros(len(lens) * 2, dtype=torch.int32, device=DEVICE) if fused else None
    for config in (None, K.LaunchConfig(block_n=16, num_warps=4, num_stages=1, kv_pack=2)):
        o, o_ref = _run_decode(lens, 8, 2, 64, splits=splits, max_splits=4, seed=11, split_counters=counters,
                               config=config)
        torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_decode_splits_from_heuristic() -> None:
    lens = [300, 9, 120]
    seq_lens = torch.tensor(lens, device=DEVICE)
    splits = torch.zeros(3, dtype=torch.int32, device=DEVICE)
    K.get_num_kv_splits(seq_lens, splits, 4, num_sms=4, num_kv_heads=2, programs_per_sm=4, min_split_len=32)
    assert splits.tolist() == [4, 1, 3]
    o, o_ref = _run_decode(lens, 8, 2, 64, splits=splits.tolist(), max_splits=4, seed=12)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_decode_fused_split_merge_matches_reference_and_rezeroes_counters(heads: tuple[int, int]) -> None:
    hq, hkv = heads
    lens, splits = [0, 5, 50, 93, 64], [2, 3, 4, 4, 1]
    counters = torch.zeros(len(lens) * hkv, dtype=torch.int32, device=DEVICE)
    for seed in (16, 17):  # twice: the second launch relies on the first leaving the counters at zero
        o, o_ref = _run_decode(lens, hq, hkv, 64, splits=splits, max_splits=4, seed=seed, split_counters=counters)
        torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
        assert not counters.any()


@pytest.mark.parametrize(("pack", "hq", "hkv", "d"), [(2, 8, 4, 64), (4, 8, 4, 64), (2, 16, 4, 128), (8, 16, 8, 128)],
                         ids=["pack2-gqa2-d64", "pack4-gqa2-d64", "pack2-gqa4-d128", "pack8-gqa2-d128"])
def test_decode_kv_heads_packed_per_program_match_reference(pack: int, hq: int, hkv: int, d: int) -> None:
    # KV heads in packs of 2, 4 or 8 (block-diagonal q tiles): GQA 2 at head dim 64, GQA 4 at 128
    # (llama-3.1-8b's layout) and all 8 KV heads of qwen3-0.6b's layout in one program; the fused merge
    # over several splits, an empty request: each head's output as with one KV head per program.
    lens, splits = [0, 5, 50, 93], [2, 3, 4, 1]
    counters = torch.zeros(len(lens) * hkv, dtype=torch.int32, device=DEVICE)
    config = K.LaunchConfig(block_n=16, num_warps=4, num_stages=1, kv_pack=pack)
    o, o_ref = _run_decode(lens, hq, hkv, d, splits=splits, max_splits=4, seed=19, split_counters=counters,
                           config=config)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)
    assert not counters.any()


def test_decode_kv_pack_that_does_not_divide_the_kv_heads_runs_unpacked() -> None:
    config = K.LaunchConfig(block_n=16, num_warps=4, num_stages=1, kv_pack=4)
    o, o_ref = _run_decode([7, 40], 6, 2, 64, splits=[1, 2], max_splits=2, seed=20, config=config)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_decode_fused_split_merge_rejects_short_counters() -> None:
    with pytest.raises(ValueError, match="split_counters"):
        _run_decode([10, 20], 8, 2, 64, splits=[2, 2], max_splits=2, seed=18,
                    split_counters=torch.zeros(3, dtype=torch.int32, device=DEVICE))


def test_decode_logit_cap() -> None:
    o, o_ref = _run_decode([40, 77], 8, 2, 64, splits=[2, 3], max_splits=3, seed=13, logit_cap=1.5)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_decode_empty_request_writes_zeros() -> None:
    # seq_len 0 rows (padded CUDA-graph rows with a 0 fill) produce zeros, not NaN, and leave the
    # other rows unaffected.
    o, o_ref = _run_decode([0, 33, 0], 8, 2, 64, splits=[2, 2, 1], max_splits=2, seed=14)
    assert torch.all(o[0] == 0) and torch.all(o[2] == 0)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_decode_fp16() -> None:
    o, o_ref = _run_decode([45, 20], 8, 2, 64, splits=[3, 1], max_splits=3, seed=15, dtype=torch.float16)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-3, rtol=2e-3)


# ----------------------------------------------------------------------------------------------------
# extend
# ----------------------------------------------------------------------------------------------------


def _tree_mask(pre: int, ext: int, gen: torch.Generator) -> torch.Tensor:
    """Speculative-tree style [ext, pre + ext] mask: the prefix is visible to all; new token j sees
    itself and its ancestors, with parent(j) drawn from 0..j-1 (token 0 is the root)."""
    m = torch.zeros(ext, pre + ext, dtype=torch.bool)
    m[:, :pre] = True
    for j in range(ext):
        m[j, pre + j] = True
        if j > 0:
            parent = int(torch.randint(0, j, (1,), generator=gen))
            m[j, pre : pre + ext] |= m[parent, pre : pre + ext]
    return m


def _run_extend(
    prefix_lens: list[int],
    ext_lens: list[int],
    hq: int,
    hkv: int,
    d: int,
    seed: int,
    dtype: torch.dtype = torch.float32,
    is_causal: bool = True,
    tree_mask: bool = False,
    logit_cap: float = 0.0,
    pack_gqa: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = _gen(seed)
    num_slots = sum(prefix_lens) + sum(ext_lens) + 11
    _, _, kv_indptr, kv_indices = _paged_layout(prefix_lens, num_slots, gen)
    k_buf = _randn(num_slots, hkv, d, gen=gen, dtype=dtype)
    v_buf = _randn(num_slots, hkv, d, gen=gen, dtype=dtype)
    t = sum(ext_lens)
    q = _randn(t, hq, d, gen=gen, dtype=dtype)
    k = _randn(t, hkv, d, gen=gen, dtype=dtype)
    v = _randn(t, hkv, d, gen=gen, dtype=dtype)
    qo_indptr = torch.zeros(len(ext_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor(ext_lens), 0)
    qo_indptr = qo_indptr.to(DEVICE)
    custom_mask = mask_indptr = None
    if tree_mask:
        blocks = [_tree_mask(p, e, gen).flatten() for p, e in zip(prefix_lens, ext_lens, strict=True)]
        custom_mask = torch.cat(blocks).to(DEVICE)
        mask_indptr = torch.zeros(len(blocks) + 1, dtype=torch.int64)
        mask_indptr[1:] = torch.cumsum(torch.tensor([b.numel() for b in blocks]), 0)
        mask_indptr = mask_indptr.to(DEVICE)
    o = torch.full((t, hq, d), float("nan"), dtype=dtype, device=DEVICE)
    o_ref = torch.zeros_like(o)
    args = (qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max(ext_lens), d**-0.5)
    config = PACKED if pack_gqa else None
    K.extend_attention_fwd(q, k, v, o, k_buf, v_buf, *args, is_causal=is_causal, logit_cap=logit_cap, config=config)
    R.extend_attention_fwd(q, k, v, o_ref, k_buf, v_buf, *args, is_causal=is_causal, logit_cap=logit_cap)
    return o, o_ref


@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_extend_mixed_prefix(heads: tuple[int, int], d: int) -> None:
    hq, hkv = heads
    # Prefix 0 and > 0 in one batch; prefix lengths that are / are not tile multiples; extends that
    # span several 16-row query blocks and 16-token KV tiles, plus a 1-token extend.
    o, o_ref = _run_extend([0, 21, 32, 5], [37, 18, 1, 16], hq, hkv, d, seed=20)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("heads", [*HEADS, (6, 2)], ids=[*HEAD_IDS, "gqa3"])
def test_extend_mixed_prefix_packed_gqa(heads: tuple[int, int]) -> None:
    hq, hkv = heads
    o, o_ref = _run_extend([0, 21, 32, 5], [37, 18, 1, 16], hq, hkv, 64, seed=28, pack_gqa=True)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_extend_no_prefix_only() -> None:
    o, o_ref = _run_extend([0, 0], [33, 48], 8, 2, 64, seed=21)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_extend_custom_tree_mask(heads: tuple[int, int], pack_gqa: bool) -> None:
    hq, hkv = heads
    o, o_ref = _run_extend([19, 0, 40], [9, 20, 33], hq, hkv, 64, seed=22, tree_mask=True, pack_gqa=pack_gqa)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_decode_gqa3_non_power_of_two_group() -> None:
    o, o_ref = _run_decode([70, 9], 6, 2, 64, splits=[3, 2], max_splits=3, seed=16)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_extend_custom_mask_uint8_and_empty_rows() -> None:
    # A uint8 random mask where some rows see nothing at all: those rows come out as zeros.
    gen = _gen(23)
    pre, ext, hq, hkv, d = 7, 20, 8, 2, 64
    num_slots = pre + 5
    _, _, kv_indptr, kv_indices = _paged_layout([pre], num_slots, gen)
    k_buf = _randn(num_slots, hkv, d, gen=gen)
    v_buf = _randn(num_slots, hkv, d, gen=gen)
    q, k, v = (_randn(ext, h, d, gen=gen) for h in (hq, hkv, hkv))
    mask = (torch.rand(ext, pre + ext, generator=gen) < 0.4).to(torch.uint8)
    mask[3] = 0
    qo_indptr = torch.tensor([0, ext], dtype=torch.int32, device=DEVICE)
    mask_indptr = torch.tensor([0, mask.numel()], dtype=torch.int64, device=DEVICE)
    o = torch.full((ext, hq, d), float("nan"), device=DEVICE)
    o_ref = torch.zeros_like(o)
    args = (qo_indptr, kv_indptr, kv_indices, mask.flatten().to(DEVICE), mask_indptr, ext, d**-0.5)
    K.extend_attention_fwd(q, k, v, o, k_buf, v_buf, *args)
    R.extend_attention_fwd(q, k, v, o_ref, k_buf, v_buf, *args)
    assert torch.all(o[3] == 0)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_extend_non_causal() -> None:
    o, o_ref = _run_extend([12, 0], [21, 35], 8, 2, 64, seed=24, is_causal=False)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_extend_logit_cap() -> None:
    o, o_ref = _run_extend([17, 0], [20, 9], 8, 1, 64, seed=25, logit_cap=2.0)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_extend_fp16() -> None:
    o, o_ref = _run_extend([16, 3], [24, 11], 8, 2, 64, seed=26, dtype=torch.float16)
    torch.testing.assert_close(o.float(), o_ref.float(), atol=2e-3, rtol=2e-3)


def test_extend_matches_decode_for_one_new_token() -> None:
    # One new token with its K/V also in the cache: extend (prefix = the other tokens) and decode
    # (the whole context) must agree.
    gen = _gen(27)
    hq, hkv, d, n = 8, 2, 64, 45
    _, _, indptr, indices = _paged_layout([n], n + 3, gen)
    k_buf = _randn(n + 3, hkv, d, gen=gen)
    v_buf = _randn(n + 3, hkv, d, gen=gen)
    q = _randn(1, hq, d, gen=gen)
    last = indices[-1:].long()
    o_dec = torch.empty(1, hq, d, device=DEVICE)
    logits = torch.empty(1, hq, 2, d, device=DEVICE)
    lse = torch.empty(1, hq, 2, device=DEVICE)
    splits = torch.tensor([2], dtype=torch.int32, device=DEVICE)
    K.decode_attention_fwd(q, k_buf, v_buf, o_dec, indptr, indices, logits, lse, splits, 2, d**-0.5)
    o_ext = torch.empty(1, hq, d, device=DEVICE)
    kv_indptr = torch.tensor([0, n - 1], dtype=torch.int32, device=DEVICE)
    qo_indptr = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)
    K.extend_attention_fwd(
        q, k_buf[last], v_buf[last], o_ext, k_buf, v_buf, qo_indptr, kv_indptr, indices[:-1], None, None, 1, d**-0.5
    )
    torch.testing.assert_close(o_ext, o_dec, atol=ATOL, rtol=RTOL)


# ----------------------------------------------------------------------------------------------------
# TARGET_VERIFY as decode rows: build_verify_kv_indices + decode_attention_fwd
# ----------------------------------------------------------------------------------------------------


def _verify_layout(
    prefix_lens: list[int], ext_lens: list[int], gen: torch.Generator, tree: bool, mask_dtype: torch.dtype = torch.bool
) -> dict[str, torch.Tensor | None]:
    """A verify batch over a paged cache: prefixes in req_to_token (shuffled pool rows), the new
    tokens' slots in out_cache_loc (distinct from every prefix slot), a tree mask (or None: chain)."""
    bs = len(prefix_lens)
    num_slots = sum(prefix_lens) + sum(ext_lens) + 13
    req_to_token, rows, kv_indptr, kv_indices = _paged_layout(prefix_lens, num_slots, gen, max_reqs=bs + 4)
    used = set(kv_indices.tolist())
    free = torch.tensor([s for s in torch.randperm(num_slots, generator=gen).tolist() if s not in used])
    out_cache_loc = free[: sum(ext_lens)].to(DEVICE)
    qo_indptr = torch.zeros(bs + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor(ext_lens), 0)
    custom_mask = mask_indptr = None
    if tree:
        blocks = [_tree_mask(p, e, gen).flatten() for p, e in zip(prefix_lens, ext_lens, strict=True)]
        custom_mask = torch.cat(blocks).to(mask_dtype).to(DEVICE)
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int32)
        mask_indptr[1:] = torch.cumsum(torch.tensor([b.numel() for b in blocks]), 0)
        mask_indptr = mask_indptr.to(DEVICE)
    return dict(req_to_token=req_to_token, req_pool_indices=rows, prefix_lens=torch.tensor(prefix_lens, device=DEVICE),
                qo_indptr=qo_indptr.to(DEVICE), out_cache_loc=out_cache_loc, custom_mask=custom_mask,
                mask_indptr=mask_indptr, prefix_kv_indptr=kv_indptr, prefix_kv_indices=kv_indices,
                num_slots=torch.tensor(num_slots))


def _build_verify_rows(lay: dict, max_width: int, impl) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    num_rows = int(lay["qo_indptr"][-1])
    max_kv = int(lay["prefix_lens"].sum()) * max_width + num_rows * max_width
    row_lens = torch.full((num_rows,), -1, dtype=torch.int32, device=DEVICE)
    kv_indptr = torch.full((num_rows + 3,), -1, dtype=torch.int32, device=DEVICE)
    kv_indices = torch.full((max_kv + 5,), -7, dtype=torch.int32, device=DEVICE)
    impl.build_verify_kv_indices(lay["req_to_token"], lay["req_pool_indices"], lay["prefix_lens"], lay["qo_indptr"],
                                 lay["out_cache_loc"], lay["custom_mask"], lay["mask_indptr"], max_width, row_lens,
                                 kv_indptr, kv_indices)
    return row_lens, kv_indptr, kv_indices


@pytest.mark.parametrize("mask", ["chain", "tree", "tree_uint8"])
def test_build_verify_kv_indices_matches_reference(mask: str) -> None:
    gen = _gen(40)
    # Ragged widths (one of 1), prefix 0, a prefix longer than one 512-slot copy block; a grid wider
    # than every request (max_width 6 > 5), as a captured graph's may be.
    prefix_lens, ext_lens = [5, 0, 600, 17], [4, 3, 5, 1]
    dtype = torch.uint8 if mask == "tree_uint8" else torch.bool
    lay = _verify_layout(prefix_lens, ext_lens, gen, tree=mask != "chain", mask_dtype=dtype)
    got = _build_verify_rows(lay, 6, K)
    ref = _build_verify_rows(lay, 6, R)
    for g, r in zip(got, ref, strict=True):
        assert torch.equal(g, r)
    row_lens, kv_indptr, kv_indices = got
    total = int(kv_indptr[len(row_lens)])
    assert torch.all(kv_indices[total:] == -7)  # nothing written past the last row
    assert torch.all(kv_indptr[len(row_lens) + 1 :] == -1)
    # Row 0 (root of request 0) sees its prefix and itself only; the last row of a chain sees all.
    rows0 = lay["req_to_token"][lay["req_pool_indices"][0], :5]
    assert torch.equal(kv_indices[: int(kv_indptr[1])], torch.cat([rows0, lay["out_cache_loc"][:1].to(torch.int32)]))
    if mask == "chain":
        assert row_lens.tolist()[:4] == [6, 7, 8, 9]


def _run_verify_rows(prefix_lens: list[int], ext_lens: list[int], hq: int, hkv: int, d: int, seed: int, tree: bool,
                     max_splits: int = 4, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Verify attention through the decode kernel (rows from build_verify_kv_indices, split counts from
    the heuristic, fused split merge) vs the extend reference over (prefix + new tokens) under the mask."""
    gen = _gen(seed)
    lay = _verify_layout(prefix_lens, ext_lens, gen, tree)
    num_slots = int(lay["num_slots"])
    k_buf = _randn(num_slots, hkv, d, gen=gen, dtype=dtype)
    v_buf = _randn(num_slots, hkv, d, gen=gen, dtype=dtype)
    t = sum(ext_lens)
    q = _randn(t, hq, d, gen=gen, dtype=dtype)
    row_lens, kv_indptr, kv_indices = _build_verify_rows(lay, max(ext_lens), K)
    splits = torch.zeros(t, dtype=torch.int32, device=DEVICE)
    K.get_num_kv_splits(row_lens, splits, max_splits, num_sms=4, num_kv_heads=hkv, min_split_len=16)
    attn_logits = torch.full((t, hq, max_splits, d), float("nan"), device=DEVICE)
    attn_lse = torch.full((t, hq, max_splits), float("nan"), device=DEVICE)
    counters = torch.zeros(t * hkv, dtype=torch.int32, device=DEVICE)
    o = torch.full((t, hq, d), float("nan"), dtype=dtype, device=DEVICE)
    K.decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr[: t + 1], kv_indices, attn_logits, attn_lse, splits,
                           max_splits, d**-0.5, split_counters=counters)
    assert not counters.any()
    o_ref = torch.zeros_like(o)
    loc = lay["out_cache_loc"].long()
    R.extend_attention_fwd(q, k_buf[loc], v_buf[loc], o_ref, k_buf, v_buf, lay["qo_indptr"], lay["prefix_kv_indptr"],
                           lay["prefix_kv_indices"], lay["custom_mask"], lay["mask_indptr"], max(ext_lens), d**-0.5,
                           is_causal=not tree)
    return o, o_ref


@pytest.mark.parametrize("tree", [False, True], ids=["chain", "tree"])
@pytest.mark.parametrize("heads", HEADS, ids=HEAD_IDS)
def test_verify_rows_through_decode_kernel_match_extend_reference(heads: tuple[int, int], tree: bool) -> None:
    hq, hkv = heads
    o, o_ref = _run_verify_rows([45, 0, 70], [4, 4, 3], hq, hkv, 64, seed=41, tree=tree)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("pack_gqa", [False, True], ids=["unpacked", "packed"])
def test_extend_strided_k_v_views(pack_gqa: bool) -> None:
    # k/v as column views of one fused [T, (Hq + 2 Hkv), D] qkv tensor (token stride (Hq + 2 Hkv) * D), as
    # the backend passes them without a copy: equal to the contiguous call, bit for bit.
    gen = _gen(29)
    hq, hkv, d = 8, 2, 64
    prefix_lens, ext_lens = [0, 21, 5], [19, 7, 16]
    num_slots = sum(prefix_lens) + 11
    _, _, kv_indptr, kv_indices = _paged_layout(prefix_lens, num_slots, gen)
    k_buf = _randn(num_slots, hkv, d, gen=gen)
    v_buf = _randn(num_slots, hkv, d, gen=gen)
    t = sum(ext_lens)
    q, k, v = _randn(t, hq + 2 * hkv, d, gen=gen).split([hq, hkv, hkv], dim=1)
    assert not k.is_contiguous() and not v.is_contiguous()
    qo_indptr = torch.zeros(len(ext_lens) + 1, dtype=torch.int32)
    qo_indptr[1:] = torch.cumsum(torch.tensor(ext_lens), 0)
    args = (qo_indptr.to(DEVICE), kv_indptr, kv_indices, None, None, max(ext_lens), d**-0.5)
    config = PACKED if pack_gqa else None
    o = torch.empty(t, hq, d, device=DEVICE)
    o_contig = torch.empty_like(o)
    K.extend_attention_fwd(q, k, v, o, k_buf, v_buf, *args, config=config)
    K.extend_attention_fwd(q.contiguous(), k.contiguous(), v.contiguous(), o_contig, k_buf, v_buf, *args,
                           config=config)
    assert torch.equal(o, o_contig)
    o_ref = torch.zeros_like(o)
    R.extend_attention_fwd(q, k, v, o_ref, k_buf, v_buf, *args)
    torch.testing.assert_close(o, o_ref, atol=ATOL, rtol=RTOL)


def test_per_request_metadata_pointers_are_not_specialised_on_alignment():
    """A step passes per-request metadata (indptrs, pool rows, prefix lengths) as slices at any offset: a
    mixed step's extend requests start after its decode rows, a verify's indptrs share one packed
    buffer. Compiled variants must not depend on those pointers' alignment, or each new offset class
    compiles on the request path after the warm-up. Checked on the JIT kernels, outside the interpreter."""
    import json
    import subprocess
    import sys

    script = (
        "import json\n"
        "from plait.attention.triton import extend, indices\n"
        "from plait.attention.triton import decode\n"
        "kernels = (extend._extend_kernel, indices._build_kv_indices_kernel, indices._verify_kv_rows_kernel,"
        " decode._num_kv_splits_kernel, decode._decode_stage1_kernel)\n"
        "print(json.dumps({k.fn.__name__: sorted(p.name for p in k.params if p.do_not_specialize_on_alignment)"
        " for k in kernels}))\n"
        "print(json.dumps([p.name for p in decode._num_kv_splits_kernel.params if p.do_not_specialize]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    alignment, split_planner_ints = (json.loads(line) for line in done.stdout.splitlines())
    # The split planner runs once per decode step at that step's batch size: specialising on it (1,
    # multiples of 16) would compile a variant per batch-size class on the request path.
    assert split_planner_ints == ["bs"]
    assert alignment == {
        "_extend_kernel": ["Custom_Mask", "Kv_Indices", "Kv_Indptr", "Mask_Indptr", "Qo_Indptr", "Sinks"],
        "_build_kv_indices_kernel": ["Kv_Indptr", "Kv_Start_Idx", "Req_Pool_Indices", "Seq_Lens"],
        "_verify_kv_rows_kernel": ["Kv_Indptr", "Mask_Indptr", "Prefix_Lens", "Qo_Indptr", "Req_Pool_Indices",
                                   "Row_Lens"],
        "_num_kv_splits_kernel": ["Out", "Seq_Lens"],
        "_decode_stage1_kernel": ["Kv_Indices", "Kv_Indptr", "Num_Kv_Splits", "Sinks"],
    }

