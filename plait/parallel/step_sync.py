"""One step's forward inputs, broadcast from rank 0 to the other tensor-parallel ranks.

Rank 0 schedules, so only it knows the batch. Before every forward it broadcasts what a rank needs
to run the same forward on its shard of the model and its own copy of the KV cache:

  header  [HEADER_LEN] int64, control group  kind, mode, bs, T, #logits rows, #pool writes, #slots
  host    int64, control group               seq_lens_cpu, extend lens/prefix lens (extend modes),
                                             rows/starts/lengths of the request-pool writes
  device  int64, device group                input_ids (future tokens already resolved), positions,
                                             req_pool_indices, seq_lens, out_cache_loc,
                                             extend lens/prefix lens/start locs, logits_indices,
                                             the KV slots of the request-pool writes

The req_to_token map is mirrored, not broadcast: each rank applies the same writes as rank 0. Those
are the per-token scatter of the step (rows derived from req_pool_indices and extend lens, so not
sent) and the prefix rows the radix cache hands over at admission (``ReqToTokenPool.write``),
recorded on rank 0 by ``RecordingReqToTokenPool`` and shipped with the next step.

The header wait on a worker has no practical timeout (the engine may sit idle for hours); every
other collective runs under the group's timeout.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from plait.distributed.parallel_state import TPGroup
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import ReqToTokenPool

HEADER_LEN = 8
IDLE_WAIT = timedelta(days=30)


class StepKind(enum.IntEnum):
    FORWARD = 1
    SHUTDOWN = 2


@dataclass
class PoolWrite:
    row: int
    start: int
    slots: torch.Tensor  # [n] KV slots (device)


class RecordingReqToTokenPool(ReqToTokenPool):
    """Rank 0's request pool: a ``ReqToTokenPool`` sharing the runner's map that also records every
    ``write()`` so the next step can replay it on the other ranks."""

    pending: list[PoolWrite]

    @classmethod
    def adopt(cls, pool: ReqToTokenPool) -> RecordingReqToTokenPool:
        rec = cls.__new__(cls)
        rec.__dict__.update(pool.__dict__)  # same map tensor, same free rows
        rec.pending = []
        return rec

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        super().write(row, start, slots)
        if slots.numel():
            self.pending.append(PoolWrite(row, start, slots.to(torch.int64)))

    def take_pending(self) -> list[PoolWrite]:
        out, self.pending = self.pending, []
        return out


@dataclass
class StepMessage:
    kind: StepKind
    fb: ForwardBatch | None = None
    writes: list[PoolWrite] = field(default_factory=list)


def _token_rows(fb: ForwardBatch) -> torch.Tensor:
    """Request-pool row of every new token (the rows of the req_to_token scatter)."""
    if fb.extend is None:
        return fb.req_pool_indices
    return torch.repeat_interleave(fb.req_pool_indices, fb.extend.seq_lens, output_size=fb.num_tokens)


def apply_step_writes(pool: ReqToTokenPool, fb: ForwardBatch, writes: list[PoolWrite]) -> None:
    """What rank 0's scheduler wrote into req_to_token for this step: admission prefixes, then the
    slots of the new tokens."""
    for w in writes:
        pool.req_to_token[w.row, w.start : w.start + w.slots.numel()] = w.slots.to(torch.int32)
    if fb.num_tokens:
        pool.req_to_token[_token_rows(fb), fb.positions] = fb.out_cache_loc.to(torch.int32)


def send_shutdown(control: TPGroup) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = StepKind.SHUTDOWN
    control.broadcast(header)


def send_step(control: TPGroup, device_group: TPGroup, fb: ForwardBatch, writes: list[PoolWrite]) -> None:
    """Rank 0: broadcast ``fb``'s inputs (and the pending pool writes)."""
    extend = fb.extend is not None
    n_logits = -1 if fb.logits_indices is None else int(fb.logits_indices.numel())
    n_slots = sum(int(w.slots.numel()) for w in writes)
    header = torch.tensor([StepKind.FORWARD, int(fb.forward_mode), fb.batch_size, fb.num_tokens, n_logits,
                           len(writes), n_slots, int(extend)], dtype=torch.int64)
    control.broadcast(header)
    host: list[int] = list(fb.seq_lens_cpu)
    if extend:
        assert fb.extend is not None
        host += list(fb.extend.seq_lens_cpu) + list(fb.extend.prefix_lens_cpu)
    host += [w.row for w in writes] + [w.start for w in writes] + [int(w.slots.numel()) for w in writes]
    if host:
        control.broadcast(torch.tensor(host, dtype=torch.int64))
    parts = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc]
    if extend:
        assert fb.extend is not None
        parts += [fb.extend.seq_lens, fb.extend.prefix_lens, fb.extend.start_loc]
    if fb.logits_indices is not None:
        parts.append(fb.logits_indices)
    parts += [w.slots for w in writes]
    payload = torch.cat([p.to(torch.int64).reshape(-1) for p in parts])
    if payload.numel():
        device_group.broadcast(payload)


def recv_step(control: TPGroup, device_group: TPGroup, device: torch.device | str) -> StepMessage:
    """Ranks > 0: wait (without a timeout) for rank 0's next message and rebuild the ForwardBatch."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    control.broadcast(header, timeout=IDLE_WAIT)
    kind, mode, bs, T, n_logits, n_writes, n_slots, extend = header.tolist()
    if kind == StepKind.SHUTDOWN:
        return StepMessage(StepKind.SHUTDOWN)
    n_host = bs + (2 * bs if extend else 0) + 3 * n_writes
    host: list[int] = []
    if n_host:
        h = torch.empty(n_host, dtype=torch.int64)
        control.broadcast(h)
        host = h.tolist()
    seq_lens_cpu, host = host[:bs], host[bs:]
    ext_cpu: list[int] = []
    pre_cpu: list[int] = []
    if extend:
        ext_cpu, pre_cpu, host = host[:bs], host[bs : 2 * bs], host[2 * bs :]
    w_rows, w_starts, w_lens = host[:n_writes], host[n_writes : 2 * n_writes], host[2 * n_writes :]
    sizes = [T, T, bs, bs, T] + ([bs] * 3 if extend else []) + ([n_logits] if n_logits >= 0 else []) + [n_slots]
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    if payload.numel():
        device_group.broadcast(payload)
    chunks = list(payload.split(sizes))
    ids, pos, rpi, seq_lens, out_loc = chunks[:5]
    rest = chunks[5:]
    fb = ForwardBatch(forward_mode=ForwardMode(mode), batch_size=bs, input_ids=ids, req_pool_indices=rpi,
                      seq_lens=seq_lens, out_cache_loc=out_loc, positions=pos, seq_lens_cpu=seq_lens_cpu,
                      seq_lens_sum=sum(seq_lens_cpu))
    if extend:
        fb.extend = ExtendInfo(num_tokens=T, seq_lens=rest[0], prefix_lens=rest[1], start_loc=rest[2],
                               seq_lens_cpu=ext_cpu, prefix_lens_cpu=pre_cpu)
        rest = rest[3:]
    if n_logits >= 0:
        fb.logits_indices, rest = rest[0], rest[1:]
    slots = rest[0]
    writes: list[PoolWrite] = []
    offset = 0
    for row, start, n in zip(w_rows, w_starts, w_lens, strict=True):
        writes.append(PoolWrite(row, start, slots[offset : offset + n]))
        offset += n
    return StepMessage(StepKind.FORWARD, fb, writes)
