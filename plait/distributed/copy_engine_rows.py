"""The DP-attention row exchange over torch symmetric memory (CUDA only): copy engines for SUM_LEN
rounds (below), SM kernels for MAX_LEN ones (``CopyEngineRows.mlp_equal``, ``p2p_rows_kernels``).

A SUM_LEN round (a prefill chunk on some rank) gathers every rank's rows before the sharded MLP and
reduce-scatters the partial sums after it: at thousands of rows per rank that is tens of MB each way
per layer, NCCL time that nothing hides. NCCL's collectives are kernels on the SMs, and running them
beside the GEMMs slowed the layer more than it hid (``dp_mlp``). Here the rows
move by cudaMemcpy into buffers that every rank maps (``_SymmetricMemory``): the copy engines carry
them while the SMs compute, and a one-thread kernel signals the peer that its rows have landed.

One MLP on rank r (``n`` own rows; the buffers hold ``max_rows`` rows per rank):
  1. side stream: copy the own rows into every peer's gather buffer at row ``r * max_rows``, then
     signal the peer (channel 0);
  2. main stream: partial sums of the first half of the own rows (overlaps 1);
  3. main: wait for every peer's rows (channel 0), then the partial sums of each peer's rows;
  4. side: copy each peer's share of those partial sums into its reduce buffer at row
     ``r * max_rows``, then signal it (channel 1);
  5. main: partial sums of the second half of the own rows (overlaps 4);
  6. main: wait for every peer's share (channel 1); the own rows' sums are the own partials plus the
     shares (for two ranks one bf16 add, the same numbers as NCCL's reduce-scatter).

No double buffering is needed: a peer writes layer L+1's rows into this rank's gather buffer only
after its main stream waited for this rank's layer-L shares (its step 6), which this rank's side
stream copies only after the main stream read layer L's gathered rows (step 4 waits for step 3);
the reduce buffer is reused after the same kind of round trip (a peer's step 4 of layer L+1 follows
its step 3, which waits for this rank's step 1 of layer L+1, issued after this rank's step 6 of L).
"""

from __future__ import annotations

import logging
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch

from plait.distributed.parallel_state import TPGroup
from plait.distributed.symmetric_memory import SymmetricGroup

if TYPE_CHECKING:
    from plait.distributed.dp_mlp import ShardedMLP

logger = logging.getLogger(__name__)

ROWS, SHARES = 0, 1  # signal channels


class CopyEngineRows:
    """The symmetric gather and reduce buffers of one DP-attention rank, and the MLP that uses them."""

    def __init__(self, group: TPGroup, store: Any, max_rows: int, hidden_size: int, dtype: torch.dtype,
                 device: torch.device, timeout: timedelta) -> None:
        from plait.distributed import p2p_rows_kernels as kernels  # CUDA only: triton is imported here

        self.kernels = kernels
        self.rank, self.size, self.max_rows = group.rank, group.size, max_rows
        self.timeout_ms = int(timeout.total_seconds() * 1000)
        self.symmetric = SymmetricGroup(group, store, "rows", device)  # one fresh name per engine
        self.gather, self.gather_handle = self.symmetric.tensor((group.size * max_rows, hidden_size), dtype)
        self.reduce, self.reduce_handle = self.symmetric.tensor((group.size * max_rows, hidden_size), dtype)
        if not all(hasattr(self.gather_handle, op) for op in ("get_buffer", "put_signal", "wait_signal")):
            raise RuntimeError("this torch's symmetric memory has no put_signal / wait_signal")
        self.side = torch.cuda.Stream(device)
        # MAX_LEN rounds: the kernels find every rank's buffers and flags through tables of addresses.
        flags, flags_handle = self.symmetric.tensor((kernels.CHANNELS * group.size * kernels.MAX_PROGRAMS,),
                                                    torch.int32)
        self.gather_table = self.symmetric.address_table(self.gather, self.gather_handle)
        self.reduce_table = self.symmetric.address_table(self.reduce, self.reduce_handle)
        self.flag_table = self.symmetric.address_table(flags, flags_handle)
        self.symmetric.zero_flags(flags)

    def fits(self, counts: list[int]) -> bool:
        return max(counts) <= self.max_rows

    def _peer_rows(self, handle: Any, peer: int, rows: int) -> torch.Tensor:
        """Rows [r * max_rows, r * max_rows + rows) of ``peer``'s buffer, r being this rank."""
        hidden = self.gather.shape[1]
        return handle.get_buffer(peer, (rows, hidden), self.gather.dtype, self.rank * self.max_rows * hidden)

    def mlp_equal(self, mlp: ShardedMLP, hidden: torch.Tensor) -> torch.Tensor:
        """The same MLP for a MAX_LEN round, every rank holding ``n`` rows (a decode graph's bucket),
        with SM kernels instead of copy engines (``p2p_rows_kernels``: each stores into the peers'
        buffers and flags them): the rows meet contiguously at ``r * n`` of the gather buffer, one GEMM
        runs over all of them, and a second kernel sends the peers their partial sums and adds the
        ones sent here. Two launches on the current stream and no host sync, so decode graphs
        capture it.

        Buffer reuse: a peer stores layer L+1's rows here only after its reduce kernel of layer L saw
        this rank's flag, raised after this rank's GEMM of L had read the gather buffer; and stores its
        shares of L+1 only after its gather kernel of L+1 saw this rank's flag, raised after this rank's
        reduce kernel of L had read the reduce buffer."""
        n, hidden_size = hidden.shape
        numel = n * hidden_size
        hidden = hidden.contiguous()
        kernels = self.kernels
        nprog, span = kernels.launch_shape(numel)
        consts = {"RANK": self.rank, "WORLD": self.size, "MAXP": kernels.MAX_PROGRAMS, "BLOCK": kernels.BLOCK,
                  "num_warps": 4}
        kernels.gather_rows_kernel[(nprog,)](hidden, self.gather_table, self.flag_table, numel, span, **consts)
        partial = mlp.forward_partial(self.gather[: self.size * n])
        out = torch.empty_like(hidden)
        kernels.reduce_rows_kernel[(nprog,)](partial, out, self.reduce_table, self.flag_table, numel, span, **consts)
        return mlp.add_bias(out)

    def mlp(self, mlp: ShardedMLP, hidden: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """This rank's rows of the sharded MLP over every rank's rows (bias added)."""
        main = torch.cuda.current_stream()
        peers = [p for p in range(self.size) if p != self.rank]
        n = hidden.shape[0]
        hidden = hidden.contiguous()
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):  # 1
            for p in peers:
                if n:
                    self._peer_rows(self.gather_handle, p, n).copy_(hidden, non_blocking=True)
                self.gather_handle.put_signal(p, ROWS, self.timeout_ms)
        half = n // 2
        own = [mlp.forward_partial(hidden[:half])] if half else []  # 2
        shares = []
        for p in peers:  # 3
            self.gather_handle.wait_signal(p, ROWS, self.timeout_ms)
            rows = self.gather[p * self.max_rows : p * self.max_rows + counts[p]]
            shares.append(mlp.forward_partial(rows) if counts[p] else rows)
        self.side.wait_stream(main)
        with torch.cuda.stream(self.side):  # 4
            for p, share in zip(peers, shares, strict=True):
                if counts[p]:
                    self._peer_rows(self.reduce_handle, p, counts[p]).copy_(share, non_blocking=True)
                self.reduce_handle.put_signal(p, SHARES, self.timeout_ms)
        if n:
            own.append(mlp.forward_partial(hidden[half:]))  # 5
        out = torch.cat(own) if n else hidden
        for p in peers:  # 6
            self.reduce_handle.wait_signal(p, SHARES, self.timeout_ms)
            if n:
                out += self.reduce[p * self.max_rows : p * self.max_rows + n]
        # The side stream read ``hidden`` and the shares: nothing may reuse them before it is done.
        main.wait_stream(self.side)
        return mlp.add_bias(out)


def copy_engine_rows(group: TPGroup, store: Any, max_rows: int, hidden_size: int, dtype: torch.dtype,
                     device: str, timeout: timedelta) -> CopyEngineRows | None:
    """The exchange when this build and machine support it, else None (NCCL serves every round).
    The ranks agree: a torch build or driver without symmetric memory fails on every rank alike, and
    a rank that fails alone before the rendezvous (its buffers do not fit) leaves the others'
    rendezvous to time out on the store, so they fall back too, only later."""
    if device != "cuda" or group.size == 1:
        return None
    try:
        here = torch.device("cuda", torch.cuda.current_device())  # the rank's GPU, set at launch
        return CopyEngineRows(group, store, max_rows, hidden_size, dtype, here, timeout)
    except Exception as e:  # noqa: BLE001 (no symmetric memory here: NCCL it is)
        logger.warning("symmetric-memory row exchange unavailable (%s: %s); every round uses NCCL",
                       type(e).__name__, e)
        return None
