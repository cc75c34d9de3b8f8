"""Device time of the DP-attention MLP collectives (TPGroup.all_gather_rows / reduce_scatter_rows,
llama-3.1-8b rows of 4096 bf16) on two GPUs, under the NCCL environment this process was started
with, so that protocol and channel settings can be compared run against run:

    NCCL_NVLS_ENABLE=0 [NCCL_PROTO=...] python benchmarks/nccl_rows_bench.py OUT_JSON LABEL

Rows per rank: 128 and 256 (decode rounds), 2048 and 8192 (prefill rounds). Each figure is the mean
of 100 back-to-back collectives between CUDA events on rank 0 (eager launches: below ~1 MB they
measure launch cost more than NCCL; in a captured decode graph a 128-row gather takes ~19 us).
Then one whole DP-attention MLP layer of a SUM_LEN round (8192 rows per rank, llama-3.1-8b's MLP
sharded over the two GPUs, random weights) with NCCL's gather and reduce-scatter and with the
copy-engine row exchange (plait.distributed.copy_engine_rows). Last, per layer of a CUDA graph of 32
MLP layers of a decode round (128 rows per rank), NCCL against the symmetric-memory kernels; and per
call, a CUDA graph of 64 tensor-parallel all-reduces of 1, 128 and 256 rows, NCCL against the custom
all-reduce kernel (plait.distributed.p2p_all_reduce)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
from dataclasses import replace
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from plait.bench.hardware import seconds_per_call
from plait.distributed.copy_engine_rows import CopyEngineRows
from plait.distributed.dp_mlp import dp_gathered_mlp
from plait.distributed.parallel_state import TPGroup
from plait.executor.cuda_graph_runner import CudaGraph, warm_and_capture
from plait.forward_batch import DPPaddingMode, ForwardBatch, ForwardMode
from plait.models.llama import LlamaMLP

ROWS = [128, 256, 2048, 8192]
HIDDEN = 4096


def _mlp_layer_us(group: TPGroup, exchange: CopyEngineRows, rows: int = 8192) -> dict[str, float]:
    mlp, hidden, fb = _mlp_round(group, rows, DPPaddingMode.SUM_LEN)
    out = {}
    for name, via in (("nccl", None), ("copy_engine", exchange)):
        fb.dp_row_exchange = via
        out[name] = _time_us(lambda: dp_gathered_mlp(mlp, hidden, fb, group), iters=20)  # noqa: B023
    return out


def _decode_graph_mlp_us(group: TPGroup, exchange: CopyEngineRows, rows: int = 128, layers: int = 32
                         ) -> dict[str, float]:
    """Per layer: a CUDA graph of ``layers`` MLPs of a MAX_LEN decode round (``rows`` per rank),
    replayed, with NCCL's collectives and with the symmetric-memory kernels (``CopyEngineRows.mlp_equal``)."""
    mlp, hidden, fb = _mlp_round(group, rows, DPPaddingMode.MAX_LEN)
    out = {}
    for name, via in (("nccl", None), ("p2p_kernels", exchange)):
        fb.dp_row_exchange = via

        def stack() -> torch.Tensor:
            x = hidden
            for _ in range(layers):
                x = dp_gathered_mlp(mlp, x, fb, group)
            return x

        out[name] = _graph_us(stack) / layers
    return out


def _all_reduce_graph_us(group: TPGroup, store: dist.Store, calls: int = 64) -> dict[str, dict[str, float]]:
    """Per call: a CUDA graph of ``calls`` in-place all-reduces (a tp 2 decode step has 64) of a decode
    step's activations (1, 128 and 256 rows of 4096 bf16), NCCL against ``P2PAllReduce``."""
    from plait.distributed.p2p_all_reduce import P2PAllReduce

    fast = replace(group, p2p_all_reduce=P2PAllReduce(group, store, torch.bfloat16,
                                                      torch.device("cuda", group.rank)))
    out = {}
    for rows in (1, 128, 256):
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16) / 64
        times = {}
        for name, g in (("nccl", group), ("p2p_kernel", fast)):

            def chain(g: TPGroup = g) -> None:
                for _ in range(calls):
                    g.all_reduce(x)  # noqa: B023

            times[name] = _graph_us(chain) / calls
        out[f"{rows}_rows"] = times
    return out


def _graph_us(fn: Any) -> float:
    """Device time of one replay of a CUDA graph of ``fn`` (warmed up and captured as the engine does)."""
    graph = CudaGraph()
    warm_and_capture(graph, fn, None, sync=True)
    return _time_us(graph.replay, iters=20)


def _mlp_round(group: TPGroup, rows: int, mode: DPPaddingMode) -> tuple[LlamaMLP, torch.Tensor, ForwardBatch]:
    """llama-3.1-8b's MLP sharded over the group (random weights), ``rows`` random rows on this rank,
    and the batch of a round with ``rows`` on every rank in padding mode ``mode``."""
    from types import SimpleNamespace

    mlp = LlamaMLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=14336), group, bias=False)
    mlp = mlp.to(device="cuda", dtype=torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_(0, 0.02)
    empty = torch.empty(0, dtype=torch.int64, device="cuda")
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=0, input_ids=empty, req_pool_indices=empty,
                      seq_lens=empty, out_cache_loc=empty, positions=empty)
    fb.mlp_sync.global_num_tokens_cpu, fb.mlp_sync.padding_mode = [rows] * group.size, mode
    return mlp, torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16), fb


def _time_us(fn, iters: int = 100) -> float:
    return 1e6 * seconds_per_call(fn, iters)


def _rank(port: int, rank: int, out: str | None, label: str) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    group = TPGroup(rank, 2, dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, 2,
                                                   dist.ProcessGroupNCCL.Options()))
    result = {}
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(2 * rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        counts = [rows, rows]
        result[rows] = {"all_gather_us": _time_us(lambda: group.all_gather_rows(x, counts)),  # noqa: B023
                        "reduce_scatter_us": _time_us(lambda: group.reduce_scatter_rows(y, counts))}  # noqa: B023
    # One exchange (one symmetric-memory group) serves both: its buffers hold 8192 rows per rank.
    exchange = CopyEngineRows(group, store, 8192, HIDDEN, torch.bfloat16, torch.device("cuda", rank),
                              timedelta(seconds=60))
    result["mlp_layer_8192_rows_per_rank_us"] = _mlp_layer_us(group, exchange)
    result["decode_graph_mlp_layer_128_rows_per_rank_us"] = _decode_graph_mlp_us(group, exchange)
    result["tp_all_reduce_in_graph_us"] = _all_reduce_graph_us(group, store)
    if out:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        print(label, json.dumps(result))
        with open(out, "a") as f:
            f.write(json.dumps({"label": label, "env": env, "rows_per_rank": result}) + "\n")


def main() -> None:
    out, label = sys.argv[1], sys.argv[2]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_rank, args=(port, 1, None, label))
    proc.start()
    _rank(port, 0, out, label)
    proc.join(60)


if __name__ == "__main__":
    main()
