"""Speculative decoding with DP attention (tp = dp = 2: each rank schedules, drafts and verifies its own
requests; a round's verify forwards meet at the sharded MLP, a rank with nothing to verify joins them
with an IDLE batch) and with plain dp 2 replicas (each replica has its own speculative worker). Greedy
output equals one rank's non-speculative output, with mixed prompt lengths, chunked prefill, radix
hits and retraction; no KV slot is left in use on any rank."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from plait import envs
from plait.config import EngineConfig
from plait.executor.verify_graph_runner import VerifyGraphRunner
from plait.forward_batch import DPPaddingMode, ExtendInfo, ForwardBatch, ForwardMode
from plait.parallel.dp_attention import DPAttentionScheduler, IdleSpecInput, MLPCountSync, RankCounts
from plait.testing import make_eagle_head, make_tiny_model
from tests.helpers import (
    TwoRankControl,
    assert_no_leaks_on_every_dp_rank,
    make_engine,
    prompt_ids,
    single_rank_outputs,
)

GREEDY = {"temperature": 0.0, "max_new_tokens": 10}
PROMPTS = prompt_ids(5)  # 3 to 20 tokens: several prefill chunks of 16 for the longest
DP_ATTENTION = {"tp_size": 2, "dp_size": 2, "enable_dp_attention": True, "dist_timeout": 60,
                "chunked_prefill_size": 16}
REPLICAS = {"dp_size": 2, "chunked_prefill_size": 16}
LAYOUTS = {"dp_attention": DP_ATTENTION, "replicas": REPLICAS}
NGRAM_CHAIN = {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1}
NGRAM_CHAIN_WIDTH = 4  # NGRAM's default speculative_num_draft_tokens: DP attention pads verify blocks to it
NGRAM_TREE = {**NGRAM_CHAIN, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6}
DRAFT_TREE = {"speculative_num_steps": 2, "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 4}
DRAFT_CHAIN = {"speculative_num_steps": 3, "speculative_eagle_topk": 1, "speculative_num_draft_tokens": 4}


@pytest.fixture(scope="module")
def target(tiny_model_dir):
    return tiny_model_dir("llama")


def _one_rank(path) -> list[list[int]]:
    out = single_rank_outputs(path, PROMPTS, GREEDY)
    return [out[tuple(p)] for p in PROMPTS]


@pytest.fixture(scope="module")
def reference(target):
    return _one_rank(target)


@pytest.fixture(scope="module")
def three_layers(tmp_path_factory):
    """EAGLE3 captures target layers [2, L // 2, L - 3]: it needs at least three."""
    return make_tiny_model(tmp_path_factory.mktemp("three_layers"), "llama", seed=0, num_hidden_layers=3)


@pytest.fixture(scope="module")
def three_layer_reference(three_layers):
    return _one_rank(three_layers)


def _spec_stats(engine):
    return engine.scheduler.spec_worker.stats


def _check_no_leaks(engine) -> None:
    sched = engine.scheduler
    if isinstance(sched, DPAttentionScheduler):
        assert_no_leaks_on_every_dp_rank(engine)
        return
    assert not sched.has_work()
    for i, (rs, rr) in enumerate(zip(sched.replicas, engine.runner.replicas, strict=True)):
        assert rs.kv_tokens_in_use() == 0, f"replica {i}: KV slots leaked"
        assert rs.tree_cache.protected_size() == 0, f"replica {i}: prefix-cache nodes still locked"
        assert rr.req_to_token_pool.available_size() == rr.req_to_token_pool.size, f"replica {i}: rows leaked"


def _check_every_rank_speculated(engine) -> None:
    if isinstance(engine.scheduler, DPAttentionScheduler):
        spec_rounds = list(engine.runner.count_sync.spec_rounds)  # requests verified per rank
        assert any(min(counts) > 0 for counts in spec_rounds), "both ranks verify in one round"
        assert engine.runner.phase_forwards["SPEC"] > 0
    else:
        assert all(s.spec_worker.stats.verify_steps > 0 for s in engine.scheduler.replicas)


def _check(engine, reference, again: bool = True) -> None:
    first = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in first] == reference
    if again:  # radix-cache hits; n-gram drafts from the first answers
        assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == reference
    assert _spec_stats(engine).verify_steps > 0
    _check_every_rank_speculated(engine)
    _check_no_leaks(engine)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ngram_chain_with_retraction_keeps_greedy_output_exact(target, reference, layout, monkeypatch):
    """A small KV pool: requests are retracted and re-prefilled (their drafts and trees rebuilt)."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(target, **LAYOUTS[layout], **NGRAM_CHAIN, max_total_tokens=32) as engine:
        _check(engine, reference)
        assert engine.scheduler.stats.num_retractions > 0
        assert sum(n for k, n in _spec_stats(engine).accept_histogram.items() if k > 0) > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_ngram_tree_keeps_greedy_output_exact(target, reference, layout, monkeypatch):
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    with make_engine(target, **LAYOUTS[layout], **NGRAM_TREE) as engine:
        _check(engine, reference)
        assert sum(n for k, n in _spec_stats(engine).accept_histogram.items() if k > 0) > 0


@pytest.mark.parametrize("layout", LAYOUTS)
def test_standalone_keeps_greedy_output_exact(target, reference, tmp_path, layout, monkeypatch):
    """Each rank (replica) runs its own replicated draft model over its own KV pool."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    draft = make_tiny_model(tmp_path / "draft", "llama", seed=1, num_hidden_layers=1)
    flags = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(draft), **DRAFT_TREE}
    with make_engine(target, **LAYOUTS[layout], **flags) as engine:
        _check(engine, reference, again=False)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("fmt", "shape"), [("EAGLE", DRAFT_CHAIN), ("EAGLE3", DRAFT_TREE)], ids=["EAGLE", "EAGLE3"])
def test_eagle_keeps_greedy_output_exact(three_layers, three_layer_reference, tmp_path, layout, fmt, shape,
                                         monkeypatch):
    """Each rank's head reads the target's whole embedding and LM head (whole under DP attention)."""
    monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    head = make_eagle_head(tmp_path / fmt, three_layers, fmt)
    flags = {"speculative_algorithm": fmt, "speculative_draft_model_path": str(head), **shape}
    with make_engine(three_layers, **LAYOUTS[layout], **flags) as engine:
        _check(engine, three_layer_reference, again=False)


@pytest.fixture(scope="module")
def graph_engine(target):
    """DP attention with graphs (``PLAIT_CPU_GRAPHS=1``: the eager stand-in records the capture and
    re-runs it, collectives included; the Triton backend, the one that runs under graphs)."""
    pytest.importorskip("triton")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_CPU_GRAPHS", "1")  # inherited by the spawned rank
        engine = make_engine(target, **DP_ATTENTION, **NGRAM_CHAIN, attention_backend="triton",
                             cuda_graph_max_bs=2)
    yield engine
    engine.shutdown()


def _verify_replays(engine) -> int:
    return sum(g.replays for g in engine.runner.verify_graph_runner.graphs.values())


@pytest.mark.skipif(not envs.SLOW_TESTS.get(),
                    reason="about 5 minutes (graph capture in the Triton interpreter): PLAIT_SLOW_TESTS=1 runs it")
def test_dp_attention_verify_rounds_replay_graphs_every_rank_alike(graph_engine, reference):
    """Verify graphs are captured at the one padded width as MAX_LEN steps of their bucket; a SPEC
    phase whose largest per-rank request count fits a bucket replays on every rank, a rank with
    nothing to verify on padding requests only (rank 0 here, once its one-token request is done)."""
    graphs = graph_engine.runner.verify_graph_runner
    assert graphs.widths == [NGRAM_CHAIN_WIDTH]
    captured = graphs.capture_batches[(NGRAM_CHAIN_WIDTH, graphs.max_bs)]
    assert captured.mlp_sync.original_global_num_tokens_cpu == [graphs.max_bs] * 2  # requests
    assert captured.mlp_sync.global_num_tokens_cpu == [graphs.max_bs * NGRAM_CHAIN_WIDTH] * 2  # tokens
    params = [{**GREEDY, "max_new_tokens": 1}, GREEDY]
    prompts = [PROMPTS[0], PROMPTS[2]]
    expected = [reference[0][:1], reference[2]]
    graph_engine.generate(prompts, params)  # fills rank 1's n-gram cache with the answer
    idle_before, replays = graph_engine.runner.idle_rounds, _verify_replays(graph_engine)
    assert [o.token_ids for o in graph_engine.generate(prompts, params)] == expected
    assert graph_engine.runner.idle_rounds > idle_before
    assert _verify_replays(graph_engine) > replays  # rank 0 joined rank 1's verify graphs idle
    _check_no_leaks(graph_engine)


def test_config_accepts_speculation_with_dp_attention_and_with_replicas():
    for layout in LAYOUTS.values():
        cfg = EngineConfig.from_kwargs(model="m", **layout, **NGRAM_CHAIN)
        assert cfg.speculative_algorithm == "NGRAM" and cfg.dp_size == 2


# --- the count exchange and the graph decision, without an engine ------------------------------------
@dataclass
class Verify:
    num_tokens_per_req: int | list[int]
    custom_mask: torch.Tensor


def _verify_batch(bs: int, width: int) -> ForwardBatch:
    t = bs * width
    lens = torch.full((bs,), width)
    return ForwardBatch(forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=torch.arange(t),
                        req_pool_indices=torch.arange(bs) + 1, seq_lens=lens + 5, out_cache_loc=torch.arange(t) + 10,
                        positions=torch.arange(t), seq_lens_cpu=[5 + width] * bs, seq_lens_sum=(5 + width) * bs,
                        extend=ExtendInfo(t, lens, torch.full((bs,), 5), torch.arange(bs) * width, [width] * bs,
                                          [5] * bs),
                        spec_info=Verify(width, torch.ones(t * (5 + width), dtype=torch.bool)))


def _idle_batch(width: int) -> ForwardBatch:
    empty = torch.empty(0, dtype=torch.int64)
    return ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=empty, req_pool_indices=empty,
                        seq_lens=empty, out_cache_loc=empty, positions=empty,
                        spec_info=IdleSpecInput(width, torch.empty(0, dtype=torch.bool)))


def test_a_verify_phase_exchanges_requests_and_pads_like_a_decode():
    """Requests per rank go through init_mlp_sync_metadata, which scales them by the width; a verify
    round is not a prefill, so balanced counts pad MAX_LEN (and may replay graphs)."""
    fb = _verify_batch(3, 4)
    MLPCountSync(TwoRankControl(RankCounts(2, 8, 4, False)), "cpu", None).sync(fb)
    assert fb.mlp_sync.original_global_num_tokens_cpu == [3, 2]  # requests
    assert fb.mlp_sync.global_num_tokens_cpu == [12, 8]  # tokens
    assert fb.mlp_sync.padding_mode == DPPaddingMode.MAX_LEN and fb.mlp_sync.can_run_dp_cuda_graph


def test_an_idle_rank_of_a_verify_phase_scales_the_others_counts_alike():
    fb = _idle_batch(4)
    MLPCountSync(TwoRankControl(RankCounts(3, 12, 4, False)), "cpu", None).sync(fb)
    assert fb.mlp_sync.original_global_num_tokens_cpu == [0, 3]
    assert fb.mlp_sync.global_num_tokens_cpu == [0, 12]


def test_ranks_in_different_phases_fail_loudly_instead_of_hanging():
    fb = _verify_batch(2, 4)
    other_prefills = RankCounts(1, 9, 0, True)
    with pytest.raises(RuntimeError, match="request widths"):
        MLPCountSync(TwoRankControl(other_prefills), "cpu", None).sync(fb)


def test_dp_verify_graph_eligibility_reads_the_raw_request_counts():
    """The verify graph runner decides from the DP graph batch size (the largest rank's requests),
    the same helper replay pads with; an idle rank of the round decides alike."""
    runner = VerifyGraphRunner.__new__(VerifyGraphRunner)  # only the decision: no captured graphs
    runner.max_bs, runner.batch_sizes, runner.widths, runner.pad = 4, [1, 2, 4], [4], True
    fb = _verify_batch(3, 4)
    MLPCountSync(TwoRankControl(RankCounts(4, 16, 4, False)), "cpu", None).sync(fb)
    assert fb.mlp_sync.global_num_tokens_cpu == [12, 16]  # 16 tokens, but 4 requests: within max_bs
    assert runner.can_run(fb)
    idle = _idle_batch(4)
    MLPCountSync(TwoRankControl(RankCounts(4, 16, 4, False)), "cpu", None).sync(idle)
    assert runner.can_run(idle)
    big = _verify_batch(3, 4)
    MLPCountSync(TwoRankControl(RankCounts(5, 20, 4, False)), "cpu", None).sync(big)
    assert not runner.can_run(big)  # another rank is past the largest bucket: every rank runs eagerly
    fb.mlp_sync.can_run_dp_cuda_graph = False  # a SUM_LEN round
    assert not runner.can_run(fb)
