"""Host-to-device copies that do not stall the host behind the GPU queue (ground floor: the
scheduler, samplers, speculative workers and ForwardBatch all use them).

A plain ``.to("cuda")`` from pageable memory synchronises the stream, which would make the host wait
for the batch still running on the GPU (overlap scheduling builds the next batch meanwhile). Pinned
memory allows an asynchronous copy; the caching host allocator keeps the buffer alive until it is done.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def to_device(t: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def copy_to_device_(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``dst.copy_(src)`` for a host ``src``: pinned and asynchronous on CUDA (one copy into ``dst``'s
    own storage, e.g. a graph's static buffer)."""
    if dst.device.type != "cuda":
        return dst.copy_(src)
    return dst.copy_(src.pin_memory(), non_blocking=True)


def ints_to_device(parts: Sequence[Sequence[int]], device: torch.device | str) -> tuple[torch.Tensor, ...]:
    """Several int lists as int64 device tensors, through one packed copy (one launch, not one each)."""
    flat = to_device(torch.tensor([x for part in parts for x in part], dtype=torch.int64), device)
    return flat.split([len(part) for part in parts])


def to_host(t: torch.Tensor) -> np.ndarray:
    """A device tensor as a numpy array, through pinned memory on CUDA: a pageable ``.cpu()`` of
    tens of MB (full-vocabulary probability rows) goes through a staging copy and runs far below
    what the host link carries."""
    if t.device.type != "cuda":
        return t.numpy()
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    torch.cuda.current_stream(t.device).synchronize()
    return host.numpy()
