"""Triton kernels that move activations between ranks through symmetric memory (CUDA only): a decode
round's MLP rows between DP-attention ranks, and tensor parallelism's small all-reduces. Every rank
maps every peer's buffers, so a kernel stores straight into a peer's memory over NVLink and raises a
flag there.

Why not NCCL: a decode round moves about a megabyte each way per layer, where NCCL's ring kernels
cost mostly latency, two collectives per layer. Copy-engine copies plus signal kernels
(``CopyEngineRows.mlp``) were no better at this size in a captured graph, and slower in the engine,
since each copy and each signal is its own graph node.

Synchronisation is blockwise, without any grid-wide barrier: program ``b`` of every rank handles the
same span of elements (the ranks launch the same grid on the same sizes, as MAX_LEN rounds guarantee), so
program ``b`` only waits for program ``b`` of each peer. A flag is one int32 per (channel, source
rank, program) on the receiving rank: the source sets it to 1 after its stores (a CTA barrier, then a
release at system scope), the receiver swaps it back to 0 with an acquiring compare-and-swap. A
flag is set again only after a full round trip (see ``CopyEngineRows.mlp_equal``), so 0/1 suffices.
Every program of a launch must be resident at once (a spinning program waits for a peer's program
of the same index): grids stay at most ``MAX_PROGRAMS``, far below the SM count. The wait has no
timeout: a rank that dies mid-round leaves its peers' kernels spinning, as an NCCL collective without
its watchdog would block.
"""

from __future__ import annotations

import triton
import triton.language as tl

MAX_PROGRAMS = 64
BLOCK = 4096  # elements per program per iteration
CHANNELS = 2  # flag channels: 0 the gather, 1 the reduce


@triton.jit
def _peer_ptr(table, rank, dtype: tl.constexpr):
    """Rank ``rank``'s buffer base, from a table of device addresses (int64, one per rank)."""
    return tl.load(table + rank).to(tl.pointer_type(dtype))


@triton.jit
def _signal_then_wait(flag_table, channel, pid, RANK: tl.constexpr, WORLD: tl.constexpr, MAXP: tl.constexpr):
    """After this program's stores to every peer: raise its flag on each peer, then wait for each peer's
    program ``pid`` to raise this rank's."""
    tl.debug_barrier()  # every thread's stores happen before the releasing flag store below
    for p in tl.static_range(WORLD):
        if p != RANK:
            peer_flags = _peer_ptr(flag_table, p, tl.int32)
            tl.atomic_xchg(peer_flags + (channel * WORLD + RANK) * MAXP + pid, 1, sem="release", scope="sys")
    own_flags = _peer_ptr(flag_table, RANK, tl.int32)
    for p in tl.static_range(WORLD):
        if p != RANK:
            slot = own_flags + (channel * WORLD + p) * MAXP + pid
            seen = tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys")
            while seen != 1:
                seen = tl.atomic_cas(slot, 1, 0, sem="acquire", scope="sys")
    tl.debug_barrier()  # the rest of the program runs after the acquire


@triton.jit
def gather_rows_kernel(src, gather_table, flag_table, slot_numel, span, RANK: tl.constexpr, WORLD: tl.constexpr,
                       MAXP: tl.constexpr, BLOCK: tl.constexpr):
    """``src`` (this rank's rows, ``slot_numel`` elements) to elements [RANK * slot_numel, +slot_numel)
    of every rank's gather buffer, this one's included; returns once every peer's rows have landed
    here (the program's share of them; the launch's end covers all)."""
    pid = tl.program_id(0)
    dtype = src.dtype.element_ty
    for i in range(0, span, BLOCK):
        offs = pid * span + i + tl.arange(0, BLOCK)
        mask = offs < slot_numel
        x = tl.load(src + offs, mask=mask)
        for p in tl.static_range(WORLD):
            tl.store(_peer_ptr(gather_table, p, dtype) + RANK * slot_numel + offs, x, mask=mask)
    _signal_then_wait(flag_table, 0, pid, RANK, WORLD, MAXP)


@triton.jit
def reduce_rows_kernel(partial, out, reduce_table, flag_table, slot_numel, span, RANK: tl.constexpr,
                       WORLD: tl.constexpr, MAXP: tl.constexpr, BLOCK: tl.constexpr):
    """``partial`` holds every rank's rows (rank p's at [p * slot_numel, +slot_numel)): send each peer
    its rows into slot RANK of its reduce buffer, wait for the peers' shares of this rank's rows, and
    write their sum with this rank's own partial rows to ``out`` (fp32 accumulation, one rounding)."""
    pid = tl.program_id(0)
    dtype = partial.dtype.element_ty
    for i in range(0, span, BLOCK):
        offs = pid * span + i + tl.arange(0, BLOCK)
        mask = offs < slot_numel
        for p in tl.static_range(WORLD):
            if p != RANK:
                x = tl.load(partial + p * slot_numel + offs, mask=mask)
                tl.store(_peer_ptr(reduce_table, p, dtype) + RANK * slot_numel + offs, x, mask=mask)
    _signal_then_wait(flag_table, 1, pid, RANK, WORLD, MAXP)
    own = _peer_ptr(reduce_table, RANK, dtype)
    for i in range(0, span, BLOCK):
        offs = pid * span + i + tl.arange(0, BLOCK)
        mask = offs < slot_numel
        acc = tl.load(partial + RANK * slot_numel + offs, mask=mask).to(tl.float32)
        for p in tl.static_range(WORLD):
            if p != RANK:
                # .cg: past L1, which may hold this buffer's lines from the previous layer.
                acc += tl.load(own + p * slot_numel + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        tl.store(out + offs, acc.to(dtype), mask=mask)


@triton.jit
def all_reduce_kernel(x, buf_table, flag_table, epochs, numel, span, slot_numel, RANK: tl.constexpr,
                      WORLD: tl.constexpr, MAXP: tl.constexpr, BLOCK: tl.constexpr):
    """In-place sum of ``x`` over the ranks (one shot: each rank pushes its ``x`` into every peer's
    buffer, then sums what arrived, in rank order, so every rank gets the same bits).

    Unlike the MLP kernels, the arrived data is read in the same launch that raised the flags, so a
    peer's next call may land while this one still reads: calls alternate between two halves of the
    buffers and flags by the parity of a per-program call count (``epochs``, device memory, so CUDA
    graph replays and eager calls keep counting alike). The grid is always MAXP programs, so every
    program counts every call and the parities agree. A peer's call k+2 reuses call k's half only
    after its call k+1 saw this program's flag, raised after this program's call k had finished."""
    pid = tl.program_id(0)
    dtype = x.dtype.element_ty
    epoch = tl.load(epochs + pid)
    half = epoch % 2
    base = half * WORLD * slot_numel
    for i in range(0, span, BLOCK):
        offs = pid * span + i + tl.arange(0, BLOCK)
        mask = offs < numel
        v = tl.load(x + offs, mask=mask)
        for p in tl.static_range(WORLD):
            if p != RANK:
                tl.store(_peer_ptr(buf_table, p, dtype) + base + RANK * slot_numel + offs, v, mask=mask)
    _signal_then_wait(flag_table, half, pid, RANK, WORLD, MAXP)
    own = _peer_ptr(buf_table, RANK, dtype)
    for i in range(0, span, BLOCK):
        offs = pid * span + i + tl.arange(0, BLOCK)
        mask = offs < numel
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for p in tl.static_range(WORLD):
            if p == RANK:
                acc += tl.load(x + offs, mask=mask).to(tl.float32)
            else:
                acc += tl.load(own + base + p * slot_numel + offs, mask=mask, cache_modifier=".cg").to(tl.float32)
        tl.store(x + offs, acc.to(dtype), mask=mask)
    tl.store(epochs + pid, epoch + 1)


def launch_shape(slot_numel: int) -> tuple[int, int]:
    """(programs, span): program ``b`` handles elements [b * span, (b + 1) * span) of a slot, ``span``
    a multiple of BLOCK. The same on every rank for the same size, which the flags' pairing needs."""
    span = triton.cdiv(max(1, triton.cdiv(slot_numel, MAX_PROGRAMS)), BLOCK) * BLOCK
    return max(1, triton.cdiv(slot_numel, span)), span
