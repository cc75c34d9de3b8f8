"""The DP-attention MLP of a SUM_LEN round in row slices (plait.distributed.dp_mlp): two gloo ranks,
each with its shard of one LlamaMLP, get the same rows from the sliced pipeline as from one
gather / MLP / reduce-scatter, for equal and uneven token counts."""

from __future__ import annotations

import multiprocessing as mp
import socket
from types import SimpleNamespace

import torch

from plait.distributed.dp_mlp import dp_gathered_mlp
from plait.forward_batch import DPPaddingMode, ForwardBatch, ForwardMode
from plait.models.llama import LlamaMLP
from tests.distributed.test_row_collectives import _group

CFG = SimpleNamespace(hidden_size=16, intermediate_size=32)
COUNTS = {"equal": [12, 12], "uneven": [13, 9]}


def _sum_len_batch(counts: list[int]) -> ForwardBatch:
    empty = torch.empty(0, dtype=torch.int64)
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=0, input_ids=empty, req_pool_indices=empty,
                      seq_lens=empty, out_cache_loc=empty, positions=empty)
    fb.global_num_tokens_cpu = counts
    fb.dp_padding_mode = DPPaddingMode.SUM_LEN
    return fb


def _run_rank(port: int, rank: int) -> None:
    group = _group(port, rank)
    mlp = LlamaMLP(CFG, group, bias=False)
    gen = torch.Generator().manual_seed(rank)  # each rank's own shard
    for p in mlp.parameters():
        p.data = torch.randn(p.shape, generator=gen) / 4
    for counts in COUNTS.values():
        hidden = torch.randn(counts[rank], CFG.hidden_size, generator=torch.Generator().manual_seed(10 + rank))
        whole = dp_gathered_mlp(mlp, hidden, _sum_len_batch(counts), group, pipeline_rows=10**6)
        sliced = dp_gathered_mlp(mlp, hidden, _sum_len_batch(counts), group, pipeline_rows=4)  # 3 and 2 slices
        assert sliced.shape == (counts[rank], CFG.hidden_size)
        torch.testing.assert_close(sliced, whole, rtol=1e-5, atol=1e-6)


def test_sliced_sum_len_mlp_returns_the_rows_of_the_unsliced_one():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_run_rank, args=(port, 1))
    proc.start()
    try:
        _run_rank(port, 0)
        proc.join(60)
        assert proc.exitcode == 0  # rank 1's own assertions held
    finally:
        if proc.is_alive():
            proc.kill()
