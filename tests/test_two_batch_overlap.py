"""Two-batch overlap: where batches split, the children they split into, and the same tokens with it
on as off (tp 2 over gloo, where there are sums to overlap)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from plait.attention.plan_check import PlanCheckingBackend
from plait.attention.tbo_backend import TboAttnBackend
from plait.attention.torch_native import TorchNativeAttnBackend
from plait.config import EngineConfig
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool
from plait.two_batch_overlap import (
    FIELD_RULES,
    TboSplit,
    check_field_rules,
    choose_split,
    compute_split_seq_index,
    compute_split_token_index,
    is_two_chunk_split,
    plan_split,
    split_forward_batch,
)
from tests.helpers import assert_no_leaks, make_engine, prompt_ids, single_rank_outputs

D, E, V, IDLE = ForwardMode.DECODE, ForwardMode.EXTEND, ForwardMode.TARGET_VERIFY, ForwardMode.IDLE

# (mode, num_tokens, extend_lens, tokens per request, threshold) -> (split request, split token)
SPLIT_CASES = [
    pytest.param(IDLE, 0, None, 0, 0.48, (0, 0), id="idle"),
    pytest.param(D, 0, None, 1, 0.48, (None, None), id="empty-decode"),
    pytest.param(D, 1, None, 1, 0.48, (None, None), id="one-request"),
    pytest.param(D, 5, None, 1, 0.48, (2, 2), id="odd-decode"),
    pytest.param(D, 8, None, 1, 0.48, (4, 4), id="even-decode"),
    pytest.param(V, 24, None, 4, 0.48, (3, 12), id="verify-6x4"),
    pytest.param(V, 12, None, 4, 0.48, (1, 4), id="verify-3x4"),
    pytest.param(V, 4, None, 4, 0.48, (None, None), id="verify-one-request"),
    pytest.param(V, 10, [3, 2, 4, 1], None, 0.48, (2, 5), id="verify-mixed-widths"),
    pytest.param(E, 360, [100, 50, 30, 80, 40, 60], None, 0.48, (3, 180), id="balanced-boundary"),
    pytest.param(E, 2, [1, 1], None, 0.48, (1, 1), id="two-one-token-extends"),
    pytest.param(E, 600, [10, 20, 30, 500, 40], None, 0.48, (3, 300), id="two-chunk-inside-request"),
    pytest.param(E, 1000, [1000], None, 0.48, (0, 500), id="two-chunk-single-request"),
    pytest.param(E, 600, [10, 20, 30, 500, 40], None, 0.0, (3, 60), id="two-chunk-disabled"),
    pytest.param(E, 1, [1], None, 0.48, (None, None), id="one-token-extend"),
    # Cutting at total // 2 would leave the cut request no tokens in child A: the boundary instead.
    pytest.param(E, 15, [1] * 10 + [5], None, 0.48, (8, 8), id="two-chunk-empty-first-part"),
    # Empty entries (a DP-synced batch): child A would hold more requests than tokens.
    pytest.param(E, 3, [0, 0, 0, 3], None, 0.48, (3, 0), id="two-chunk-more-requests-than-tokens"),
]


@pytest.mark.parametrize(("mode", "num_tokens", "lens", "per_seq", "threshold", "expected"), SPLIT_CASES)
def test_split_indices(mode, num_tokens, lens, per_seq, threshold, expected):
    seq = compute_split_seq_index(mode, num_tokens, lens, per_seq, threshold)
    token = None if seq is None else compute_split_token_index(seq, mode, lens, per_seq, threshold)
    assert (seq, token) == expected


def test_two_chunk_needs_a_threshold_at_most_half():
    with pytest.raises(ValueError, match=r"tbo_token_distribution_threshold must be in \[0, 0.5\]"):
        is_two_chunk_split([10, 500], 0.6)


def _decode_batch(bs: int) -> ForwardBatch:
    ids = torch.arange(bs, dtype=torch.int64)
    return ForwardBatch(forward_mode=D, batch_size=bs, input_ids=ids + 100, req_pool_indices=ids + 1,
                        seq_lens=ids + 10, out_cache_loc=ids + 50, positions=ids + 9,
                        seq_lens_cpu=(ids + 10).tolist(), seq_lens_sum=int((ids + 10).sum()))


def _extend_batch(seq_lens: list[int], prefix_lens: list[int]) -> ForwardBatch:
    n = sum(seq_lens)
    starts = [sum(seq_lens[:i]) for i in range(len(seq_lens))]
    total = [s + p for s, p in zip(seq_lens, prefix_lens, strict=True)]
    ext = ExtendInfo(num_tokens=n, seq_lens=torch.tensor(seq_lens), prefix_lens=torch.tensor(prefix_lens),
                     start_loc=torch.tensor(starts), seq_lens_cpu=seq_lens, prefix_lens_cpu=prefix_lens)
    return ForwardBatch(forward_mode=E, batch_size=len(seq_lens), input_ids=torch.arange(n),
                        req_pool_indices=torch.arange(1, len(seq_lens) + 1), seq_lens=torch.tensor(total),
                        out_cache_loc=torch.arange(n) + 1000, positions=torch.arange(n), seq_lens_cpu=total,
                        seq_lens_sum=sum(total), extend=ext)


def test_every_forward_batch_field_has_a_split_rule():
    check_field_rules()
    assert set(FIELD_RULES) == {f.name for f in dataclasses.fields(ForwardBatch)}


def test_a_planted_field_without_a_rule_fails_the_guard():
    @dataclasses.dataclass
    class Planted(ForwardBatch):
        new_per_token_field: torch.Tensor | None = None

    with pytest.raises(TypeError, match="new_per_token_field"):
        check_field_rules(Planted)
    fb = _decode_batch(4)
    planted = Planted(**{f.name: getattr(fb, f.name) for f in dataclasses.fields(ForwardBatch)})
    with pytest.raises(TypeError, match="new_per_token_field"):
        split_forward_batch(planted, TboSplit(2, 2, False))


def test_decode_children_slice_rows_and_reset_the_plan_marker():
    fb = _decode_batch(5)
    fb.mark_forward_metadata_ready()
    a, b = split_forward_batch(fb, plan_split(fb))
    assert (a.batch_size, b.batch_size) == (2, 3)
    assert a.input_ids.tolist() == [100, 101] and b.input_ids.tolist() == [102, 103, 104]
    assert b.req_pool_indices.tolist() == [3, 4, 5] and b.seq_lens_cpu == [12, 13, 14]
    assert b.seq_lens_sum == 39 and b.out_cache_loc.tolist() == [52, 53, 54]
    for child in (a, b):
        assert child.needs_forward_metadata_init() and child.forward_metadata_planned_bs is None
        assert child.sampling_info is None and child.tbo_children is None
    # Views of the parent's buffers: a graph replay writes the parent's, the children read them.
    assert b.seq_lens.data_ptr() == fb.seq_lens[2:].data_ptr()


def test_two_chunk_children_share_the_cut_request():
    fb = _extend_batch([10, 20, 30, 500, 40], [0, 5, 0, 7, 0])
    split = plan_split(fb)
    assert split == TboSplit(seq_index=3, token_index=300, two_chunk=True)
    a, b = split_forward_batch(fb, split)
    assert a.extend.seq_lens_cpu == [10, 20, 30, 240] and a.extend.prefix_lens_cpu == [0, 5, 0, 7]
    assert a.seq_lens_cpu == [10, 25, 30, 247] and a.num_tokens == 300
    # Child B's first request continues where A stopped: A's 240 tokens are its cached prefix.
    assert b.extend.seq_lens_cpu == [260, 40] and b.extend.prefix_lens_cpu == [247, 0]
    assert b.seq_lens_cpu == [507, 40] and b.extend.start_loc.tolist() == [0, 260]
    assert a.req_pool_indices.tolist() == [1, 2, 3, 4] and b.req_pool_indices.tolist() == [4, 5]
    assert b.positions[0].item() == 300 and b.num_tokens == 300


def test_no_split_without_communication_or_below_the_row_bar():
    fb = _decode_batch(400)
    assert choose_split(fb, has_communication=False, min_tokens=1) is None
    assert choose_split(fb, has_communication=True, min_tokens=201) is None
    assert choose_split(fb, has_communication=True, min_tokens=200) == TboSplit(200, 200, False)


def test_tbo_backend_plans_each_child_for_its_own_rows():
    pool = ReqToTokenPool(8, 64, "cpu")
    kv = MHATokenToKVPool(256, torch.float32, 1, 1, 4, "cpu")
    children = (PlanCheckingBackend(TorchNativeAttnBackend(pool, kv)),
                PlanCheckingBackend(TorchNativeAttnBackend(pool, kv)))
    tbo = TboAttnBackend(TorchNativeAttnBackend(pool, kv), children,
                         lambda fb: choose_split(fb, has_communication=True, min_tokens=1))
    fb = _extend_batch([3, 2, 4], [0, 1, 0])
    tbo.init_forward_metadata(fb)
    assert fb.tbo_children is not None and tbo.split_counts == {"EXTEND": 1}
    for child, backend in zip(fb.tbo_children, children, strict=True):
        assert child.attn_backend is backend
        assert backend._plan_shape == (child.batch_size, child.num_tokens)
    assert [c.num_tokens for c in fb.tbo_children] == [4, 5]  # two-chunk: 9 // 2 tokens in A


def test_two_batch_overlap_is_accepted_with_dp_attention(tiny_model_dir):
    cfg = EngineConfig(model=str(tiny_model_dir("llama")), tp_size=2, dp_size=2, enable_dp_attention=True,
                       enable_two_batch_overlap=True)
    assert cfg.enable_two_batch_overlap and cfg.enable_dp_attention


GREEDY = {"temperature": 0.0, "max_new_tokens": 12}


def test_one_rank_never_splits(tiny_model_dir):
    """Nothing to hide on one rank: the batch always runs whole."""
    with make_engine(tiny_model_dir("llama"), enable_two_batch_overlap=True, tbo_min_split_tokens=1) as engine:
        engine.generate(prompt_ids(4), GREEDY)
        assert not engine.runner.attn_backend.split_counts


def test_tp2_tokens_equal_with_two_batch_overlap_on_and_off(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    path = tiny_model_dir("llama")
    prompts = prompt_ids(6)
    # TBO off at tp 2 gives one rank's tokens (tests/distributed/test_tensor_parallel.py): so must on.
    reference = single_rank_outputs(path, prompts, GREEDY)
    expected = [reference[tuple(p)] for p in prompts]
    with make_engine(path, enable_two_batch_overlap=True, tbo_min_split_tokens=1, chunked_prefill_size=24,
                     tp_size=2, dist_timeout=60) as engine:
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
        # Again: radix-cached prefixes, so the children's extends start after cached tokens.
        again = engine.generate(prompts, GREEDY)
        assert [o.token_ids for o in again] == expected
        assert sum(o.meta_info["cached_tokens"] for o in again) > 0
        tbo = engine.runner.attn_backend
        tbo = getattr(tbo, "inner", tbo)
        assert tbo.split_counts["EXTEND"] > 0 and tbo.split_counts["DECODE"] > 0
        assert_no_leaks(engine)


def test_tp2_graph_replays_run_the_split_decode(one_layer, monkeypatch):
    """Graphs capture the two-micro-batch decode; each replay plans the children of its padded view.
    Triton attention (the backend that runs under graphs) in the interpreter: one layer, few steps."""
    prompts = [p[:6] for p in prompt_ids(3)]
    params = {"temperature": 0.0, "max_new_tokens": 4}
    expected = single_rank_outputs(one_layer, prompts, params)
    monkeypatch.setenv("PLAIT_CPU_GRAPHS", "1")  # inherited by the spawned rank
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(one_layer, tp_size=2, dist_timeout=60, attention_backend="triton", cuda_graph_max_bs=4,
                     enable_two_batch_overlap=True, tbo_min_split_tokens=1) as engine:
        graphs = engine.runner.graph_runner
        assert graphs is not None and graphs.capture_batches[4].tbo_children is not None
        outs = engine.generate(prompts, params)
        assert {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)} == expected
        assert sum(g.replays for g in graphs.graphs.values()) > 0
        assert_no_leaks(engine)


def test_verify_children_carry_their_own_trees_and_mask_blocks():
    from plait.speculative.tree import DraftTree
    from plait.speculative.verify_batch import DraftRow, build_verify_batch

    rows = [DraftRow(kv_len=k, req_pool_idx=i + 1) for i, k in enumerate([3, 5, 2, 4])]
    trees = [DraftTree([7, 8, 9], [-1, 0, 0]), DraftTree([1, 2], [-1, 0]), DraftTree([4, 5, 6, 3], [-1, 0, 1, 1]),
             DraftTree([6], [-1])]
    fb = build_verify_batch(rows, trees, torch.arange(10) + 1, "cpu")
    split = plan_split(fb)
    assert split == TboSplit(seq_index=2, token_index=5, two_chunk=False)
    a, b = split_forward_batch(fb, split)
    for child, lo, hi in ((a, 0, 2), (b, 2, 4)):
        first, last = sum(t.width for t in trees[:lo]), sum(t.width for t in trees[:hi])
        alone = build_verify_batch(rows[lo:hi], trees[lo:hi], fb.out_cache_loc[first:last], "cpu")
        assert torch.equal(child.spec_info.custom_mask, alone.spec_info.custom_mask)
        assert child.spec_info.num_tokens_per_req == alone.spec_info.num_tokens_per_req
        assert child.spec_info.trees == trees[lo:hi]
        assert child.positions.tolist() == alone.positions.tolist()


def test_tp2_speculative_verify_splits_and_keeps_greedy_tokens(tiny_model_dir, monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    path = tiny_model_dir("llama")
    prompts = prompt_ids(6)
    expected = single_rank_outputs(path, prompts, GREEDY)
    ngram = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1,
             "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}
    with make_engine(path, tp_size=2, dist_timeout=60, enable_two_batch_overlap=True, tbo_min_split_tokens=1,
                     **ngram) as engine:
        for _ in range(2):  # the second pass drafts from the first one's answers
            outs = engine.generate(prompts, GREEDY)
            assert {tuple(p): o.token_ids for p, o in zip(prompts, outs, strict=True)} == expected
        tbo = engine.runner.attn_backend
        assert getattr(tbo, "inner", tbo).split_counts["TARGET_VERIFY"] > 0
        assert_no_leaks(engine)
