"""CudaGraphRunner logic on the CPU: buckets, padding into reserved rows/slots, the plan marker,
and replay equal to eager. The graph is the EagerGraph stand-in (replay re-runs the recorded
function over the static buffers) and attention is the Triton backend under the interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from plait.executor.cuda_graph_runner import CudaGraphRunner  # noqa: E402
from plait.executor.graph_utils import EagerGraph, capture_batch_sizes, graph_max_bs_for_memory  # noqa: E402
from plait.forward_batch import ForwardBatch, ForwardMode  # noqa: E402
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW  # noqa: E402
from tests.helpers import make_engine, prompt_ids  # noqa: E402

GREEDY8 = {"temperature": 0.0, "max_new_tokens": 8}


@pytest.fixture
def engine(one_layer):
    return make_engine(one_layer, attention_backend="triton", max_total_tokens=1024)


@pytest.fixture
def graph_runner(engine):
    runner = CudaGraphRunner(engine.runner.capture_target(), capture_batch_sizes(4), graph_factory=EagerGraph)
    engine.runner.graph_runner = runner
    return runner


class PlanCounter:
    """Wraps the backend's out_graph to record the batches (and their sizes) it planned."""

    def __init__(self, backend) -> None:
        self.sizes: list[int] = []
        self.batches: list[ForwardBatch] = []
        self._inner = backend.init_forward_metadata_out_graph
        backend.init_forward_metadata_out_graph = self

    def __call__(self, fb, in_capture=False):
        self.sizes.append(fb.batch_size)
        self.batches.append(fb)
        return self._inner(fb, in_capture)


def test_capture_batch_sizes_are_1_2_4_8_then_steps_of_8():
    assert capture_batch_sizes(40) == [1, 2, 4, 8, 16, 24, 32, 40]
    assert capture_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert capture_batch_sizes(3) == [1, 2, 3]


MIB = 2**20


@pytest.mark.parametrize("card, total_bytes", [("H100 80GB HBM3", 85017493504), ("A100 80GB", 81920 * MIB),
                                               ("H200", 143771 * MIB)])
def test_80_gb_class_cards_capture_decode_graphs_up_to_bs_256(card, total_bytes):
    assert graph_max_bs_for_memory(total_bytes, 256) == 256, card


@pytest.mark.parametrize("card, total_mib", [("A100 40GB", 40960), ("L40S", 46068), ("A10", 23028)])
def test_smaller_cards_capture_decode_graphs_up_to_bs_160(card, total_mib):
    assert graph_max_bs_for_memory(total_mib * MIB, 256) == 160, card


def test_the_graph_batch_limit_never_exceeds_the_running_limit():
    assert graph_max_bs_for_memory(143771 * MIB, 48) == 48


def test_buckets_round_up_to_the_next_captured_size(graph_runner):
    assert [graph_runner.bucket(b) for b in (1, 2, 3, 4)] == [1, 2, 4, 4]


def test_capture_marks_every_static_batch_planned(graph_runner):
    assert sorted(graph_runner.capture_batches) == [1, 2, 4]
    for bs, fb in graph_runner.capture_batches.items():
        assert fb.forward_metadata_ready and fb.forward_metadata_planned_bs == bs
        assert not fb.needs_forward_metadata_init()


def test_every_graph_writes_its_logits_into_the_one_shared_buffer(graph_runner):
    """One static logits buffer for all buckets (a buffer per graph grows with the bucket count)."""
    base = graph_runner.logits_buffer
    assert base.dtype == torch.float32 and base.shape[0] == graph_runner.max_bs
    for bs, out in graph_runner.outputs.items():
        logits = out.next_token_logits
        assert logits.shape[0] == bs and logits.data_ptr() == base.data_ptr()


def batch(mode, bs):
    z = torch.zeros(bs, dtype=torch.long)
    return ForwardBatch(forward_mode=mode, batch_size=bs, input_ids=z, req_pool_indices=z, seq_lens=z,
                        out_cache_loc=z, positions=z)


def test_can_run_decode_batches_up_to_max_bs_only(graph_runner):
    assert graph_runner.can_run(batch(ForwardMode.DECODE, 4))
    assert not graph_runner.can_run(batch(ForwardMode.DECODE, 5))
    assert not graph_runner.can_run(batch(ForwardMode.EXTEND, 2))


def test_without_padding_only_a_captured_batch_size_replays(engine):
    runner = CudaGraphRunner(engine.runner.capture_target(), [1, 2, 4], graph_factory=EagerGraph, pad=False)
    assert [runner.can_run(batch(ForwardMode.DECODE, bs)) for bs in (1, 2, 3, 4, 5)] == [
        True, True, False, True, False]


def test_replay_greedy_tokens_equal_eager(engine, graph_runner, one_layer):
    prompts = prompt_ids(3)
    replays_before = sum(g.replays for g in graph_runner.graphs.values())
    with_graph = [o.token_ids for o in engine.generate(prompts, GREEDY8)]
    assert sum(g.replays for g in graph_runner.graphs.values()) > replays_before
    eager = make_engine(one_layer, attention_backend="triton", max_total_tokens=1024)
    assert [o.token_ids for o in eager.generate(prompts, GREEDY8)] == with_graph


def test_replay_pads_into_the_dummy_row_slot_and_fill_value(engine, graph_runner):
    engine.generate(prompt_ids(3), {"temperature": 0.0, "max_new_tokens": 3})
    # The last decode step had 3 live rows in the 4 bucket: row 3 is padding.
    assert graph_runner.req_pool_indices[3].item() == DUMMY_REQ_ROW
    assert graph_runner.out_cache_loc[3].item() == DUMMY_KV_SLOT
    assert graph_runner.seq_lens[3].item() == graph_runner.fill_value
    assert DUMMY_REQ_ROW not in graph_runner.req_pool_indices[:3].tolist()


def test_replay_plans_an_unplanned_batch_on_the_padded_view(engine, graph_runner):
    counter = PlanCounter(engine.runner.attn_backend)
    engine.generate(prompt_ids(3), {"temperature": 0.0, "max_new_tokens": 3})
    # one extend plan (3 requests), then two decode replays planned at the padded size 4
    assert counter.sizes == [3, 4, 4]


def test_replay_marks_the_padded_view_it_planned(engine, graph_runner):
    """Replay is a pre-planning site: the padded view it planned carries the plan marker at that
    padded shape, so nothing downstream plans it again."""
    counter = PlanCounter(engine.runner.attn_backend)
    engine.generate(prompt_ids(3), {"temperature": 0.0, "max_new_tokens": 3})
    views = counter.batches[1:]  # after the extend plan: the decode replays' padded views
    assert views and all(v.batch_size == 4 for v in views)
    for view in views:
        assert view.forward_metadata_ready and view.forward_metadata_planned_bs == 4
        assert not view.needs_forward_metadata_init()


def test_replay_does_not_plan_a_batch_its_pre_planner_marked(engine, graph_runner):
    fb = graph_runner.capture_batches[2]
    engine.runner.attn_backend.init_forward_metadata_out_graph(fb)  # a pre-planner (e.g. multi-step draft)
    fb.mark_forward_metadata_ready()
    counter = PlanCounter(engine.runner.attn_backend)
    graph_runner.replay(fb)
    assert counter.sizes == []


def test_in_graph_rejects_per_step_tensors_after_capture_planning(engine, graph_runner):
    backend = engine.runner.attn_backend
    static = graph_runner.capture_batches[2]
    backend.init_forward_metadata_out_graph(static, in_capture=True)
    fresh = ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=2, input_ids=static.input_ids.clone(),
                         req_pool_indices=static.req_pool_indices.clone(), seq_lens=static.seq_lens.clone(),
                         out_cache_loc=static.out_cache_loc.clone(), positions=static.positions.clone(),
                         seq_lens_cpu=[1, 1], seq_lens_sum=2)
    with pytest.raises(RuntimeError, match="static buffers"):
        backend.init_forward_metadata_in_graph(fresh)
