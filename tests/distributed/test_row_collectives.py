"""TPGroup.all_gather_rows / reduce_scatter_rows over gloo (rank 0 in the test's process, rank 1
spawned): the DP-attention MLP layout. Rank r's rows land at offset sum(counts[:r]) of the gathered
buffer, and the reduce-scatter returns to each rank the sums of exactly its own rows, for equal
counts, uneven counts and a rank with no rows (an IDLE rank in a SUM_LEN round)."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from plait.distributed.parallel_state import TPGroup
from tests.helpers import run_two_ranks, two_rank_group

CASES = {"equal": [3, 3], "uneven": [2, 5], "idle rank 0": [0, 4], "idle rank 1": [4, 0]}


def _rows(rank: int, count: int, device: str) -> torch.Tensor:
    """Rank r's rows: row i holds 100 * r + i in every column (exact in bf16 for these sizes)."""
    return (100.0 * rank + torch.arange(count, device=device)).unsqueeze(1).repeat(1, 3)


def _partials(rank: int, total: int, device: str) -> torch.Tensor:
    """Rank r's partial sums over the gathered rows: (r + 1) * row index."""
    return (rank + 1.0) * torch.arange(total, device=device).float().unsqueeze(1).repeat(1, 3)


def _check(group: TPGroup, counts: list[int], device: str) -> None:
    r = group.rank
    gathered = group.all_gather_rows(_rows(r, counts[r], device), counts)
    assert torch.equal(gathered, torch.cat([_rows(k, c, device) for k, c in enumerate(counts)]))
    mine = group.reduce_scatter_rows(_partials(r, sum(counts), device), counts)
    offset = sum(counts[:r])
    sums = _partials(0, sum(counts), device) + _partials(1, sum(counts), device)
    assert torch.equal(mine, sums[offset : offset + counts[r]])


def _run_rank(port: int, rank: int, nccl: bool) -> None:
    group = two_rank_group(port, rank, nccl)
    for counts in CASES.values():
        _check(group, counts, f"cuda:{rank}" if nccl else "cpu")


def run_both_ranks(nccl: bool) -> None:
    run_two_ranks(partial(_run_rank, nccl=nccl))


def test_rows_gather_at_rank_offsets_and_reduce_scatter_back_to_their_rank():
    run_both_ranks(nccl=False)


def test_gather_rejects_rows_that_disagree_with_the_rank_count():
    group = TPGroup(0, 2, group=object())  # never reached: the count check comes first
    with pytest.raises(ValueError, match="rank 0 passes 2 rows but its count is 3"):
        group.all_gather_rows(torch.zeros(2, 4), [3, 3])


def test_copy_engine_rows_are_cuda_only_so_cpu_rounds_keep_the_row_collectives():
    from datetime import timedelta

    from plait.distributed.copy_engine_rows import copy_engine_rows

    group = TPGroup(0, 2, group=object())  # never reached on the CPU
    assert copy_engine_rows(group, None, 8, 16, torch.float32, "cpu", timedelta(seconds=1)) is None
