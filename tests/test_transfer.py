"""plait.transfer: host <-> device copies that do not wait for the whole GPU queue (on the CPU they
are plain copies with the same results)."""

from __future__ import annotations

import numpy as np
import torch

from plait.transfer import (
    PAGEABLE_MAX_BYTES,
    PendingHostCopy,
    copies_pageable,
    ints_and_bools_to_device,
    ints_to_device,
    wait_event,
)


def test_ints_to_device_splits_one_packed_copy_back_into_its_parts():
    a, b, c = ints_to_device([[1, 2], [], [3, 4, 5]], "cpu")
    assert a.tolist() == [1, 2] and b.tolist() == [] and c.tolist() == [3, 4, 5]
    assert a.dtype == torch.int64


def test_ints_and_bools_share_one_copy_and_keep_their_values():
    (ids,), mask = ints_and_bools_to_device([[7, -1]], np.array([True, False, True]), "cpu")
    assert ids.tolist() == [7, -1] and mask.tolist() == [True, False, True]


def test_a_pending_host_copy_holds_the_values_at_its_start():
    source = torch.tensor([1, 2, 3])
    pending = PendingHostCopy.start(source)
    source.fill_(0)  # what a later forward writing the same buffer does
    assert pending.wait().tolist() == [1, 2, 3]


def test_only_small_copies_skip_pinned_memory_and_only_with_the_switch_on(monkeypatch):
    small, large = torch.zeros(8, dtype=torch.int64), torch.zeros(PAGEABLE_MAX_BYTES // 8 + 1, dtype=torch.int64)
    assert copies_pageable(small)  # the default
    assert not copies_pageable(large)
    monkeypatch.setenv("PLAIT_PAGEABLE_H2D", "0")
    assert not copies_pageable(small)


class _Event:
    """Stands in for a CUDA event (none on the CPU): completes at its ``ready_after``-th query."""

    def __init__(self, ready_after: int) -> None:
        self.queries, self.ready_after, self.synchronized = 0, ready_after, False

    def query(self) -> bool:
        self.queries += 1
        return self.queries >= self.ready_after

    def synchronize(self) -> None:
        self.synchronized = True


def test_a_spin_wait_polls_the_event_until_it_completes(monkeypatch):
    monkeypatch.setenv("PLAIT_SPIN_WAIT", "1")
    event = _Event(ready_after=3)
    wait_event(event)
    assert event.queries == 3 and not event.synchronized


def test_without_the_switch_a_wait_blocks_in_synchronize():
    event = _Event(ready_after=3)
    wait_event(event)
    assert event.synchronized and event.queries == 0
