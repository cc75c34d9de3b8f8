"""All-to-all row exchange over a TP group: what expert parallelism's all-to-all dispatch and
combine (plait.layers.moe.all_to_all) move.

Rank r sends ``send_counts[d]`` consecutive rows of its input to rank d (rows grouped by
destination, in rank order) and receives ``recv_counts[s]`` rows from every rank s, stacked in
source-rank order. The counts are exchanged first (``exchange_counts``, one small all-to-all), so
every rank knows its split sizes on the host before the row exchange; a rank with no rows (an IDLE
DP rank) passes empty tensors and still joins both. The split sizes are host lists, so this exchange
cannot be captured in a CUDA graph (its sizes change with the routing of every step).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from plait.distributed.parallel_state import TPGroup


def exchange_counts(group: TPGroup, send_counts: torch.Tensor) -> list[int]:
    """``send_counts`` [size] int64 (rows this rank sends to each rank) -> the rows every rank sends
    to this one, in source-rank order (host ints: the split sizes of ``all_to_all_rows``)."""
    if send_counts.shape != (group.size,):
        raise ValueError(f"send_counts must have one entry per rank ({group.size}), got {tuple(send_counts.shape)}")
    if group.size == 1:
        return send_counts.tolist()
    send = send_counts.to(torch.int64).contiguous()
    recv = torch.empty_like(send)
    group.group.alltoall_base(recv, send, [], [], dist.AllToAllOptions()).wait()
    return recv.tolist()


def all_to_all_rows(group: TPGroup, x: torch.Tensor, send_counts: list[int], recv_counts: list[int]) -> torch.Tensor:
    """``x`` [sum(send_counts), ...], its rows grouped by destination rank -> [sum(recv_counts), ...],
    the rows of every source rank in rank order (``torch.distributed.all_to_all_single`` with split
    sizes, on the group's backend object)."""
    if len(send_counts) != group.size or len(recv_counts) != group.size:
        raise ValueError(f"send_counts and recv_counts need one entry per rank ({group.size})")
    if x.shape[0] != sum(send_counts):
        raise ValueError(f"rank {group.rank} passes {x.shape[0]} rows but its send counts sum to {sum(send_counts)}")
    if group.size == 1:
        return x
    x = x.contiguous()
    out = x.new_empty(sum(recv_counts), *x.shape[1:])
    group.group.alltoall_base(out, x, list(recv_counts), list(send_counts), dist.AllToAllOptions()).wait()
    return out
