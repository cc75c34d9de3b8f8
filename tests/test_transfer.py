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
