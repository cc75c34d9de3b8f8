"""The DP-attention round exchange over gloo, rank 0 in the test's process and rank 1 spawned: every
rank gets every rank's object, in rank order, whether a message fits the fixed-size all-gather or
overflows it (a round that admits many long prompts)."""

from __future__ import annotations

from plait.parallel.dp_attention import EXCHANGE_BYTES, exchange_objects
from tests.helpers import run_two_ranks, two_rank_group

SMALL = {"rank": 0, "adds": [1, 2, 3]}
LARGE = list(range(3 * EXCHANGE_BYTES))  # pickles to several times the fixed buffer


# What each rank sends in each of three exchanges: the first fits, then rank 1's overflows, then both.
SENT = {0: [SMALL, "rank 0", LARGE], 1: ["rank 1", LARGE, LARGE]}


def _rank(port: int, rank: int) -> None:
    group = two_rank_group(port, rank)
    got = [exchange_objects(group, obj) for obj in SENT[rank]]
    assert got == [[a, b] for a, b in zip(SENT[0], SENT[1], strict=True)]


def test_round_exchange_delivers_small_and_overflowing_messages_in_rank_order():
    run_two_ranks(_rank, timeout_s=30)
