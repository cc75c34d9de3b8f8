"""Device time of the DP-attention MLP collectives (TPGroup.all_gather_rows / reduce_scatter_rows,
llama-3.1-8b rows of 4096 bf16) on two GPUs, under the NCCL environment this process was started
with, so that protocol and channel settings can be compared run against run:

    NCCL_NVLS_ENABLE=0 [NCCL_PROTO=...] python benchmarks/nccl_rows_bench.py OUT_JSON LABEL

Rows per rank: 128 and 256 (decode rounds), 2048 and 8192 (prefill rounds). Each figure is the mean
of 100 back-to-back collectives between CUDA events on rank 0 (eager launches: below ~1 MB they
measure launch cost more than NCCL). Then one whole DP-attention MLP of a SUM_LEN round (8192 rows per
rank, llama-3.1-8b's MLP sharded over the two GPUs) in 1, 2 and 4 row slices (plait.distributed.dp_mlp)."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import socket
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from plait.distributed.dp_mlp import dp_gathered_mlp
from plait.distributed.parallel_state import TPGroup
from plait.forward_batch import DPPaddingMode, ForwardBatch, ForwardMode
from plait.models.llama import LlamaMLP

ROWS = [128, 256, 2048, 8192]
HIDDEN = 4096


def _mlp_round_us(group: TPGroup, rows: int = 8192) -> dict[str, float]:
    from types import SimpleNamespace

    mlp = LlamaMLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=14336), group, bias=False)
    mlp = mlp.to(device="cuda", dtype=torch.bfloat16)
    for p in mlp.parameters():
        p.data.normal_(0, 0.02)
    hidden = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
    empty = torch.empty(0, dtype=torch.int64, device="cuda")
    fb = ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=0, input_ids=empty, req_pool_indices=empty,
                      seq_lens=empty, out_cache_loc=empty, positions=empty)
    fb.global_num_tokens_cpu = [rows] * group.size
    fb.dp_padding_mode = DPPaddingMode.SUM_LEN
    return {f"{rows // slice_rows} slices": _time_us(lambda: dp_gathered_mlp(mlp, hidden, fb, group, slice_rows),  # noqa: B023
                                                      iters=20)
            for slice_rows in (rows, rows // 2, rows // 4)}


def _time_us(fn, iters: int = 100) -> float:
    for _ in range(10):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return 1e3 * start.elapsed_time(end) / iters


def _rank(port: int, rank: int, out: str | None, label: str) -> None:
    torch.cuda.set_device(rank)
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=60))
    group = TPGroup(rank, 2, dist.ProcessGroupNCCL(store, rank, 2, dist.ProcessGroupNCCL.Options()))
    result = {}
    for rows in ROWS:
        x = torch.randn(rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        y = torch.randn(2 * rows, HIDDEN, device="cuda", dtype=torch.bfloat16)
        counts = [rows, rows]
        result[rows] = {"all_gather_us": _time_us(lambda: group.all_gather_rows(x, counts)),  # noqa: B023
                        "reduce_scatter_us": _time_us(lambda: group.reduce_scatter_rows(y, counts))}  # noqa: B023
    mlp = _mlp_round_us(group)
    if out:
        result["mlp_8192_rows_per_rank_us"] = mlp
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
