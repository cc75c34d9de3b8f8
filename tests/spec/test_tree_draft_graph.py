"""The top-k tree expansion (topk > 1) captured per (steps, batch bucket) on the CPU: EagerGraph
stand-in (replay re-runs the recorded function over the static buffers), Triton draft backends under
the interpreter, PLAIT_CHECK_PLANS on (tests/spec/conftest.py). A replay expands exactly what the
eager expansion expands, a batch above the captured max expands eagerly, the engine's greedy output
stays exact, and every KV slot is free after."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from plait.attention.plan_check import PlanCheckingBackend  # noqa: E402
from plait.executor.graph_utils import EagerGraph, capture_batch_sizes  # noqa: E402
from plait.testing import (
    make_eagle_head,  # noqa: E402
    make_tiny_model,  # noqa: E402
)
from tests.helpers import assert_no_leaks, make_engine, prompt_ids  # noqa: E402

MAX_BS = 4  # buckets 1, 2, 4
# Five requests, two of them short: the first verify steps run five requests (above the captured max:
# eager), then the batch shrinks to four or three (a replay, three padded to the bucket of 4).
PROMPTS = prompt_ids(5)
PARAMS = [{"temperature": 0.0, "max_new_tokens": n} for n in (3, 4, 7, 7, 7)]


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    """A STANDALONE draft with other weights than the target (the trees branch on its guesses)."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=1)


def _spec(algo: str, topk: int, target, draft, tmp_path) -> dict:
    path = draft if algo == "STANDALONE" else make_eagle_head(tmp_path / algo, target, algo)
    return {"speculative_algorithm": algo, "speculative_draft_model_path": str(path), "speculative_num_steps": 2,
            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": 5}


def _engine_with_tree_graphs(target, spec: dict, max_bs: int = MAX_BS, target_backend: str = "triton"):
    engine = make_engine(target, attention_backend=target_backend, speculative_draft_attention_backend="triton",
                         max_total_tokens=1024, **spec)
    worker = engine.scheduler.spec_worker
    assert worker.tree_graphs is None  # not on a GPU: the test installs what a GPU engine builds
    worker.tree_graphs = worker.build_tree_graphs(capture_batch_sizes(max_bs), EagerGraph)
    return engine, worker


def _replays(worker) -> int:
    return sum(g.replays for g in worker.tree_graphs.graphs.values())


def _compare_and_record(worker, compared: list[tuple[int, int]], paths: list[tuple[int, str]],
                        exact_scores: bool) -> None:
    """Wrap ``worker.propose``: every call whose batch the tree graphs take first replays the graph and
    expands eagerly on the same inputs and compares the packed results (node tokens | parents | float64
    cumulative scores), recording (requests, bucket); and every expansion the engine itself runs records
    (requests drafting, "graph" or "eager")."""
    graphs = worker.tree_graphs
    real_propose, real_eager, real_replay = worker.propose, worker._expand_eager, graphs.replay

    def propose(sched, reqs, depths):
        inp = worker._tree_inputs(reqs, depths)
        if inp is not None and graphs.can_run(len(inp.use), max(inp.max_depths)):
            replayed = real_replay(inp).clone()
            eager = real_eager(inp)
            n = eager.shape[1] // 3
            assert torch.equal(replayed[:, : 2 * n], eager[:, : 2 * n])  # tokens and parents
            if exact_scores:
                assert torch.equal(replayed[:, 2 * n :], eager[:, 2 * n :])
            else:
                torch.testing.assert_close(replayed[:, 2 * n :], eager[:, 2 * n :], rtol=0, atol=1e-4)
            assert all(v.forward_metadata_ready for v in graphs.last_views)
            compared.append((len(inp.use), graphs.last_views[0].batch_size))
        return real_propose(sched, reqs, depths)

    worker.propose = propose
    worker._expand_eager = lambda inp: paths.append((len(inp.use), "eager")) or real_eager(inp)
    graphs.replay = lambda inp: paths.append((len(inp.use), "graph")) or real_replay(inp)


@pytest.fixture(scope="module")
def reference(one_layer):
    return [o.token_ids for o in make_engine(one_layer).generate(PROMPTS, PARAMS)]


# Under the Triton interpreter every engine run costs tens of seconds: one run per drafter (on the
# 1-layer target: tree expansion and verify do not depend on the depth) serves the capture, replay,
# fallback, output and leak checks below.
@pytest.fixture(scope="module", params=["EAGLE", "STANDALONE"])
def graph_run(request, one_layer, draft, tmp_path_factory):
    """One engine run with the tree graphs installed (topk 2, captured up to MAX_BS): (engine, worker,
    token ids, compared (requests, bucket), paths (requests, path)). Module scope runs before the
    autouse plan-check fixture, so it turns the checker on itself."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PLAIT_CHECK_PLANS", "1")
        # The target verifies on torch_native: only the draft's expansion is compared, and the Triton
        # verify under the interpreter would cost most of the run.
        engine, worker = _engine_with_tree_graphs(one_layer, _spec(request.param, 2, one_layer, draft,
                                                                   tmp_path_factory.mktemp("head")),
                                                  target_backend="torch_native")
        assert all(isinstance(c, PlanCheckingBackend) for c in worker.decode_backend.children)
        compared: list[tuple[int, int]] = []
        paths: list[tuple[int, str]] = []
        _compare_and_record(worker, compared, paths, exact_scores=False)
        outs = engine.generate(PROMPTS, PARAMS)
    return engine, worker, [o.token_ids for o in outs], compared, paths


def test_capture_plans_and_marks_every_step_on_its_own_checked_child(graph_run):
    _, worker, _, _, _ = graph_run
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


def test_graph_replay_expands_the_eager_trees_in_a_padded_batch(graph_run):
    """Three requests replay the bucket of 4. The scores agree to float32 rounding only: the padded
    batch's draft GEMMs have one row more, and the CPU's GEMM rounds a row differently by the row count
    (the next test shows the replay is bit-exact when the bucket is the batch)."""
    _, _, _, compared, _ = graph_run
    assert (3, 4) in compared  # padding exercised
    assert all(bucket >= bs for bs, bucket in compared)


def test_graph_replay_is_bit_exact_when_the_bucket_is_the_batch(tmp_path_factory, draft):
    """EAGLE3 with topk 4 (the widest trees), two requests on buckets 1 and 2. The comparison is the
    draft's alone: the 3-layer target verifies on torch_native (outside the interpreter)."""
    # EAGLE3 captures target layers [2, L//2, L-3]: the shortest target it accepts has 3 layers.
    target = make_tiny_model(tmp_path_factory.mktemp("three_layers"), "llama", seed=0, num_hidden_layers=3)
    spec = _spec("EAGLE3", 4, target, draft, tmp_path_factory.mktemp("e3"))
    engine, worker = _engine_with_tree_graphs(target, spec, max_bs=2, target_backend="torch_native")
    compared: list[tuple[int, int]] = []
    _compare_and_record(worker, compared, [], exact_scores=True)
    engine.generate(PROMPTS[1:3], {"temperature": 0.0, "max_new_tokens": 6})
    assert compared and all(bucket == bs for bs, bucket in compared)


def test_greedy_output_with_tree_graphs_equals_non_speculative_greedy(graph_run, reference):
    _, worker, outs, _, _ = graph_run
    assert outs == reference
    assert _replays(worker) > 0 and worker.stats.verify_steps > 0


def test_propose_expands_eagerly_when_the_batch_exceeds_the_captured_max(graph_run):
    _, _, _, _, paths = graph_run
    assert {path for bs, path in paths if bs > MAX_BS} == {"eager"}
    assert {path for bs, path in paths if bs <= MAX_BS} == {"graph"}


def test_no_kv_slot_is_in_use_after_every_request_finished(graph_run):
    engine, _, _, _, _ = graph_run
    assert_no_leaks(engine)
