"""Tensor parallelism's small all-reduces in one Triton kernel over symmetric memory (CUDA only).

Every row-parallel layer (attention's output projection, the MLP's down projection) ends in an
all-reduce of its activations: two per layer, 64 per llama-3.1-8b step. At decode sizes (8 KB at
batch 1, 2 MB at batch 256 on a hidden size of 4096) NCCL's ring kernels cost mostly latency. Here
one kernel pushes the rank's tensor into every peer's buffer, raises a flag per program there, waits
for the peers' flags and sums (``p2p_rows_kernels.all_reduce_kernel``); CUDA graphs capture it like
any kernel. Larger tensors (prefill chunks) stay on NCCL. SGLang and vLLM ship the same idea as
their "custom all-reduce".
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from plait.distributed.parallel_state import TPGroup
from plait.distributed.symmetric_memory import SymmetricGroup

logger = logging.getLogger(__name__)

MAX_BYTES = 8 << 20  # per call: decode batches up to 1024 rows of 4096 bf16; larger tensors use NCCL


class P2PAllReduce:
    """In-place sum over ``group`` of contiguous CUDA tensors of ``dtype`` up to ``MAX_BYTES``."""

    def __init__(self, group: TPGroup, store: Any, dtype: torch.dtype, device: torch.device) -> None:
        from plait.distributed import p2p_rows_kernels as kernels  # CUDA only: triton is imported here

        self.kernels = kernels
        self.rank, self.size, self.dtype = group.rank, group.size, dtype
        self.max_numel = MAX_BYTES // dtype.itemsize
        self.symmetric = SymmetricGroup(group, store, "all-reduce", device)
        # Two halves (alternate calls) of one slot per rank.
        buf, buf_handle = self.symmetric.tensor((2 * group.size * self.max_numel,), dtype)
        flags, flags_handle = self.symmetric.tensor((2 * group.size * kernels.MAX_PROGRAMS,), torch.int32)
        self.buf_table = self.symmetric.address_table(buf, buf_handle)
        self.flag_table = self.symmetric.address_table(flags, flags_handle)
        self.epochs = torch.zeros(kernels.MAX_PROGRAMS, dtype=torch.int32, device=device)  # calls per program
        self.symmetric.zero_flags(flags)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.dtype == self.dtype and x.is_contiguous() and 0 < x.numel() <= self.max_numel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        kernels = self.kernels
        _, span = kernels.launch_shape(x.numel())
        kernels.all_reduce_kernel[(kernels.MAX_PROGRAMS,)](
            x, self.buf_table, self.flag_table, self.epochs, x.numel(), span, self.max_numel,
            RANK=self.rank, WORLD=self.size, MAXP=kernels.MAX_PROGRAMS, BLOCK=kernels.BLOCK, num_warps=4)
        return x


def with_p2p_all_reduce(group: TPGroup, store: Any, dtype: torch.dtype, device: str) -> TPGroup:
    """``group`` with its small all-reduces on ``P2PAllReduce`` when this build and machine support it,
    else ``group`` itself (NCCL serves every all-reduce). Every rank decides alike: a build without
    symmetric memory fails on each rank, and mismatched rendezvous histories are refused on each."""
    if device != "cuda" or group.size == 1:
        return group
    try:
        here = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU, set by the caller
        return dataclasses.replace(group, p2p_all_reduce=P2PAllReduce(group, store, dtype, here))
    except Exception as e:  # noqa: BLE001 (no symmetric memory here: NCCL it is)
        logger.warning("custom all-reduce unavailable (%s: %s); tensor parallelism uses NCCL's", type(e).__name__, e)
        return group
