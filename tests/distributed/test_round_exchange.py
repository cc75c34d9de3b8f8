"""The DP-attention round exchange over gloo, rank 0 in the test's process and rank 1 spawned: every
rank gets every rank's object, in rank order, whether a message fits the fixed-size all-gather or
overflows it (a round that admits many long prompts)."""

from __future__ import annotations

import multiprocessing as mp
import socket
from datetime import timedelta

import torch.distributed as dist

from plait.distributed.dp_attention import EXCHANGE_BYTES, exchange_objects
from plait.distributed.parallel_state import TPGroup

SMALL = {"rank": 0, "adds": [1, 2, 3]}
LARGE = list(range(3 * EXCHANGE_BYTES))  # pickles to several times the fixed buffer


def _group(port: int, rank: int) -> TPGroup:
    store = dist.TCPStore("127.0.0.1", port, 2, is_master=rank == 0, timeout=timedelta(seconds=30))
    return TPGroup(rank, 2, dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30)))


def _rank1(port: int) -> None:
    group = _group(port, 1)
    got_small = exchange_objects(group, "rank 1")
    got_large = exchange_objects(group, LARGE)
    got_both = exchange_objects(group, LARGE)
    assert got_small == [SMALL, "rank 1"]
    assert got_large == ["rank 0", LARGE]
    assert got_both == [LARGE, LARGE]


def test_round_exchange_delivers_small_and_overflowing_messages_in_rank_order():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = mp.get_context("spawn").Process(target=_rank1, args=(port,))
    proc.start()
    try:
        group = _group(port, 0)
        assert exchange_objects(group, SMALL) == [SMALL, "rank 1"]
        assert exchange_objects(group, "rank 0") == ["rank 0", LARGE]
        assert exchange_objects(group, LARGE) == [LARGE, LARGE]
        proc.join(30)
        assert proc.exitcode == 0  # rank 1's own assertions held
    finally:
        if proc.is_alive():
            proc.kill()
