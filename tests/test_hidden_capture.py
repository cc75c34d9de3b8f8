"""HiddenCapture: where a forward's captured hidden states land and how they are read back."""

from __future__ import annotations

import torch

from plait.layers.hidden_capture import HiddenCapture


def _capture(static_rows: int, layers=(2, -1)) -> HiddenCapture:
    return HiddenCapture(layers, hidden_size=3, static_rows=static_rows, dtype=torch.float32, device="cpu")


def test_forwards_that_fit_write_into_the_static_buffer_a_graph_replays_into():
    cap = _capture(static_rows=4)
    storage = cap.static.data_ptr()
    cap.begin(2)
    cap.store(2, torch.ones(2, 3))
    cap.store(-1, torch.full((2, 3), 5.0))
    rows = cap.read(2)
    assert rows.data_ptr() == storage and cap.static.data_ptr() == storage  # never reallocated
    assert rows.tolist() == [[1, 1, 1, 5, 5, 5]] * 2


def test_larger_forwards_get_fresh_rows_and_leave_the_static_buffer_alone():
    cap = _capture(static_rows=2)
    cap.begin(3)
    cap.store(2, torch.arange(9.0).view(3, 3))
    cap.store(-1, torch.zeros(3, 3))
    assert cap.read(3)[:, :3].tolist() == torch.arange(9.0).view(3, 3).tolist()
    assert not cap.static.any()


def test_a_repeated_layer_fills_each_of_its_column_blocks():
    cap = _capture(static_rows=1, layers=(2, 2, 1))  # EAGLE3 over a 4-layer target
    cap.begin(1)
    cap.store(1, torch.full((1, 3), 7.0))
    cap.store(2, torch.full((1, 3), 4.0))
    assert cap.read(1).tolist() == [[4, 4, 4, 4, 4, 4, 7, 7, 7]]
