"""Two-batch overlap under DP attention (tp = dp = 2, real processes over gloo): every rank splits its
own batch, the split is decided from the exchanged counts so every rank splits alike (an IDLE rank, or
a rank whose batch is too small to split, joins with empty halves), and each micro-batch's MLP gather
and reduce-scatter run while the other computes. Greedy tokens equal those with overlap off (DP
attention with overlap off equals one rank: tests/distributed/test_dp_attention.py), with
PLAIT_CHECK_PLANS=1 and no KV slot left in use on any rank."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from plait.distributed.dp_mlp import dp_mlp_ops
from plait.distributed.parallel_state import PendingReduce
from plait.forward_batch import DPPaddingMode, ForwardBatch, ForwardMode
from plait.layers.overlap import run_overlapped
from plait.parallel.dp_attention import IdleSpecInput, MLPCountSync, RankCounts, TboSettings
from plait.testing import make_eagle_head, make_tiny_model
from plait.two_batch_overlap import TboSplit, choose_dp_split, split_forward_batch
from tests.helpers import (
    TwoRankControl,
    assert_no_leaks_on_every_dp_rank,
    make_engine,
    prompt_ids,
    single_rank_outputs,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 8}
PROMPTS = prompt_ids(6)  # 3 to 31 tokens: prefill chunks of 16, two-chunk cuts inside a request
DP_TBO = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "dist_timeout": 60, "chunked_prefill_size": 16,
          "enable_two_batch_overlap": True, "tbo_min_split_tokens": 1}


def _split_counts(engine):
    backend = engine.runner.attn_backend
    return getattr(backend, "inner", backend).split_counts  # under PLAIT_CHECK_PLANS: the checker's inner


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    return single_rank_outputs(model, PROMPTS, GREEDY)


@pytest.fixture(scope="module")
def engine(model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_CHECK_PLANS", "1")  # inherited by the spawned rank
        engine = make_engine(model, **DP_TBO)
        yield engine
        engine.shutdown()


def test_decode_and_chunked_prefill_split_on_every_rank_and_keep_greedy_tokens(engine, reference):
    before = len(engine.runner.count_sync.split_rounds)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS]
    counts = _split_counts(engine)
    assert counts["EXTEND"] > 0 and counts["DECODE"] > 0
    rounds = list(engine.runner.count_sync.split_rounds)[before:]
    assert any(min(a) > 0 and min(b) > 0 for a, b in rounds), "both ranks split their own batch"
    assert_no_leaks_on_every_dp_rank(engine)


def test_an_idle_rank_joins_the_other_ranks_two_micro_batches(engine, reference):
    """Requests alternate between the ranks: rank 0's finish after one token, rank 1 decodes two on,
    split in two, while rank 0 joins both micro-batches' collectives with IDLE halves."""
    params = [{**GREEDY, "max_new_tokens": 1}, GREEDY] * 2
    prompts = PROMPTS[:4]
    idle_before, before = engine.runner.idle_rounds, len(engine.runner.count_sync.split_rounds)
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [reference[tuple(p)][: q["max_new_tokens"]]
                                           for p, q in zip(prompts, params, strict=True)]
    assert engine.runner.idle_rounds > idle_before
    rounds = list(engine.runner.count_sync.split_rounds)[before:]
    assert sum(1 for a, b in rounds if a[0] == b[0] == 0 and min(a[1], b[1]) > 0) >= 3
    assert_no_leaks_on_every_dp_rank(engine)


def test_a_rank_with_one_request_joins_the_second_micro_batch_with_an_idle_half(engine, reference):
    """Three requests: rank 0 decodes two (one per micro-batch), rank 1 one, all in its child A; its
    child B is IDLE and joins B's collectives on zero rows."""
    prompts = PROMPTS[:3]
    before = len(engine.runner.count_sync.split_rounds)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == [reference[tuple(p)] for p in prompts]
    rounds = list(engine.runner.count_sync.split_rounds)[before:]
    assert sum(1 for a, b in rounds if a == (1, 1) and b == (1, 0)) >= 3
    assert_no_leaks_on_every_dp_rank(engine)


def test_speculative_verify_splits_under_dp_attention_and_keeps_greedy_tokens(model, reference, monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    ngram = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
    with make_engine(model, **DP_TBO, **ngram) as engine:
        for _ in range(2):  # the second pass drafts from the first one's answers
            outs = engine.generate(PROMPTS, GREEDY)
            assert [o.token_ids for o in outs] == [reference[tuple(p)] for p in PROMPTS]
        assert _split_counts(engine)["TARGET_VERIFY"] > 0
        assert engine.scheduler.spec_worker.stats.verify_steps > 0
        assert_no_leaks_on_every_dp_rank(engine)


def test_decode_graphs_capture_two_micro_batches_and_every_rank_replays_them(one_layer, monkeypatch):
    """``PLAIT_CPU_GRAPHS=1``: the eager stand-in records the capture and re-runs it, collectives
    included. Each bucket is captured split as every rank's replay of it splits (the same padded
    batch on every rank); rank 0, idle once its one-token requests finish, replays rank 1's split
    bucket on padding rows. Triton attention (the backend that runs under graphs) in the
    interpreter: one layer, few steps."""
    pytest.importorskip("triton")
    prompts = [p[:6] for p in prompt_ids(4)]
    params = [{"temperature": 0.0, "max_new_tokens": n} for n in (1, 4, 1, 4)]
    expected = single_rank_outputs(one_layer, prompts, {"temperature": 0.0, "max_new_tokens": 4})
    monkeypatch.setenv("PLAIT_CPU_GRAPHS", "1")  # inherited by the spawned rank
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(one_layer, **DP_TBO, attention_backend="triton", cuda_graph_max_bs=2) as engine:
        graphs = engine.runner.graph_runner
        captured = graphs.capture_batches[2]
        assert captured.tbo_children is not None
        assert [m.global_num_tokens_cpu for m in captured.mlp_sync.micro_batches] == [[1, 1], [1, 1]]
        assert graphs.capture_batches[1].tbo_children is None  # one request: nothing to split
        idle_before = engine.runner.idle_rounds
        outs = engine.generate(prompts, params)
        assert [o.token_ids for o in outs] == [expected[tuple(p)][: q["max_new_tokens"]]
                                               for p, q in zip(prompts, params, strict=True)]
        assert graphs.graphs[2].replays > 0
        assert engine.runner.idle_rounds > idle_before
        # Rounds rank 0 joined idle while rank 1 decoded two requests: MAX_LEN, replayed split.
        assert any(counts == (0, 2) and mode == DPPaddingMode.MAX_LEN for counts, _, mode in engine.runner.rounds)
        assert_no_leaks_on_every_dp_rank(engine)


def test_eagle3_tree_verify_splits_with_the_target_hidden_states_captured_whole(tmp_path, monkeypatch):
    """The head reads the target's hidden states of both micro-batches, concatenated in the parent's
    row order (EAGLE3 captures three layers: the target needs three)."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    target = make_tiny_model(tmp_path / "target", "llama", seed=0, num_hidden_layers=3)
    expected = single_rank_outputs(target, PROMPTS, GREEDY)
    head = make_eagle_head(tmp_path / "head", target, "EAGLE3")
    flags = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head), "speculative_num_steps": 2,
             "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4}
    with make_engine(target, **DP_TBO, **flags) as engine:
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == [expected[tuple(p)] for p in PROMPTS]
        assert _split_counts(engine)["TARGET_VERIFY"] > 0
        assert_no_leaks_on_every_dp_rank(engine)


# --- the decision, without an engine -------------------------------------------------------------------
TBO = TboSettings(min_tokens=2, threshold=0.48)


def _decode_batch(bs: int) -> ForwardBatch:
    ids = torch.arange(bs, dtype=torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=ids, req_pool_indices=ids + 1,
                        seq_lens=ids + 5, out_cache_loc=ids + 20, positions=ids + 4, seq_lens_cpu=(ids + 5).tolist(),
                        seq_lens_sum=int((ids + 5).sum()))


def _idle_batch(spec_info=None) -> ForwardBatch:
    empty = torch.empty(0, dtype=torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=empty, req_pool_indices=empty,
                        seq_lens=empty, out_cache_loc=empty, positions=empty, spec_info=spec_info)


def _sync(fb: ForwardBatch, other: RankCounts, tbo: TboSettings | None = TBO) -> MLPCountSync:
    sync = MLPCountSync(TwoRankControl(other), "cpu", None, tbo)
    sync.sync(fb)
    return sync


def test_the_micro_batches_counts_are_every_ranks_halves():
    fb = _decode_batch(3)
    _sync(fb, RankCounts(5, 5, 0, False, (2, 2, 3, 3)))
    a, b = fb.mlp_sync.micro_batches
    assert (a.global_num_tokens_cpu, b.global_num_tokens_cpu) == ([1, 2], [2, 3])
    assert a.padding_mode == b.padding_mode == DPPaddingMode.MAX_LEN and not a.can_run_dp_cuda_graph
    children = split_forward_batch(fb, choose_dp_split(fb))
    assert [c.mlp_sync for c in children] == [a, b]
    assert [c.num_tokens for c in children] == [1, 2]


def test_a_batch_too_small_to_split_gets_an_idle_half():
    fb = _decode_batch(1)
    _sync(fb, RankCounts(4, 4, 0, False, (2, 2, 2, 2)))
    a, b = fb.mlp_sync.micro_batches
    assert (a.global_num_tokens_cpu, b.global_num_tokens_cpu) == ([1, 2], [0, 2])
    split = choose_dp_split(fb)
    assert split == TboSplit(1, 1, False)
    whole, empty = split_forward_batch(fb, split)
    assert whole.forward_mode == ForwardMode.DECODE and whole.num_tokens == 1
    assert empty.forward_mode == ForwardMode.IDLE and empty.num_tokens == 0 and empty.batch_size == 0
    assert empty.spec_info is None and empty.extend is None


def test_an_idle_rank_proposes_two_empty_halves_and_follows_the_split():
    fb = _idle_batch()
    _sync(fb, RankCounts(4, 4, 0, False, (2, 2, 2, 2)))
    a, b = fb.mlp_sync.micro_batches
    assert (a.global_num_tokens_cpu, b.global_num_tokens_cpu) == ([0, 2], [0, 2])
    assert all(c.forward_mode == ForwardMode.IDLE for c in split_forward_batch(fb, choose_dp_split(fb)))


def test_no_rank_splits_when_the_gathered_halves_do_not_pay():
    fb = _decode_batch(2)
    _sync(fb, RankCounts(0, 0, 0, False, (0, 0, 0, 0)))  # halves of 1 + 0 rows: under the bar of 2
    assert fb.mlp_sync.micro_batches is None and choose_dp_split(fb) is None


def test_no_rank_splits_when_one_rank_cannot():
    @dataclass
    class Unsplittable:  # a spec input without split()
        num_tokens_per_req: int
        custom_mask: torch.Tensor

    fb = _idle_batch(IdleSpecInput(4, torch.empty(0, dtype=torch.bool)))
    _sync(fb, RankCounts(3, 12, 4, False, None))  # the other rank's verify input cannot split
    assert fb.mlp_sync.micro_batches is None
    spec = _decode_batch(2)
    spec.spec_info = Unsplittable(1, torch.ones(2, dtype=torch.bool))
    _sync(spec, RankCounts(2, 2, 1, False, (1, 1, 1, 1)))
    assert spec.mlp_sync.micro_batches is None


def test_overlap_off_proposes_nothing():
    fb = _decode_batch(4)
    _sync(fb, RankCounts(4, 4, 0, False, None), tbo=None)
    assert fb.mlp_sync.micro_batches is None


# --- the overlap itself: one micro-batch's exchange in flight while the other computes ------------------
class RecordingGroup:
    """Rank 0 of two whose collectives complete on ``wait()`` and log when they start and end."""

    rank, size = 0, 2

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def _pending(self, name: str, result: torch.Tensor) -> PendingReduce:
        self.log.append(f"start {name}")
        log = self.log

        class Work:
            def wait(self) -> None:
                log.append(f"end {name}")

        return PendingReduce(result, Work())

    def all_gather_rows_start(self, x: torch.Tensor, counts: list[int]) -> PendingReduce:
        return self._pending(f"gather {x.shape[0]}", torch.cat([x, torch.zeros(counts[1], x.shape[1])]))

    def reduce_scatter_rows_start(self, x: torch.Tensor, counts: list[int]) -> PendingReduce:
        return self._pending(f"reduce-scatter {counts[0]}", x)


class RecordingMLP:
    def __init__(self, log: list[str]) -> None:
        self.log = log

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(f"mlp {x.shape[0]}")
        return x * 2

    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced


def test_each_micro_batch_computes_while_the_others_exchange_is_in_flight():
    """Two micro-batches of 1 and 2 rows (SUM_LEN halves): B's gather starts before A's ends, A's MLP
    runs while B's gather is in flight, and B's MLP while A's reduce-scatter is."""
    log: list[str] = []
    halves = []
    for rows in (1, 2):
        fb = _decode_batch(rows)
        fb.mlp_sync.fill([rows, 3], [rows, 3], [rows, 3], False, "cpu")
        fb.mlp_sync.padding_mode = DPPaddingMode.SUM_LEN
        halves.append(fb)
    hidden = [torch.ones(1, 4), torch.ones(2, 4)]
    out_a, out_b = run_overlapped(*(dp_mlp_ops(RecordingMLP(log), h, fb, RecordingGroup(log))
                                    for h, fb in zip(hidden, halves, strict=True)))
    assert log == ["start gather 1", "start gather 2", "end gather 1", "mlp 4", "start reduce-scatter 1",
                   "end gather 2", "mlp 5", "start reduce-scatter 2", "end reduce-scatter 1", "end reduce-scatter 2"]
    assert out_a.shape == (1, 4) and out_b.shape == (2, 4) and torch.equal(out_a, 2 * torch.ones(1, 4))
