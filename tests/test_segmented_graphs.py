"""Segmented verify graphs (``plait.executor.graph_utils.SegmentedCudaGraph``): where the forward is cut,
that every cut closes one segment and opens the next in the same pool, and that replay launches the
segments in order. There is no CUDA here: torch.cuda.CUDAGraph records its calls instead
(``record_cuda_graph_calls``); the GPU test replays real segments (tests/gpu/test_spec_graphs_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from plait.executor.graph_utils import SegmentedCudaGraph, decoder_layers, segment_starts, segmented_graph_factory
from tests.helpers import make_engine, record_cuda_graph_calls


@pytest.mark.parametrize(("num_layers", "starts"), [
    (1, []), (2, [1]), (4, [1]), (8, [1, 3]), (16, [1, 3, 7]), (28, [1, 3, 7, 15]), (32, [1, 3, 7, 15]),
    (80, [1, 3, 7, 15, 31]),
])
def test_segments_double_and_none_is_shorter_than_the_one_before_it(num_layers, starts):
    assert segment_starts(num_layers) == starts


class Logged(nn.Module):
    def __init__(self, index: int, log: list[str]) -> None:
        super().__init__()
        self.index, self.log = index, log

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.log.append(f"layer {self.index}")
        return x + 1


class Decoder(nn.Module):
    """``model.layers`` as a plait causal LM has them."""

    def __init__(self, num_layers: int, log: list[str]) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.layers = nn.ModuleList(Logged(i, log) for i in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.model.layers:
            x = layer(x)
        return x


def test_an_8_layer_forward_is_captured_as_segments_cut_before_layers_1_and_3(monkeypatch):
    log = record_cuda_graph_calls(monkeypatch)
    model = Decoder(8, log)
    graph = segmented_graph_factory(model)()
    out = graph.capture(lambda: model(torch.zeros(2)), pool="P")
    assert torch.equal(out, torch.full((2,), 8.0))
    assert log == ["begin 0 pool=P", "layer 0", "end 0",
                   "begin 1 pool=P", "layer 1", "layer 2", "end 1",
                   "begin 2 pool=P", *[f"layer {i}" for i in range(3, 8)], "end 2"]
    assert len(graph.segments) == 3 and graph.pool() == "P"


def test_replay_launches_every_segment_in_capture_order(monkeypatch):
    log = record_cuda_graph_calls(monkeypatch)
    model = Decoder(16, log)
    graph = segmented_graph_factory(model)()
    graph.capture(lambda: model(torch.zeros(1)), pool="P")
    log.clear()
    graph.replay()
    assert log == ["replay 0", "replay 1", "replay 2", "replay 3"]


def test_the_cuts_exist_only_during_the_capture(monkeypatch):
    log = record_cuda_graph_calls(monkeypatch)
    model = Decoder(8, log)
    segmented_graph_factory(model)().capture(lambda: model(torch.zeros(1)), pool="P")
    log.clear()
    model(torch.zeros(1))
    assert log == [f"layer {i}" for i in range(8)]
    assert all(not layer._forward_pre_hooks for layer in model.model.layers)


def test_the_factory_cuts_a_plait_model_before_its_decoder_layers(tiny_model_dir):
    engine = make_engine(tiny_model_dir("llama"))
    model = engine.runner.model
    layers = decoder_layers(model)
    assert layers == list(model.model.layers) and len(layers) > 1
    graph = segmented_graph_factory(model)()
    assert isinstance(graph, SegmentedCudaGraph)
    assert graph.cut_before == [layers[i] for i in segment_starts(len(layers))] != []
    engine.shutdown()


def test_a_model_without_decoder_layers_is_one_segment():
    assert decoder_layers(nn.Linear(2, 2)) == []
    assert segmented_graph_factory(nn.Linear(2, 2))().cut_before == []
