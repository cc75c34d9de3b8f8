"""DP attention with decode graphs, real processes over gloo. ``PLAIT_CPU_GRAPHS=1`` builds the graph
runners over the eager stand-in, which records the capture (MLP-sync metadata of a MAX_LEN step of
the bucket on every rank) and re-runs it on replay, collectives included. Every MAX_LEN round whose
largest per-rank count fits a bucket replays on every rank, an idle rank on padding rows only; the
rest run eagerly; greedy output equals a single rank's. Attention is the Triton backend (the one that
runs under graphs) under the interpreter."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from plait.forward_batch import DPPaddingMode  # noqa: E402
from tests.helpers import make_engine, prompt_ids, single_rank_outputs  # noqa: E402

GREEDY8 = {"temperature": 0.0, "max_new_tokens": 8}
PROMPTS = prompt_ids(12, seed=1)
MAX_BS = 4  # graph buckets 1, 2, 4: six requests per rank start above them


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference(model):
    return single_rank_outputs(model, PROMPTS, GREEDY8)


@pytest.fixture(scope="module")
def engine(model):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_CPU_GRAPHS", "1")  # inherited by the spawned rank
        engine = make_engine(model, tp_size=2, dp_size=2, enable_dp_attention=True, dist_timeout=60,
                             attention_backend="triton", cuda_graph_max_bs=MAX_BS)
    yield engine
    engine.shutdown()


def _replays(engine) -> int:
    return sum(g.replays for g in engine.runner.graph_runner.graphs.values())


def _graph_rounds(engine, before: int) -> int:
    """Rounds since ``before`` that every rank ran as a graph replay."""
    max_bs = engine.runner.graph_runner.max_bs
    return sum(1 for counts, _, mode in list(engine.runner.rounds)[before:]
               if mode == DPPaddingMode.MAX_LEN and max(counts) <= max_bs)


def test_dp_attention_engine_captures_decode_graphs(engine):
    graphs = engine.runner.graph_runner
    assert graphs is not None and graphs.batch_sizes[-1] == graphs.max_bs
    captured = graphs.capture_batches[graphs.max_bs]
    assert captured.mlp_sync.padding_mode == DPPaddingMode.MAX_LEN
    assert captured.mlp_sync.global_num_tokens_cpu == [graphs.max_bs, graphs.max_bs]


def test_mixed_lengths_replay_when_counts_fit_a_bucket_and_match_a_single_rank(engine, reference):
    """12 requests (6 per rank, above the largest bucket) finishing after 1..8 tokens: the first
    decode rounds run eagerly, the later ones replay."""
    lengths = [1 + i % 8 for i in range(len(PROMPTS))]
    before, replays = len(engine.runner.rounds), _replays(engine)
    outs = engine.generate(PROMPTS, [{"temperature": 0.0, "max_new_tokens": n} for n in lengths])
    assert [o.token_ids for o in outs] == [reference[tuple(p)][:n] for p, n in zip(PROMPTS, lengths, strict=True)]
    rounds = list(engine.runner.rounds)[before:]
    assert any(mode == DPPaddingMode.MAX_LEN and max(c) > engine.runner.graph_runner.max_bs for c, _, mode in rounds)
    assert _graph_rounds(engine, before) > 0
    assert _replays(engine) - replays == _graph_rounds(engine, before)
    assert engine.scheduler.kv_tokens_in_use() == 0


def test_idle_rank_replays_padding_rows_while_the_other_decodes(engine, reference):
    """Rank 0's request finishes after one token; rank 1 decodes on, and rank 0 joins each of its
    decode rounds by replaying the same bucket with no live rows."""
    idle_before, before, replays = engine.runner.idle_rounds, len(engine.runner.rounds), _replays(engine)
    short, long = engine.generate(PROMPTS[:2], [{"temperature": 0.0, "max_new_tokens": 1}, GREEDY8])
    assert short.token_ids == reference[tuple(PROMPTS[0])][:1]
    assert long.token_ids == reference[tuple(PROMPTS[1])]
    assert engine.runner.idle_rounds - idle_before >= 5
    assert _replays(engine) - replays == _graph_rounds(engine, before) >= 5
