"""Loading under tensor parallelism reads each rank's slice from the safetensors file, not the tensor."""

from __future__ import annotations

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from plait.distributed.parallel_state import TPGroup
from plait.distributed.sharded_load import LazySlice
from plait.layers.linear import ColumnParallelLinear, RowParallelLinear


class CountingSlice:
    """A safetensors slice that records which index it was read with."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.reads: list = []

    def get_shape(self):
        return self.inner.get_shape()

    def __getitem__(self, index):
        self.reads.append(index)
        return self.inner[index]


def test_weight_loaders_read_only_the_rank_slice(tmp_path):
    full = torch.arange(8 * 6, dtype=torch.float32).reshape(8, 6)
    save_file({"w": full}, str(tmp_path / "w.safetensors"))
    # A TPGroup needs a process group only to communicate; loading never does.
    tp = TPGroup(rank=1, size=2, group=object())
    col, row = ColumnParallelLinear(6, 8, tp=tp), RowParallelLinear(6, 8, tp=tp)
    with safe_open(str(tmp_path / "w.safetensors"), framework="pt") as f:
        src = CountingSlice(f.get_slice("w"))
        col.weight_loader(col.weight, LazySlice(src).to(torch.float64), None)
        row.weight_loader(row.weight, LazySlice(src), None)
    assert torch.equal(col.weight, full[4:8])  # output rows of rank 1
    assert torch.equal(row.weight, full[:, 3:6])  # input columns of rank 1
    assert src.reads == [(slice(4, 8),), (slice(None), slice(3, 6))]


def test_replicated_weights_read_the_whole_tensor_through_torch(tmp_path):
    save_file({"norm": torch.linspace(0, 1, 5)}, str(tmp_path / "n.safetensors"))
    with safe_open(str(tmp_path / "n.safetensors"), framework="pt") as f:
        lazy = LazySlice(f.get_slice("norm"))
        param = torch.zeros(5)
        assert lazy.shape == param.shape
        param.copy_(lazy)
    assert torch.equal(param, torch.linspace(0, 1, 5))
