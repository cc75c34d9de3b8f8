"""Triton attention kernels vs. the fp32 torch references at production shapes (bf16, head dim 128,
32 q / 8 kv heads, contexts up to 32k, batch up to 256). Needs a CUDA GPU (run on the H200)."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

triton = pytest.importorskip("triton")

from plait.attention.torch_native import TorchNativeAttnBackend  # noqa: E402
from plait.attention.triton import kernels as K  # noqa: E402
from plait.attention.triton import reference as R  # noqa: E402
from plait.attention.triton_backend import TritonAttnBackend  # noqa: E402
from plait.speculative.tree import DraftTree, build_verify_mask  # noqa: E402
from tests.attn_cases import as_target_verify, extend_batch, fused_qkv, layer, make_pools, run  # noqa: E402

HQ, HKV, D = 32, 8, 128
DTYPE = torch.bfloat16
# bf16 inputs/outputs and bf16 probabilities in the P.V product, against an fp32 reference on the same
# bf16 inputs: outputs are O(0.1..1), so ~1 bf16 ulp of the output plus accumulated rounding.
ATOL, RTOL = 1e-2, 2e-2
MAX_KV_SPLITS = 16


def _capture(step):
    """Warm ``step`` up on a side stream (Triton compiles outside the capture), then capture it:
    (the graph, the captured call's output)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


def _num_sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def _layout(
    lens: list[int], gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """Random distinct slots per request, written into req_to_token at shuffled pool rows.
    Returns req_to_token, req_pool_indices, kv_indptr (expected), kv_indices (expected), num_slots."""
    bs = len(lens)
    num_slots = sum(lens) + 64
    perm = torch.randperm(num_slots, generator=gen, device="cpu").to(torch.int32)
    rows = torch.randperm(bs + 16, generator=gen)[:bs]
    req_to_token = torch.zeros(bs + 16, max(lens) + 1, dtype=torch.int32)
    chunks, used = [], 0
    for i, n in enumerate(lens):
        req_to_token[rows[i], :n] = perm[used : used + n]
        chunks.append(perm[used : used + n])
        used += n
    indptr = torch.zeros(bs + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(lens), 0)
    return req_to_token.cuda(), rows.cuda(), indptr.cuda(), torch.cat(chunks).cuda(), num_slots


def _decode_inputs(lens: list[int], seed: int, heads: tuple[int, int, int] = (HQ, HKV, D)
                   ) -> tuple[torch.Tensor, ...]:
    """q, k_buf, v_buf, seq_lens, kv_indptr and kv_indices (built by the kernel, checked) of a paged
    decode batch with contexts ``lens``; ``heads`` = (q heads, KV heads, head dim)."""
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    req_to_token, rows, _, indices_ref, num_slots = _layout(lens, gen)
    bs = len(lens)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device="cuda")
    k_buf = torch.randn(num_slots, hkv, d, device="cuda", dtype=DTYPE)
    v_buf = torch.randn(num_slots, hkv, d, device="cuda", dtype=DTYPE)
    q = torch.randn(bs, hq, d, device="cuda", dtype=DTYPE)
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    kv_indptr[1:] = torch.cumsum(seq_lens, 0)
    kv_indices = torch.empty(int(kv_indptr[-1]), dtype=torch.int32, device="cuda")
    K.build_kv_indices(req_to_token, rows, seq_lens, kv_indptr, kv_indices)
    assert torch.equal(kv_indices, indices_ref)
    return q, k_buf, v_buf, seq_lens, kv_indptr, kv_indices


def _decode_case(lens: list[int], seed: int, fused: bool = False, heads: tuple[int, int, int] = (HQ, HKV, D),
                 config: K.LaunchConfig | None = None) -> None:
    hq, hkv, d = heads
    q, k_buf, v_buf, seq_lens, kv_indptr, kv_indices = _decode_inputs(lens, seed, heads)
    bs = len(lens)

    splits = torch.empty(bs, dtype=torch.int32, device="cuda")
    K.get_num_kv_splits(seq_lens, splits, MAX_KV_SPLITS, _num_sms(), num_kv_heads=hkv)
    logits = torch.empty(bs, hq, MAX_KV_SPLITS, d, dtype=torch.float32, device="cuda")
    lse = torch.empty(bs, hq, MAX_KV_SPLITS, dtype=torch.float32, device="cuda")
    o = torch.empty(bs, hq, d, dtype=DTYPE, device="cuda")
    counters = torch.zeros(bs * hkv, dtype=torch.int32, device="cuda") if fused else None
    K.decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, logits, lse, splits, MAX_KV_SPLITS, d**-0.5,
                           split_counters=counters, config=config)
    if fused:
        assert counters is not None and not counters.any()
    o_ref = torch.empty(bs, hq, d, dtype=torch.float32, device="cuda")
    R.decode_attention_fwd(q, k_buf, v_buf, o_ref, kv_indptr, kv_indices, None, None, None, 0, d**-0.5)
    torch.testing.assert_close(o.float(), o_ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused-merge"])
def test_decode_bs256_mixed_lengths(fused: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(1, 2048, (256,), generator=gen).tolist()
    _decode_case(lens, seed=1, fused=fused)


def test_decode_config_packs_two_kv_heads_per_program_in_large_batches() -> None:
    assert K.decode_config(torch.empty(256, 32, 64, device="cuda"), 64, 8)[0].kv_pack == 2
    assert K.decode_config(torch.empty(64, 32, 64, device="cuda"), 64, 8)[0].kv_pack == 2
    large_d128 = K.decode_config(torch.empty(256, 32, 128, device="cuda"), 128, 8)[0]
    assert (large_d128.kv_pack, large_d128.block_n) == (2, 32)
    assert K.decode_config(torch.empty(256, 16, 128, device="cuda"), 128, 8)[0].kv_pack == 1  # groups of 2
    assert K.decode_config(torch.empty(64, 32, 128, device="cuda"), 128, 8)[0].kv_pack == 1
    assert K.decode_config(torch.empty(1, 32, 64, device="cuda"), 64, 8)[0].kv_pack == 1


@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused-merge"])
def test_decode_head_dim_128_with_kv_heads_packed_two_per_program(fused: bool) -> None:
    # llama-3.1-8b's attention (32 q / 8 KV heads, head dim 128) with its large-batch tile, 32 tokens x 2 heads.
    gen = torch.Generator().manual_seed(6)
    lens = torch.randint(1, 1024, (256,), generator=gen).tolist() + [20000]
    config = K.LaunchConfig(block_n=32, num_warps=4, num_stages=2, kv_pack=2)
    _decode_case(lens, seed=7, fused=fused, heads=(32, 8, 128), config=config)


@pytest.mark.parametrize("pack", [4, 8])
def test_decode_head_dim_128_groups_of_two_with_kv_heads_packed_wide(pack: int) -> None:
    # qwen3-0.6b's attention (16 q / 8 KV heads, head dim 128): 4 or all 8 KV heads a program in 16-token
    # tiles, the tiles kernels_bench --sweep-decode tries for small GQA groups.
    gen = torch.Generator().manual_seed(8)
    lens = torch.randint(1, 2048, (128,), generator=gen).tolist() + [20000]
    config = K.LaunchConfig(block_n=16, num_warps=8, num_stages=2, kv_pack=pack)
    _decode_case(lens, seed=9, fused=True, heads=(16, 8, 128), config=config)


@pytest.mark.parametrize("pack", [1, 2, 4])
@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused-merge"])
def test_decode_head_dim_64_with_kv_heads_packed_per_program(fused: bool, pack: int) -> None:
    # llama-3.2-1b's attention (32 q / 8 KV heads, head dim 64) at bs 256 and at a split long context.
    gen = torch.Generator().manual_seed(4)
    lens = torch.randint(1, 1024, (256,), generator=gen).tolist() + [20000]
    config = K.LaunchConfig(block_n=64, num_warps=4, num_stages=2, kv_pack=pack)
    _decode_case(lens, seed=5, fused=fused, heads=(32, 8, 64), config=config)


@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused-merge"])
def test_decode_long_context_32k(fused: bool) -> None:
    _decode_case([32768, 20000, 1, 4097], seed=2, fused=fused)


@pytest.mark.parametrize("fused", [False, True], ids=["two-stage", "fused-merge"])
def test_decode_bs1_ctx384(fused: bool) -> None:
    _decode_case([384], seed=3, fused=fused)


def test_decode_fused_merge_is_bitwise_the_two_stage_result_over_many_launches() -> None:
    """The in-kernel merge does stage 2's arithmetic in stage 2's order, so any difference is a
    publication race (a partial read before it was written): 200 launches at bs 64, contexts up to
    8k (many splits per request), each compared bit for bit."""
    bs = 64
    lens = torch.randint(1, 8192, (bs,), generator=torch.Generator().manual_seed(7)).tolist()
    q, k_buf, v_buf, _, kv_indptr, kv_indices = _decode_inputs(lens, seed=8)
    splits = torch.full((bs,), MAX_KV_SPLITS, dtype=torch.int32, device="cuda")
    logits = torch.empty(bs, HQ, MAX_KV_SPLITS, D, dtype=torch.float32, device="cuda")
    lse = torch.empty(bs, HQ, MAX_KV_SPLITS, dtype=torch.float32, device="cuda")
    expect = torch.empty(bs, HQ, D, dtype=DTYPE, device="cuda")
    K.decode_attention_fwd(q, k_buf, v_buf, expect, kv_indptr, kv_indices, logits, lse, splits, MAX_KV_SPLITS,
                           D**-0.5)
    counters = torch.zeros(bs * HKV, dtype=torch.int32, device="cuda")
    outs = [torch.empty_like(expect) for _ in range(200)]
    for o in outs:
        K.decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, logits, lse, splits, MAX_KV_SPLITS,
                               D**-0.5, split_counters=counters)
    torch.cuda.synchronize()
    assert sum(not torch.equal(o, expect) for o in outs) == 0
    assert not counters.any()


def test_decode_cuda_graph_replay() -> None:
    """build_kv_indices + get_num_kv_splits + decode captured once into static buffers, replayed with
    other lengths and pool rows: no host sync, no dynamic allocation."""
    gen = torch.Generator().manual_seed(4)
    max_bs, max_ctx = 8, 4096
    num_slots = max_bs * max_ctx
    req_to_token = torch.randperm(num_slots, generator=gen).to(torch.int32).view(max_bs, max_ctx).cuda()
    k_buf = torch.randn(num_slots, HKV, D, device="cuda", dtype=DTYPE)
    v_buf = torch.randn(num_slots, HKV, D, device="cuda", dtype=DTYPE)
    q = torch.randn(max_bs, HQ, D, device="cuda", dtype=DTYPE)
    rows = torch.zeros(max_bs, dtype=torch.int64, device="cuda")
    seq_lens = torch.ones(max_bs, dtype=torch.int32, device="cuda")
    kv_indptr = torch.zeros(max_bs + 1, dtype=torch.int32, device="cuda")
    kv_indices = torch.zeros(max_bs * max_ctx, dtype=torch.int32, device="cuda")
    splits = torch.ones(max_bs, dtype=torch.int32, device="cuda")
    logits = torch.empty(max_bs, HQ, MAX_KV_SPLITS, D, dtype=torch.float32, device="cuda")
    lse = torch.empty(max_bs, HQ, MAX_KV_SPLITS, dtype=torch.float32, device="cuda")
    o = torch.empty(max_bs, HQ, D, dtype=DTYPE, device="cuda")

    def step() -> None:
        torch.cumsum(seq_lens, 0, dtype=torch.int32, out=kv_indptr[1:])
        K.build_kv_indices(req_to_token, rows, seq_lens, kv_indptr, kv_indices)
        K.get_num_kv_splits(seq_lens, splits, MAX_KV_SPLITS, _num_sms(), num_kv_heads=HKV)
        K.decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, logits, lse, splits, MAX_KV_SPLITS, D**-0.5,
                               split_counters=counters)

    counters = torch.zeros(max_bs * HKV, dtype=torch.int32, device="cuda")  # the engine's path: fused merge
    graph, _ = _capture(step)

    for trial in range(3):
        lens = torch.randint(1, max_ctx, (max_bs,), generator=gen)
        rows.copy_(torch.randperm(max_bs, generator=gen))
        seq_lens.copy_(lens)
        graph.replay()
        torch.cuda.synchronize()
        o_ref = torch.empty(max_bs, HQ, D, dtype=torch.float32, device="cuda")
        R.decode_attention_fwd(q, k_buf, v_buf, o_ref, kv_indptr, kv_indices, None, None, None, 0, D**-0.5)
        expect_indices = torch.cat([req_to_token[int(rows[i]), : int(lens[i])] for i in range(max_bs)])
        assert torch.equal(kv_indices[: expect_indices.numel()], expect_indices), trial
        torch.testing.assert_close(o.float(), o_ref, atol=ATOL, rtol=RTOL)


def _extend_case(prefix_lens: list[int], ext_lens: list[int], seed: int, tree: bool = False,
                 heads: tuple[int, int, int] = (HQ, HKV, D)) -> None:
    hq, hkv, d = heads
    gen = torch.Generator().manual_seed(seed)
    bs = len(ext_lens)
    _, _, kv_indptr, kv_indices, num_slots = _layout([max(p, 1) for p in prefix_lens], gen)
    # _layout needs n >= 1 per request; rebuild the CSR for the real (possibly 0) prefix lengths.
    starts = kv_indptr[:-1].cpu()
    kv_indices = torch.cat([kv_indices[int(starts[i]) : int(starts[i]) + p] for i, p in enumerate(prefix_lens)])
    kv_indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    kv_indptr[1:] = torch.cumsum(torch.tensor(prefix_lens, device="cuda"), 0)
    k_buf = torch.randn(num_slots, hkv, d, device="cuda", dtype=DTYPE)
    v_buf = torch.randn(num_slots, hkv, d, device="cuda", dtype=DTYPE)
    t = sum(ext_lens)
    qkv = torch.randn(t, hq + 2 * hkv, d, device="cuda", dtype=DTYPE)  # fused projection output
    q, k, v = qkv[:, :hq], qkv[:, hq : hq + hkv], qkv[:, hq + hkv :]
    qo_indptr = torch.zeros(bs + 1, dtype=torch.int32, device="cuda")
    qo_indptr[1:] = torch.cumsum(torch.tensor(ext_lens, device="cuda"), 0)
    custom_mask = mask_indptr = None
    if tree:
        blocks = []
        for p, e in zip(prefix_lens, ext_lens, strict=True):
            m = torch.zeros(e, p + e, dtype=torch.bool)
            m[:, :p] = True
            for j in range(e):
                m[j, p + j] = True
                if j:
                    m[j, p : p + e] |= m[int(torch.randint(0, j, (1,), generator=gen)), p : p + e]
            blocks.append(m.flatten())
        custom_mask = torch.cat(blocks).cuda()
        mask_indptr = torch.zeros(bs + 1, dtype=torch.int64, device="cuda")
        mask_indptr[1:] = torch.cumsum(torch.tensor([b.numel() for b in blocks], device="cuda"), 0)
    o = torch.empty(t, hq, d, device="cuda", dtype=DTYPE)
    o_ref = torch.empty(t, hq, d, device="cuda", dtype=torch.float32)
    args = (qo_indptr, kv_indptr, kv_indices, custom_mask, mask_indptr, max(ext_lens), d**-0.5)
    K.extend_attention_fwd(q, k, v, o, k_buf, v_buf, *args)
    R.extend_attention_fwd(q, k, v, o_ref, k_buf, v_buf, *args)
    torch.testing.assert_close(o.float(), o_ref, atol=ATOL, rtol=RTOL)


def test_extend_8x2048_no_prefix() -> None:
    _extend_case([0] * 8, [2048] * 8, seed=10)


def test_extend_with_prefix_mixed() -> None:
    _extend_case([3000, 0, 1000, 17, 8191], [2048, 1500, 511, 100, 1], seed=11)


@pytest.mark.parametrize("heads", [(32, 8, 64), (16, 8, 128), (8, 8, 128)], ids=["1b", "qwen3-0.6b", "mha"])
def test_extend_long_tiles_at_other_head_dims_and_groups(heads: tuple[int, int, int]) -> None:
    """The long-extend tiles per head dim (packed GQA rows at head dim 128) over ragged prompts, with and
    without a cached prefix."""
    _extend_case([0, 0, 1024, 300, 0], [1024, 700, 1024, 129, 1], seed=14, heads=heads)


def test_extend_tree_mask_verify_shapes() -> None:
    # Speculative verify: 32 requests, 8 draft tokens each, long prefixes, tree masks.
    gen = torch.Generator().manual_seed(12)
    prefix = torch.randint(1, 6000, (32,), generator=gen).tolist()
    _extend_case(prefix, [8] * 32, seed=13, tree=True)


def test_fp32_uses_full_precision() -> None:
    # fp32 inputs must not be multiplied in TF32 on the GPU.
    gen = torch.Generator().manual_seed(20)
    lens = [700, 3]
    _, _, kv_indptr, kv_indices, num_slots = _layout(lens, gen)
    k_buf = torch.randn(num_slots, HKV, D, device="cuda")
    v_buf = torch.randn(num_slots, HKV, D, device="cuda")
    q = torch.randn(2, HQ, D, device="cuda")
    splits = torch.tensor([4, 1], dtype=torch.int32, device="cuda")
    logits = torch.empty(2, HQ, 4, D, device="cuda")
    lse = torch.empty(2, HQ, 4, device="cuda")
    o, o_ref = torch.empty(2, HQ, D, device="cuda"), torch.empty(2, HQ, D, device="cuda")
    K.decode_attention_fwd(q, k_buf, v_buf, o, kv_indptr, kv_indices, logits, lse, splits, 4, D**-0.5)
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        R.decode_attention_fwd(q, k_buf, v_buf, o_ref, kv_indptr, kv_indices, None, None, None, 0, D**-0.5)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev
    torch.testing.assert_close(o, o_ref, atol=1e-4, rtol=1e-4)


def test_store_kv_bf16() -> None:
    gen = torch.Generator().manual_seed(30)
    num_slots, t = 100_000, 4096
    k_buf = torch.zeros(num_slots, HKV, D, device="cuda", dtype=DTYPE)
    v_buf = torch.zeros_like(k_buf)
    qkv = torch.randn(t, HQ + 2 * HKV, D, device="cuda", dtype=DTYPE)
    k, v = qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :]
    loc = torch.randperm(num_slots, generator=gen)[:t].cuda()
    K.store_kv(k_buf, v_buf, loc, k, v)
    assert torch.equal(k_buf[loc], k) and torch.equal(v_buf[loc], v)
    assert int(torch.count_nonzero(k_buf.abs().sum((1, 2)))) == t


# --- TARGET_VERIFY through the decode kernel (the backend's verify rows) vs torch_native -------------

VERIFY_WIDTH = 4
VERIFY_TREES = {
    "chain": DraftTree.chain(1, [2, 3, 4]),
    "tree": DraftTree([1, 2, 3, 4], [-1, 0, 0, 1]),  # root with two children, a grandchild under the first
}


def _verify_setup(bs: int, prefix: int, kind: str, seed: int):
    """torch_native and Triton backends over one bf16 paged cache, and a verify batch of ``bs`` requests
    with ``prefix`` cached tokens and a width-4 draft (chain or tree) each; q/k/v fused-qkv views."""
    slots = bs * (prefix + VERIFY_WIDTH) + 1
    pool, kv, g = make_pools(HKV, D, seed, dtype=DTYPE, device="cuda", max_context=prefix + VERIFY_WIDTH,
                             slots=slots, max_reqs=bs + 2)
    fb = extend_batch(pool, g, [prefix] * bs, [VERIFY_WIDTH] * bs, num_slots=slots)
    as_target_verify(fb, build_verify_mask([VERIFY_TREES[kind]] * bs, [prefix] * bs, "cuda"))
    qkv = fused_qkv(fb.num_tokens, HQ, HKV, D, g, dtype=DTYPE, device="cuda")
    return TorchNativeAttnBackend(pool, kv), TritonAttnBackend(pool, kv, HQ, verify_via_decode=True), fb, qkv, g


@pytest.mark.parametrize("kind", ["chain", "tree"])
@pytest.mark.parametrize("bs", [1, 16])
def test_target_verify_rows_match_torch_native(bs: int, kind: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import plait.attention.triton_backend as tb

    monkeypatch.setattr(tb, "VERIFY_ROWS_MAX_BS", 16)  # the rows path at bs 16 too (shipped cap: 8)
    native, triton_be, fb, (q, k, v), _ = _verify_setup(bs, 512, kind, seed=40 + bs)
    lay = layer(HQ, HKV, D)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.verify_md is not None and triton_be.extend_md is None  # the decode-kernel path ran
    assert int(triton_be.verify_md.bufs.num_kv_splits[: fb.num_tokens].max()) > 1  # split and merged
    torch.testing.assert_close(got.float(), run(native, fb, q, k, v, lay).float(), atol=ATOL, rtol=RTOL)


def test_target_verify_rows_cuda_graph_replay() -> None:
    """Verify rows on graph buffers: plan (in_capture), capture in_graph + attention, then replay with
    another mask (chain -> tree), other queries and K/V in the same tensors, planned again outside."""
    bs = 16
    native, triton_be, fb, (q, k, v), g = _verify_setup(bs, 512, "chain", seed=50)
    triton_be.init_cuda_graph_state(bs, bs * VERIFY_WIDTH)
    lay = layer(HQ, HKV, D)

    def step() -> torch.Tensor:
        triton_be.init_forward_metadata_in_graph(fb)
        return triton_be.forward(q, k, v, lay, fb)

    triton_be.init_forward_metadata_out_graph(fb, in_capture=True)
    graph, out = _capture(step)

    fb.spec_info.custom_mask.copy_(build_verify_mask([VERIFY_TREES["tree"]] * bs, [512] * bs, "cuda"))
    for t in (q, k, v):
        t.copy_(torch.randn(t.shape, generator=g).to("cuda", DTYPE))
    triton_be.init_forward_metadata_out_graph(fb)  # the replay's pre-planning, outside the graph
    graph.replay()
    torch.cuda.synchronize()
    want = run(native, fb, q, k, v, lay).float()
    torch.testing.assert_close(out.float(), want, atol=ATOL, rtol=RTOL)


def test_mixed_step_decode_rows_match_torch_native() -> None:
    """offline-throughput's mixed step in small: a 512-token chunk beside 64 decode rows over 512-token
    prefixes (bf16, on the GPU). The decode rows take the decode kernel, the chunk the extend kernel."""
    from plait.forward_batch import ForwardMode

    rows, prefix = 64, 512
    prefixes, exts = [prefix] * rows + [0], [1] * rows + [512]
    slots = sum(prefixes) + sum(exts) + 1
    pool, kv, g = make_pools(HKV, D, 60, dtype=DTYPE, device="cuda", max_context=1024, slots=slots,
                             max_reqs=rows + 3)
    fb = extend_batch(pool, g, prefixes, exts, num_slots=slots)
    fb.forward_mode = ForwardMode.MIXED
    q, k, v = fused_qkv(fb.num_tokens, HQ, HKV, D, g, dtype=DTYPE, device="cuda")
    triton_be = TritonAttnBackend(pool, kv, HQ)
    lay = layer(HQ, HKV, D)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    assert triton_be.mixed_rows_md is not None and triton_be.mixed_rows_md.num_rows == rows
    want = run(TorchNativeAttnBackend(pool, kv), fb, q, k, v, lay)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("exts", [[512] * 4, [100, 333, 512, 1024]], ids=["one-length", "ragged"])
def test_fresh_prompts_through_the_fused_kernels_match_torch_native(exts: list[int]) -> None:
    """A mixed step's fresh prompts (no cached prefix) beside 16 decode rows: one batched SDPA call for
    prompts of one length (the default on CUDA), the extend kernel for ragged ones."""
    from plait.forward_batch import ForwardMode

    rows, prefix = 16, 512
    prefixes, lens = [prefix] * rows + [0] * len(exts), [1] * rows + exts
    slots = sum(prefixes) + sum(lens) + 1
    pool, kv, g = make_pools(HKV, D, 61, dtype=DTYPE, device="cuda", max_context=1024, slots=slots,
                             max_reqs=len(lens) + 3)
    fb = extend_batch(pool, g, prefixes, lens, num_slots=slots)
    fb.forward_mode = ForwardMode.MIXED
    q, k, v = fused_qkv(fb.num_tokens, HQ, HKV, D, g, dtype=DTYPE, device="cuda")
    triton_be = TritonAttnBackend(pool, kv, HQ)
    assert triton_be.prefill_via_flash
    lay = layer(HQ, HKV, D)
    got = run(triton_be, fb, q, k, v, lay, clone=False)
    md = triton_be.flash_prefill_md
    if len(set(exts)) > 1:
        assert md is None
    else:
        assert md is not None and (md.token_start, md.count, md.length) == (rows, len(exts), exts[0])
    want = run(TorchNativeAttnBackend(pool, kv), fb, q, k, v, lay)
    torch.testing.assert_close(got.float(), want.float(), atol=ATOL, rtol=RTOL)


def test_the_split_planner_compiles_one_variant_for_all_batch_sizes_and_offsets() -> None:
    """Serving meets every batch size and a mixed step's decode rows as a slice at any offset: after
    its first launch, the split planner must not compile again for any of them."""
    from plait.bench.warm_start import TritonCompiles

    out = torch.zeros(1024, dtype=torch.int32, device="cuda")
    lens = torch.randint(1, 4096, (1024,), device="cuda")
    K.get_num_kv_splits(lens[:7], out, MAX_KV_SPLITS, num_sms=132, num_kv_heads=HKV)
    with TritonCompiles() as compiles:
        for bs, offset in [(1, 0), (1, 3), (16, 0), (17, 5), (64, 1), (256, 0), (300, 2), (1000, 7)]:
            got = out[offset:offset + bs]
            K.get_num_kv_splits(lens[offset:offset + bs], got, MAX_KV_SPLITS, num_sms=132, num_kv_heads=HKV)
            ref = torch.zeros_like(got)
            R.get_num_kv_splits(lens[offset:offset + bs], ref, MAX_KV_SPLITS, num_sms=132, num_kv_heads=HKV)
            assert torch.equal(got, ref), (bs, offset)
    assert compiles.names.get("_num_kv_splits_kernel", 0) == 0, compiles.variants


def test_the_extend_kernel_compiles_no_variant_for_metadata_at_other_offsets() -> None:
    """A mixed step hands the extend kernel its requests' indptrs as slices after the decode rows, at any
    offset: once a long extend has launched, the same launch with its metadata elsewhere in a buffer
    must not compile again, and gives the same output."""
    from plait.attention.triton.extend import extend_attention_fwd
    from plait.bench.warm_start import TritonCompiles

    g = torch.Generator(device="cuda").manual_seed(5)
    exts, slots = [100, 200], 512
    t = sum(exts)
    q = torch.randn(t, HQ, D, device="cuda", dtype=DTYPE, generator=g)
    k = torch.randn(t, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    v = torch.randn(t, HKV, D, device="cuda", dtype=DTYPE, generator=g)
    k_buffer = torch.zeros(slots, HKV, D, device="cuda", dtype=DTYPE)
    v_buffer = torch.zeros_like(k_buffer)
    qo = [0, exts[0], t]

    def launch(offset: int) -> torch.Tensor:
        meta = torch.zeros(offset + 8, dtype=torch.int32, device="cuda")
        meta[offset:offset + 3] = torch.tensor(qo, dtype=torch.int32)
        kv_indptr = torch.zeros(offset + 8, dtype=torch.int32, device="cuda")[offset:offset + 3]
        indices = torch.zeros(offset + 8, dtype=torch.int32, device="cuda")[offset:]
        o = torch.empty_like(q)
        extend_attention_fwd(q, k, v, o, k_buffer, v_buffer, meta[offset:offset + 3], kv_indptr, indices, None,
                             None, max(exts), D ** -0.5)
        return o

    first = launch(0)
    with TritonCompiles() as compiles:
        for offset in (1, 2, 3, 5):
            assert torch.equal(launch(offset), first), offset
    assert compiles.names.get("_extend_kernel", 0) == 0, compiles.variants
