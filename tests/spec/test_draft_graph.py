"""The chain draft loop captured per (steps, batch bucket) on the CPU: EagerGraph stand-in, Triton
draft backends under the interpreter, PLAIT_CHECK_PLANS on. Graphs on and off draft the same tokens
(equal acceptance histograms) and keep greedy output exact. Where only the draft loop is compared the
target verifies on torch_native, outside the interpreter."""

from __future__ import annotations

import pytest

pytest.importorskip("triton")

from plait.executor.graph_utils import EagerGraph, capture_batch_sizes  # noqa: E402
from plait.testing import (
    make_eagle_head,  # noqa: E402
    make_tiny_model,  # noqa: E402
)
from tests.helpers import assert_no_leaks, make_engine, prompt_ids  # noqa: E402

PROMPTS = prompt_ids(3)[1:]  # two requests of different lengths: the 2 bucket, no padding needed
SHORT = {"temperature": 0.0, "max_new_tokens": 8}
MAX_BS = 2


@pytest.fixture(scope="module")
def other_draft(tmp_path_factory):
    """Different weights: some guesses are rejected, so the histogram pins the drafted tokens."""
    return make_tiny_model(tmp_path_factory.mktemp("draft"), "llama", seed=1, num_hidden_layers=1)


@pytest.fixture(scope="module")
def reference(one_layer):
    return [o.token_ids for o in make_engine(one_layer).generate(PROMPTS, SHORT)]


def _run(target, graphs: bool, **spec):
    engine = make_engine(target, attention_backend="torch_native", speculative_draft_attention_backend="triton",
                         max_total_tokens=1024, **spec)
    worker = engine.scheduler.spec_worker
    if graphs:
        worker.draft_graphs = worker.build_draft_graphs(capture_batch_sizes(MAX_BS), EagerGraph)
    outs = engine.generate(PROMPTS, SHORT)
    return engine, worker, [o.token_ids for o in outs]


def _replays(worker) -> int:
    return sum(g.replays for g in worker.draft_graphs.graphs.values())


def test_capture_plans_and_marks_every_step_on_its_stamped_child(one_layer):
    engine = make_engine(one_layer, attention_backend="triton", max_total_tokens=1024,
                         speculative_algorithm="STANDALONE", speculative_draft_model_path=str(one_layer))
    worker = engine.scheduler.spec_worker
    graphs = worker.build_draft_graphs(capture_batch_sizes(MAX_BS), EagerGraph)
    assert sorted(graphs.capture_batches) == [(k, b) for k in (1, 2, 3) for b in (1, 2)]
    children = worker.decode_backend.children
    for (k, bs), batches in graphs.capture_batches.items():
        assert len(batches) == k
        for s, fb in enumerate(batches):
            assert fb.attn_backend is children[s] and fb.attn_backend.name == "triton"
            assert fb.forward_metadata_ready and fb.forward_metadata_planned_bs == bs


def test_standalone_drafts_equal_with_graphs_on_and_off(one_layer, other_draft, reference):
    spec = {"speculative_algorithm": "STANDALONE", "speculative_draft_model_path": str(other_draft),
            "speculative_num_steps": 2, "speculative_num_draft_tokens": 3}
    eager, eager_worker, eager_out = _run(one_layer, False, **spec)
    graph, graph_worker, graph_out = _run(one_layer, True, **spec)
    assert eager_out == graph_out == reference
    assert _replays(graph_worker) > 0
    assert graph_worker.stats.accept_histogram == eager_worker.stats.accept_histogram
    views = graph_worker.draft_graphs.last_views
    assert views and all(v.forward_metadata_ready for v in views)
    assert_no_leaks(graph)


def test_standalone_with_draft_and_verify_graphs_accepts_everything_from_itself(one_layer, reference):
    from plait.executor.verify_graph_runner import VerifyGraphRunner

    engine = make_engine(one_layer, attention_backend="triton", max_total_tokens=1024,
                         speculative_algorithm="STANDALONE", speculative_draft_model_path=str(one_layer))
    worker = engine.scheduler.spec_worker
    worker.draft_graphs = worker.build_draft_graphs(capture_batch_sizes(MAX_BS), EagerGraph)
    engine.runner.verify_graph_runner = VerifyGraphRunner(engine.runner.capture_target(),
                                                          capture_batch_sizes(MAX_BS), [4], graph_factory=EagerGraph)
    outs = engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert _replays(worker) > 0
    assert set(worker.stats.accept_histogram) <= {1, 2, 3} and worker.stats.accept_histogram[3] > 0
    assert_no_leaks(engine)


def test_eagle3_drafts_equal_with_graphs_on_and_off(tmp_path_factory):
    # EAGLE3 captures target layers [2, L//2, L-3]: the shortest target it accepts has 3 layers.
    target = make_tiny_model(tmp_path_factory.mktemp("three_layers"), "llama", seed=0, num_hidden_layers=3)
    head = make_eagle_head(tmp_path_factory.mktemp("eagle3"), target, "EAGLE3")
    spec = {"speculative_algorithm": "EAGLE3", "speculative_draft_model_path": str(head),
            "speculative_num_steps": 2, "speculative_num_draft_tokens": 3}
    _, eager_worker, eager_out = _run(target, False, **spec)
    graph, graph_worker, graph_out = _run(target, True, **spec)
    assert graph_out == eager_out
    assert _replays(graph_worker) > 0
    assert graph_worker.stats.accept_histogram == eager_worker.stats.accept_histogram
    assert_no_leaks(graph)
