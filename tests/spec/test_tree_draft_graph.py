"""The top-k tree expansion (topk > 1) captured per (steps, batch bucket) on the CPU: EagerGraph
stand-in (replay re-runs the recorded function over the static buffers), Triton draft backends under
the interpreter, PLAIT_CHECK_PLANS on (tests/spec/conftest.py). A replay expands exactly what the
eager expansion expands, the engine's greedy output stays exact, and every KV slot is free after."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from plait.attention.plan_check import PlanCheckingBackend  # noqa: E402
from plait.executor.graph_utils import EagerGraph  # noqa: E402
from plait.testing import (
    make_eagle_head,  # noqa: E402
    make_tiny_model,  # noqa: E402
)
from tests.helpers import assert_no_leaks, make_engine, prompt_ids  # noqa: E402

PROMPTS = prompt_ids(3)  # prefixes of 3, 7 and 12 tokens
SHORT = {"temperature": 0.0, "max_new_tokens": 6}
MAX_BS = 4  # buckets 1, 2, 4: three requests pad to 4


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    # EAGLE3 captures target layers [2, L//2, L-3]: the shortest target it accepts has 3 layers.
    return make_tiny_model(tmp_path_factory.mktemp("three_layers"), "llama", seed=0, num_hidden_layers=3)


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A STANDALONE draft with other weights than the target (the trees branch on its guesses)."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=1)


def _spec(algo: str, topk: int, target, draft, tmp_path) -> dict:
    path = draft if algo == "STANDALONE" else make_eagle_head(tmp_path / algo, target, algo)
    return {"speculative_algorithm": algo, "speculative_draft_model_path": str(path), "speculative_num_steps": 2,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": 5}


def _engine_with_tree_graphs(target, spec: dict):
    engine = make_engine(target, attention_backend="triton", max_total_tokens=1024, **spec)
    worker = engine.scheduler.spec_worker
    assert worker.tree_graphs is None  # not on a GPU: the test installs what a GPU engine builds
    worker.tree_graphs = worker.build_tree_graphs(MAX_BS, EagerGraph)
    return engine, worker


def _replays(worker) -> int:
    return sum(g.replays for g in worker.tree_graphs.graphs.values())


def test_capture_plans_and_marks_every_step_on_its_own_checked_child(target, draft, tmp_path):
    _, worker = _engine_with_tree_graphs(target, _spec("STANDALONE", 2, target, draft, tmp_path))
    graphs = worker.tree_graphs
    assert sorted(graphs.capture_batches) == [(k, b) for k in (1, 2) for b in (1, 2, 4)]
    children = worker.decode_backend.children
    for (k, bs), batches in graphs.capture_batches.items():
        assert len(batches) == k
        for s, fb in enumerate(batches):
            assert fb.attn_backend is children[s] and isinstance(children[s], PlanCheckingBackend)
            assert fb.attn_backend.name == "triton"
            assert fb.forward_metadata_ready and fb.forward_metadata_planned_bs == bs
            assert fb.num_tokens == bs * (1 + s * 2)  # w_s nodes per request: the static node layout


def _compare_expansions(worker, bucket_of: list[tuple[int, int]], exact_scores: bool):
    """Wrap ``worker.propose``: every call first replays the tree graph and expands eagerly on the same
    inputs and compares the packed results (node tokens | parents | float64 cumulative scores)."""
    real_propose = worker.propose

    def propose(sched, reqs, depths):
        inp = worker._tree_inputs(reqs, depths)
        if inp is not None:
            replayed = worker.tree_graphs.replay(inp).clone()
            eager = worker._expand_eager(inp)
            n = eager.shape[1] // 3
            assert torch.equal(replayed[:, : 2 * n], eager[:, : 2 * n])  # tokens and parents
            if exact_scores:
                assert torch.equal(replayed[:, 2 * n :], eager[:, 2 * n :])
            else:
                torch.testing.assert_close(replayed[:, 2 * n :], eager[:, 2 * n :], rtol=0, atol=1e-4)
            assert all(v.forward_metadata_ready for v in worker.tree_graphs.last_views)
            bucket_of.append((len(inp.use), worker.tree_graphs.last_views[0].batch_size))
        return real_propose(sched, reqs, depths)

    worker.propose = propose


# Under the Triton interpreter every engine run costs tens of seconds: each drafter runs once across the
# two comparisons (EAGLE3 with topk 4 in the unpadded one).
@pytest.mark.parametrize(("algo", "topk"), [("EAGLE", 2), ("STANDALONE", 2)])
def test_graph_replay_expands_the_eager_trees_in_a_padded_batch(target, draft, tmp_path, algo, topk):
    """Three requests replay the bucket of 4. The scores agree to float32 rounding only: the padded
    batch's draft GEMMs have one row more, and the CPU's GEMM rounds a row differently by the row count
    (the next test shows the replay is bit-exact when the bucket is the batch)."""
    engine, worker = _engine_with_tree_graphs(target, _spec(algo, topk, target, draft, tmp_path))
    compared: list[tuple[int, int]] = []
    _compare_expansions(worker, compared, exact_scores=False)
    engine.generate(PROMPTS, SHORT)
    assert compared and any(bucket > bs for bs, bucket in compared)  # padding exercised


@pytest.mark.parametrize(("algo", "topk"), [("EAGLE3", 4)])
def test_graph_replay_is_bit_exact_when_the_bucket_is_the_batch(target, draft, tmp_path, algo, topk):
    engine = make_engine(target, attention_backend="triton", max_total_tokens=1024,
                         **_spec(algo, topk, target, draft, tmp_path))
    worker = engine.scheduler.spec_worker
    worker.tree_graphs = worker.build_tree_graphs(len(PROMPTS), EagerGraph)  # buckets 1, 2, 3
    compared: list[tuple[int, int]] = []
    _compare_expansions(worker, compared, exact_scores=True)
    engine.generate(PROMPTS, SHORT)
    assert compared and all(bucket == bs for bs, bucket in compared)


@pytest.fixture(scope="module", params=["EAGLE"])
def graph_run(request, target, draft, tmp_path_factory):
    """One engine run with the tree graphs installed: (engine, worker, token ids). STANDALONE's engine
    run on tree graphs is the fallback test's (at or under its captured max). Module scope runs before
    the autouse plan-check fixture, so it turns the checker on itself."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_CHECK_PLANS", "1")
        engine, worker = _engine_with_tree_graphs(target, _spec(request.param, 2, target, draft,
                                                                tmp_path_factory.mktemp("head")))
        assert all(isinstance(c, PlanCheckingBackend) for c in worker.decode_backend.children)
        outs = engine.generate(PROMPTS, SHORT)
    return engine, worker, [o.token_ids for o in outs]


@pytest.fixture(scope="module")
def reference(target):
    return [o.token_ids for o in make_engine(target).generate(PROMPTS, SHORT)]


def test_greedy_output_with_tree_graphs_equals_non_speculative_greedy(graph_run, reference):
    _, worker, outs = graph_run
    assert outs == reference
    assert _replays(worker) > 0 and worker.stats.verify_steps > 0


def test_no_kv_slot_is_in_use_after_every_request_finished(graph_run):
    engine, _, _ = graph_run
    assert_no_leaks(engine)


def test_propose_expands_eagerly_when_the_batch_exceeds_the_captured_max(target, draft, tmp_path, reference):
    engine = make_engine(target, attention_backend="triton", max_total_tokens=1024,
                         **_spec("STANDALONE", 2, target, draft, tmp_path))
    worker = engine.scheduler.spec_worker
    worker.tree_graphs = graphs = worker.build_tree_graphs(2, EagerGraph)
    paths: list[tuple[int, str]] = []  # (requests drafting, path taken) per propose call
    real_eager, real_replay = worker._expand_eager, graphs.replay
    worker._expand_eager = lambda inp: paths.append((len(inp.use), "eager")) or real_eager(inp)
    graphs.replay = lambda inp: paths.append((len(inp.use), "graph")) or real_replay(inp)
    outs = [o.token_ids for o in engine.generate(PROMPTS, SHORT)]  # 3 requests: above the max of 2
    outs_two = [o.token_ids for o in engine.generate(PROMPTS[:2], SHORT)]
    assert outs == reference and outs_two == reference[:2]
    assert {path for bs, path in paths if bs > 2} == {"eager"}
    assert {path for bs, path in paths if bs <= 2} == {"graph"}
    assert_no_leaks(engine)
