"""Symmetric memory for plait's own collectives (CUDA only): buffers that every rank of a group maps,
so that a copy engine or a kernel on one GPU writes straight into a peer's memory.

Built on torch's ``_SymmetricMemory`` (the layer under ``torch.distributed._symmetric_memory``):
its rendezvous resolves a process group by name in c10d's registry, which plait otherwise never
touches, so each ``SymmetricGroup`` registers a ProcessGroup over its TPGroup's NCCL backend under a
fresh name and keeps a reference to it (the registry holds it weakly).
"""

from __future__ import annotations

import uuid
from typing import Any

import torch
import torch.distributed as dist

from plait.distributed.parallel_state import TPGroup

# Symmetric memory numbers its store exchanges with one process-wide sequence, so a rendezvous pairs up
# only between processes that made the same number of them before: an engine's rank 0 is the caller's
# long-lived process, while its other ranks are spawned fresh per engine. Every rendezvous counts here,
# and ranks whose counts differ refuse together (the callers fall back to NCCL) instead of waiting out
# the store timeout on keys that never come.
_rendezvous_in_process = 0


class SymmetricGroup:
    """One symmetric-memory group over ``group`` (NCCL): allocates buffers every rank maps and builds
    the tables of their addresses that kernels index by rank."""

    def __init__(self, group: TPGroup, store: Any, purpose: str, device: torch.device) -> None:
        self.group, self.device = group, device
        name_key = f"plait/symmetric/{purpose}/name"
        if group.rank == 0:
            store.set(name_key, f"plait-{purpose}-{uuid.uuid4().hex}")
        self.name = store.get(name_key).decode()
        store.set(f"{self.name}/rendezvous/{group.rank}", str(_rendezvous_in_process))
        done = [int(store.get(f"{self.name}/rendezvous/{r}")) for r in range(group.size)]
        if len(set(done)) > 1:
            raise RuntimeError(f"the ranks' processes made {done} symmetric-memory rendezvous before this group; "
                               "they pair up only between processes with equal counts")
        self.process_group = _register_group(self.name, group, store)
        from torch._C._distributed_c10d import _SymmetricMemory

        _SymmetricMemory.set_group_info(self.name, group.rank, group.size, dist.PrefixStore(self.name, store))
        # Every buffer, its handle and the peer views the address tables point into live as long as
        # the group: a dropped handle unmaps the peers' memory under kernels that still use it.
        self._owned: list[Any] = []

    def tensor(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[torch.Tensor, Any]:
        """A new buffer of ``shape`` on every rank (contiguous) and its rendezvous handle."""
        from torch._C._distributed_c10d import _SymmetricMemory

        global _rendezvous_in_process
        stride, step = [], 1
        for extent in reversed(shape):
            stride.insert(0, step)
            step *= extent
        t = _SymmetricMemory.empty_strided_p2p(shape, tuple(stride), dtype, self.device, self.name)
        _rendezvous_in_process += 1
        handle = _SymmetricMemory.rendezvous(t)
        self._owned.append((t, handle))
        return t, handle

    def address_table(self, t: torch.Tensor, handle: Any) -> torch.Tensor:
        """int64 [size]: entry r is the address of rank r's ``t`` as mapped here."""
        views = [handle.get_buffer(r, (t.numel(),), t.dtype, 0) for r in range(self.group.size)]
        self._owned.extend(views)
        return torch.tensor([v.data_ptr() for v in views], dtype=torch.int64, device=self.device)

    def zero_flags(self, flags: torch.Tensor) -> None:
        """Lower every flag here, then wait until every rank has: no peer raises one before."""
        flags.zero_()
        torch.cuda.synchronize(self.device)
        self.group.all_reduce(torch.zeros(1, device=self.device))
        torch.cuda.synchronize(self.device)


def _register_group(name: str, group: TPGroup, store: Any) -> Any:
    """Register a ProcessGroup over ``group``'s NCCL backend under ``name`` in c10d's registry."""
    from torch._C._distributed_c10d import ProcessGroup, _register_process_group

    pg = ProcessGroup(dist.PrefixStore(f"{name}/pg", store), group.rank, group.size)
    pg._register_backend(torch.device("cuda"), ProcessGroup.BackendType.NCCL, group.group)
    pg._set_default_backend(ProcessGroup.BackendType.NCCL)
    pg._set_group_name(name)
    _register_process_group(name, pg)
    return pg
