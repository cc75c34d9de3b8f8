"""Host-to-device copies that do not stall the host behind the GPU queue (ground floor: the
scheduler, samplers, speculative workers and ForwardBatch all use them).

A blocking ``.to("cuda")`` waits for the copy, queued behind the batch still running on the GPU (overlap
scheduling builds the next batch meanwhile). These copies are non-blocking: from pinned memory, which
the caching host allocator keeps alive until the copy is done, or (PLAIT_PAGEABLE_H2D) small ones from
pageable memory, which the driver stages before the call returns.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from plait import envs

# With PLAIT_PAGEABLE_H2D, copies up to this size skip pinned memory: a non-blocking copy from pageable
# memory returns once the driver has staged the bytes (the source may go at once) and, measured on an
# H200's host, did not wait for queued work; pinning costs a copy its allocator's event bookkeeping.
PAGEABLE_MAX_BYTES = 64 * 1024


def copies_pageable(t: torch.Tensor) -> bool:
    """Whether host tensor ``t`` goes to the device from where it is (small, PLAIT_PAGEABLE_H2D on)
    rather than through pinned memory."""
    return t.numel() * t.element_size() <= PAGEABLE_MAX_BYTES and envs.PAGEABLE_H2D.get()


def _staged(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the source of an asynchronous host-to-device copy."""
    return t if copies_pageable(t) else t.pin_memory()


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return _staged(t).to(device, non_blocking=True)


def copy_to_device_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a host ``src``: asynchronous on CUDA (one copy into ``dst``'s own
    storage, e.g. a graph's static buffer)."""
    if dst.device.type != "cuda":
        return dst.copy_(src)
    return dst.copy_(_staged(src), non_blocking=True)


def ints_to_device(parts: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Several int lists as int64 device tensors, through one packed copy (one launch, not one each)."""
    flat = to_device(torch.from_numpy(_packed_ints(parts)), device)
    return flat.split_with_sizes([len(part) for part in parts])


def _packed_ints(parts: Sequence[Sequence[int]]) -> np.ndarray:
    """The parts concatenated as one int64 array (``np.fromiter``: several times faster than
    ``torch.tensor`` of a list)."""
    return np.fromiter(itertools.chain.from_iterable(parts), dtype=np.int64, count=sum(len(p) for p in parts))


def ints_and_bools_to_device(parts: Sequence[Sequence[int]], bools: np.ndarray, device: torch.device | str
                             ) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """``ints_to_device(parts)`` and a bool array (e.g. an attention mask) through one packed copy:
    int64 bytes first (offset 0 keeps their alignment), the bools after them."""
    n = sum(len(part) for part in parts)
    buf = np.concatenate([_packed_ints(parts).view(np.uint8), bools.reshape(-1).view(np.uint8)])
    flat = to_device(torch.from_numpy(buf), device)
    ints = flat[: 8 * n].view(torch.int64).split_with_sizes([len(part) for part in parts])
    return ints, flat[8 * n :].view(torch.bool)


def to_host(t: torch.Tensor) -> np.ndarray:
    """A device tensor as a numpy array, through pinned memory on CUDA: a pageable ``.cpu()`` of
    tens of MB (full-vocabulary probability rows) goes through a staging copy and runs far below
    what the host link carries."""
    return host_tensor(t).numpy()


def host_tensor(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself off CUDA; on CUDA its copy in pinned memory, read back once the current stream
    has run everything queued on it."""
    if t.device.type != "cuda":
        return t
    pending = PendingHostCopy.start(t)
    pending.wait()
    return pending.host


def pinned_copy(t: torch.Tensor) -> torch.Tensor:
    """A new pinned host tensor that a CUDA ``t`` is copied into, queued on the current stream (not
    waited for: the caller synchronises, or records an event, before reading it)."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class PendingHostCopy:
    """A device tensor's copy into pinned host memory, queued on the stream when started: ``wait``
    blocks until this copy has landed, not until the work queued after it is done (``to_host`` waits
    for the whole stream)."""

    host: torch.Tensor
    event: torch.cuda.Event | None  # None on the CPU: ``host`` is a clone, done at the start

    @classmethod
    def start(cls, t: torch.Tensor) -> PendingHostCopy:
        if t.device.type != "cuda":
            return cls(t.clone(), None)
        host = pinned_copy(t)
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def wait(self) -> np.ndarray:
        if self.event is not None:
            self.event.synchronize()
        return self.host.numpy()
