"""TARGET_VERIFY graphs on the CPU: per-width/per-bucket capture, padding into reserved rows and
slots, the plan marker, and replay equal to eager. The graph is the EagerGraph stand-in (replay
re-runs the recorded function over the static buffers); attention is the Triton backend under the
interpreter on a 1-layer model; PLAIT_CHECK_PLANS is on (tests/spec/conftest.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from plait.config import EngineConfig  # noqa: E402
from plait.executor.graph_utils import EagerGraph, capture_batch_sizes  # noqa: E402
from plait.executor.sizing import verify_graph_widths  # noqa: E402
from plait.executor.verify_graph_runner import VerifyGraphRunner, uniform_width  # noqa: E402
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW  # noqa: E402
from plait.sampling import SamplingParams  # noqa: E402
from plait.speculative.tree import DraftTree  # noqa: E402
from tests.helpers import assert_no_leaks, make_engine, prompt_ids  # noqa: E402

PROMPTS = prompt_ids(3)
SHORT = {"temperature": 0.0, "max_new_tokens": 10}


@pytest.fixture(scope="module")
def reference(one_layer):
    return [o.token_ids for o in make_engine(one_layer).generate(PROMPTS, SHORT)]


def _with_verify_graphs(engine, max_bs: int = 4, widths=(2, 3, 4)) -> VerifyGraphRunner:
    runner = VerifyGraphRunner(engine.runner.capture_target(), capture_batch_sizes(max_bs), widths,
                               graph_factory=EagerGraph)
    engine.runner.verify_graph_runner = runner
    return runner


def _replays(runner: VerifyGraphRunner) -> int:
    return sum(g.replays for g in runner.graphs.values())


@pytest.fixture(scope="module")
def ngram_engine(one_layer):
    """Top-k 2 drafts: verify batches may be trees, so the graphs take a tree mask."""
    engine = make_engine(one_layer, attention_backend="triton", speculative_algorithm="NGRAM",
                         speculative_eagle_topk=2, speculative_num_draft_tokens=4, max_total_tokens=1024)
    assert not engine.config.causal_chain_verify
    _with_verify_graphs(engine)
    return engine


@pytest.fixture(scope="module")
def chain_engine(one_layer):
    """Top-k 1 drafts: every verify batch is chains, which carry no mask (causal_chain_verify)."""
    engine = make_engine(one_layer, attention_backend="triton", speculative_algorithm="NGRAM",
                         max_total_tokens=1024)
    assert engine.config.causal_chain_verify
    _with_verify_graphs(engine, widths=(3, 4))
    return engine


@pytest.fixture
def verify_batch(ngram_engine):
    """``make(prefixes, trees)``: a verify batch over fresh rows whose prefixes hold arbitrary (fixed)
    KV. The rows and slots go back to the pools after the test, so the module's engine stays leak-free
    for the engine run that shares it."""
    runner = ngram_engine.runner
    held: list[tuple[int, torch.Tensor]] = []

    def make(prefixes: list[int], trees: list[DraftTree]):
        reqs, slots = [], []
        for pre, tree in zip(prefixes, trees, strict=True):
            row = runner.req_to_token_pool.alloc()
            s = runner.allocator.alloc(pre + tree.width)
            held.append((row, s))
            runner.req_to_token_pool.write(row, 0, s[:pre])
            reqs.append(SimpleNamespace(kv_len=pre, req_pool_idx=row))
            slots.append(s[pre:])
        return lambda **kw: ngram_engine.scheduler.spec_worker.build_verify_batch(reqs, trees, torch.cat(slots), **kw)

    yield make
    for row, s in held:
        runner.req_to_token_pool.free(row)
        runner.allocator.free(s)


def test_widths_cover_every_adaptive_depth_for_every_algorithm():
    ngram = EngineConfig.from_kwargs(model="x", speculative_algorithm="NGRAM", speculative_num_draft_tokens=4)
    assert verify_graph_widths(ngram) == [2, 3, 4]
    # EAGLE too: the model writes the hidden states its head reads, so replays provide them.
    eagle = EngineConfig.from_kwargs(model="x", speculative_algorithm="EAGLE", speculative_draft_model_path="h")
    assert verify_graph_widths(eagle) == list(range(2, eagle.speculative_num_draft_tokens + 1))
    assert verify_graph_widths(EngineConfig(model="x")) == []


def test_capture_marks_every_static_batch_planned_per_width_and_bucket(ngram_engine):
    runner = ngram_engine.runner.verify_graph_runner
    assert sorted(runner.capture_batches) == [(w, b) for w in (2, 3, 4) for b in (1, 2, 4)]
    for (w, bs), fb in runner.capture_batches.items():
        assert fb.forward_metadata_ready and not fb.needs_forward_metadata_init()
        assert (fb.forward_metadata_planned_bs, fb.forward_metadata_planned_num_tokens) == (bs, bs * w)


def test_every_verify_graph_shares_one_logits_buffer(ngram_engine):
    runner = ngram_engine.runner.verify_graph_runner
    base = runner.logits_buffer
    assert base.shape[0] == runner.max_bs * max(runner.widths)
    for (w, bs), out in runner.outputs.items():
        assert out.next_token_logits.shape[0] == w * bs
        assert out.next_token_logits.data_ptr() == base.data_ptr()


def test_can_run_only_uniform_captured_widths(ngram_engine, verify_batch):
    runner = ngram_engine.runner.verify_graph_runner
    chain = DraftTree.chain
    uniform = verify_batch([4, 6], [chain(5, [6, 7]), chain(8, [9, 10])])()
    mixed = verify_batch([4, 6], [chain(5, [6, 7]), chain(8, [9])])()
    too_wide = verify_batch([4], [chain(5, [6, 7, 8, 9])])()
    assert uniform_width(uniform) == 3 and uniform_width(mixed) is None
    assert runner.can_run(uniform)
    assert not runner.can_run(mixed)
    assert not runner.can_run(too_wide)


def test_replay_logits_equal_eager_on_a_padded_tree_batch(ngram_engine, verify_batch):
    tree = DraftTree([5, 6, 7, 8], [-1, 0, 0, 1])
    batch = verify_batch([3, 9, 5], [tree] * 3)  # 3 requests pad to the 4 bucket
    runner = ngram_engine.runner
    graphs = runner.verify_graph_runner
    before = _replays(graphs)
    replayed = runner.forward(batch()).next_token_logits.clone()
    assert _replays(graphs) == before + 1
    runner.verify_graph_runner = None
    eager = runner.forward(batch()).next_token_logits
    runner.verify_graph_runner = graphs
    assert replayed.shape == eager.shape == (12, eager.shape[1])
    torch.testing.assert_close(replayed, eager, rtol=1e-5, atol=1e-5)


def test_replay_returns_the_argmax_of_its_logits_computed_in_the_graph(ngram_engine, verify_batch):
    tree = DraftTree([5, 6, 7], [-1, 0, 1])
    batch = verify_batch([4, 7, 2], [tree] * 3)
    out = ngram_engine.runner.forward(batch())
    assert out.greedy_ids is not None and out.greedy_ids.shape == (9,)
    assert torch.equal(out.greedy_ids, out.next_token_logits.argmax(dim=-1))


def test_mixed_widths_are_padded_to_the_widest_captured_graph_and_accept_the_same(ngram_engine, verify_batch):
    chain = DraftTree.chain
    trees = [chain(5, [6, 7]), chain(8, [9]), DraftTree([4, 6, 2], [-1, 0, 0])]
    batch = verify_batch([4, 6, 3], trees)
    runner, worker = ngram_engine.runner, ngram_engine.scheduler.spec_worker
    graphs = runner.verify_graph_runner
    assert worker.graph_pad_width(trees) == 3
    padded = batch(pad_width=3)
    assert padded.spec_info.trees == trees and padded.spec_info.num_tokens_per_req == [3, 3, 3]
    assert padded.out_cache_loc[5].item() == DUMMY_KV_SLOT  # the second request's padding node
    before = _replays(graphs)
    replayed = runner.forward(padded).next_token_logits.clone()
    assert _replays(graphs) == before + 1
    runner.verify_graph_runner = None
    eager = runner.forward(batch()).next_token_logits
    runner.verify_graph_runner = graphs
    real_rows = [0, 1, 2, 3, 4, 6, 7, 8]  # row 5 is padding
    torch.testing.assert_close(replayed[real_rows], eager, rtol=1e-5, atol=1e-5)
    reqs = [SimpleNamespace(sampling_params=SamplingParams(temperature=0.0))] * 3
    assert worker.accept(reqs, trees, replayed, row_widths=[3, 3, 3]) == worker.accept(reqs, trees, eager)


def test_uniform_or_uncaptured_widths_are_not_padded(ngram_engine):
    worker = ngram_engine.scheduler.spec_worker
    chain = DraftTree.chain
    assert worker.graph_pad_width([chain(5, [6]), chain(7, [8])]) is None  # uniform already
    assert worker.graph_pad_width([chain(5, [6]), chain(7, [8, 9, 1, 2])]) is None  # width 5 not captured


def test_replay_pads_into_the_dummy_row_slot_and_a_mask_of_ones(ngram_engine, verify_batch):
    graphs = ngram_engine.runner.verify_graph_runner
    batch = verify_batch([4, 7, 2], [DraftTree.chain(5, [6])] * 3)()
    ngram_engine.runner.forward(batch)
    assert graphs.req_pool_indices[3].item() == DUMMY_REQ_ROW
    assert graphs.out_cache_loc[6:8].tolist() == [DUMMY_KV_SLOT] * 2
    assert graphs.prefix_lens[3].item() == 0
    live_mask = batch.spec_info.custom_mask.numel()
    assert graphs.custom_mask[live_mask : live_mask + 4].all()
    assert DUMMY_REQ_ROW not in graphs.req_pool_indices[:3].tolist()


def test_replay_plans_on_the_padded_view_and_marks_it(ngram_engine, verify_batch):
    graphs = ngram_engine.runner.verify_graph_runner
    backend = ngram_engine.runner.attn_backend
    planned: list[tuple[int, int]] = []
    inner = backend.init_forward_metadata_out_graph

    def spy(fb, in_capture=False):
        planned.append((fb.batch_size, fb.num_tokens))
        return inner(fb, in_capture)

    backend.init_forward_metadata_out_graph = spy
    try:
        batch = verify_batch([4, 7, 2], [DraftTree.chain(5, [6, 7])] * 3)()
        ngram_engine.runner.forward(batch)
    finally:
        del backend.init_forward_metadata_out_graph
    assert planned == [(4, 12)]  # once, after padding, never on the live (3, 9) shape
    view = graphs.last_view
    assert view.forward_metadata_ready and view.forward_metadata_planned_num_tokens == 12
    assert not batch.forward_metadata_ready  # the live batch itself was never planned


def test_ngram_greedy_output_is_the_same_with_verify_graphs(ngram_engine, reference):
    engine = ngram_engine  # the module's engine: the other tests give back every row and slot they take
    graphs = engine.runner.verify_graph_runner
    before = _replays(graphs)
    for p, ref in zip(PROMPTS, reference, strict=True):  # proposals that are right, and wrong siblings
        engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    outs = engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert _replays(graphs) > before
    assert_no_leaks(engine)


def test_standalone_greedy_output_is_the_same_with_verify_graphs(one_layer, reference):
    engine = make_engine(one_layer, attention_backend="triton", speculative_algorithm="STANDALONE",
                         speculative_draft_model_path=str(one_layer), max_total_tokens=1024)
    # A self-draft is always accepted in full: every verify is 4 wide (three requests: the bucket of 4).
    graphs = _with_verify_graphs(engine, widths=(4,))
    outs = engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert _replays(graphs) > 0
    assert engine.scheduler.spec_worker.stats.accept_histogram[3] > 0
    assert_no_leaks(engine)


def test_chain_batches_carry_no_mask_and_pad_after_the_chain(chain_engine):
    worker = chain_engine.scheduler.spec_worker
    chain = DraftTree.chain
    rows = [SimpleNamespace(kv_len=4, req_pool_idx=0), SimpleNamespace(kv_len=6, req_pool_idx=1)]
    fb = worker.build_verify_batch(rows, [chain(5, [6, 7]), chain(8, [9])], torch.arange(5), pad_width=3)
    assert fb.spec_info.custom_mask is None
    # The second request's dummy node sits one position past its chain, its KV in the dummy slot.
    assert fb.positions.tolist() == [4, 5, 6, 6, 7, 8]
    assert fb.out_cache_loc[5].item() == DUMMY_KV_SLOT
    tree = worker.build_verify_batch(rows[:1], [DraftTree([5, 6, 7], [-1, 0, 0])], torch.arange(3))
    assert tree.spec_info.custom_mask is not None


def test_a_chain_batch_in_the_graph_buffers_computes_its_indptrs_in_graph_from_the_device_lengths(chain_engine):
    worker, backend = chain_engine.scheduler.spec_worker, chain_engine.runner.attn_backend
    rows = [SimpleNamespace(kv_len=4, req_pool_idx=0), SimpleNamespace(kv_len=6, req_pool_idx=1)]
    fb = worker.build_verify_batch(rows, [DraftTree.chain(5, [6, 7]), DraftTree.chain(8, [9])], torch.arange(5))
    packed = backend.graph_verify_buffers.packed
    packed[:, 1:].fill_(-1)  # what the plans leave unwritten shows (column 0 stays 0)
    try:
        backend.init_forward_metadata_out_graph(fb)
        assert packed[:2, 1:3].tolist() == [[-1, -1], [-1, -1]]  # the plan outside the graph issues no work
        backend.init_forward_metadata_in_graph(fb)
        qo, kv = packed[:2, 1:3].tolist()
        assert qo == [3, 5] and kv == [4, 10]  # cumsums of the widths (3, 2) and of the prefixes (4, 6)
    finally:
        packed.zero_()  # column 0 is zero for every later plan


def test_a_chain_plan_in_the_graph_buffers_is_made_once_per_shape(chain_engine):
    worker, backend = chain_engine.scheduler.spec_worker, chain_engine.runner.attn_backend
    plans = []
    for kv_len, tokens in ((4, [5, 6, 7]), (9, [1, 2, 3])):
        fb = worker.build_verify_batch([SimpleNamespace(kv_len=kv_len, req_pool_idx=0)], [DraftTree.chain(
            tokens[0], tokens[1:])], torch.arange(3))
        backend.init_forward_metadata_out_graph(fb)
        plans.append((backend.extend_md, backend.verify_md))
    assert plans[0][0] is plans[1][0] and plans[0][1] is plans[1][1]


def test_chain_graphs_replay_padded_chain_batches_as_eager_and_leave_trees_eager(chain_engine):
    runner, worker = chain_engine.runner, chain_engine.scheduler.spec_worker
    graphs = runner.verify_graph_runner
    assert graphs.causal_chains and graphs.custom_mask is None
    held = []
    reqs, slots = [], []
    for pre in (4, 7, 2):
        row = runner.req_to_token_pool.alloc()
        s = runner.allocator.alloc(pre + 3)
        held.append((row, s))
        runner.req_to_token_pool.write(row, 0, s[:pre])
        reqs.append(SimpleNamespace(kv_len=pre, req_pool_idx=row))
        slots.append(s[pre:])
    try:
        chain = DraftTree.chain
        trees = [chain(5, [6, 7]), chain(8, [9]), chain(3, [4, 1])]
        batch = lambda **kw: worker.build_verify_batch(reqs, trees, torch.cat(slots)[:8], **kw)  # noqa: E731
        before = _replays(graphs)
        replayed = runner.forward(batch(pad_width=3)).next_token_logits.clone()
        assert _replays(graphs) == before + 1
        runner.verify_graph_runner = None
        eager = runner.forward(batch()).next_token_logits
        runner.verify_graph_runner = graphs
        real_rows = [0, 1, 2, 3, 4, 6, 7, 8]  # row 5 is the second request's padding
        torch.testing.assert_close(replayed[real_rows], eager, rtol=1e-5, atol=1e-5)
        tree = worker.build_verify_batch(reqs[:1], [DraftTree([5, 6, 7], [-1, 0, 0])], slots[0])
        assert not graphs.can_run(tree)
    finally:
        for row, s in held:
            runner.req_to_token_pool.free(row)
            runner.allocator.free(s)


def test_ngram_chain_greedy_output_is_the_same_with_chain_graphs(chain_engine, reference):
    graphs = chain_engine.runner.verify_graph_runner
    for p, ref in zip(PROMPTS, reference, strict=True):
        chain_engine.scheduler.spec_worker.drafter.cache.insert(p + ref)
    outs = chain_engine.generate(PROMPTS, SHORT)
    assert [o.token_ids for o in outs] == reference
    assert _replays(graphs) > 0
    assert_no_leaks(chain_engine)
