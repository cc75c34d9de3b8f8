"""One step's forward inputs, broadcast from rank 0 to the other tensor-parallel ranks.

Rank 0 schedules, so only it knows the batch. Before every forward it broadcasts what a rank needs
to run the same forward on its shard of the model and its own copy of the KV cache:

  header  [HEADER_LEN] int64, control group  kind, mode, bs, T, #logits rows, #pool writes, #slots,
                                             extend flag, tree-mask length (-1: no spec input)
  host    int64, control group               seq_lens_cpu, extend lens/prefix lens (extend modes),
                                             rows/starts/lengths of the request-pool writes,
                                             tokens per request (speculative verify)
  device  int64, device group                input_ids (future tokens already resolved), positions,
                                             req_pool_indices, seq_lens, out_cache_loc,
                                             extend lens/prefix lens/start locs, logits_indices,
                                             the KV slots of the request-pool writes
  mask    uint8, device group                the verify tree mask (speculative verify)

A speculative verify batch carries what the model reads of its spec input, the tokens per request
and the tree mask (``VerifyInputCopy``); the draft trees stay on rank 0, which drafts and accepts.

The req_to_token map is mirrored, not broadcast: each rank applies the same writes as rank 0, in
the same order. ``RecordingReqToTokenPool`` records every write on rank 0 (the prefix rows the radix
cache hands over at admission, the step's new tokens, the slots of accepted speculative tokens) and
the next step message ships them; a batch is always mapped before its forward, so its own writes
travel with it.

The header wait on a worker has no practical timeout (the engine may sit idle for hours); every
other collective runs under the group's timeout.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from plait.distributed.parallel_state import TPGroup
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import ReqToTokenPool
from plait.two_batch_overlap import slice_tree_mask

HEADER_LEN = 9
IDLE_WAIT = timedelta(days=30)


class StepKind(enum.IntEnum):
    FORWARD = 1
    SHUTDOWN = 2


@dataclass
class PoolWrite:
    """``req_to_token[rows, positions] = slots``, all int64 [n] on the device."""

    rows: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor


class RecordingReqToTokenPool(ReqToTokenPool):
    """Rank 0's request pool: a ``ReqToTokenPool`` sharing the runner's map that also records every
    ``write()`` and ``scatter()`` (admission prefixes; the slots of accepted speculative tokens), in
    order, so the next step can replay them on the other ranks."""

    pending: list[PoolWrite]

    @classmethod
    def adopt(cls, pool: ReqToTokenPool) -> RecordingReqToTokenPool:
        rec = cls.__new__(cls)
        rec.__dict__.update(pool.__dict__)  # same map tensor, same free rows
        rec.pending = []
        return rec

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        super().write(row, start, slots)
        n = slots.numel()
        if n:
            device = slots.device
            self.pending.append(PoolWrite(torch.full((n,), row, dtype=torch.int64, device=device),
                                          torch.arange(start, start + n, dtype=torch.int64, device=device),
                                          slots.to(torch.int64)))

    def scatter(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        super().scatter(rows, positions, slots)
        rows, positions, slots = torch.broadcast_tensors(rows, positions, slots)
        if slots.numel():
            self.pending.append(PoolWrite(rows.reshape(-1).to(torch.int64), positions.reshape(-1).to(torch.int64),
                                          slots.reshape(-1).to(torch.int64)))

    def take_pending(self) -> list[PoolWrite]:
        out, self.pending = self.pending, []
        return out


@dataclass(frozen=True)
class VerifyInputCopy:
    """A worker's ``fb.spec_info`` of a TARGET_VERIFY step: what the model and the attention
    backends read (``plait.forward_batch.SpecInput``)."""

    num_tokens_per_req: list[int]
    custom_mask: torch.Tensor  # flattened bool, layout of plait.attention.base.custom_mask_of

    def split(self, start: int, end: int, seq_lens_cpu: Sequence[int]) -> VerifyInputCopy:
        """Requests [start, end) (a two-batch-overlap child)."""
        return VerifyInputCopy(self.num_tokens_per_req[start:end], slice_tree_mask(
            self.custom_mask, self.num_tokens_per_req, seq_lens_cpu, start, end))


@dataclass
class StepMessage:
    kind: StepKind
    fb: ForwardBatch | None = None
    writes: list[PoolWrite] = field(default_factory=list)


def apply_step_writes(pool: ReqToTokenPool, writes: list[PoolWrite]) -> None:
    """What rank 0 wrote into req_to_token since the previous step (admission prefixes, the slots of
    this step's new tokens, the slots of accepted speculative tokens), in rank 0's order: a row
    freed and admitted again is written in that order."""
    for w in writes:
        pool.req_to_token[w.rows, w.positions] = w.slots.to(torch.int32)


def send_shutdown(control: TPGroup) -> None:
    header = torch.zeros(HEADER_LEN, dtype=torch.int64)
    header[0] = StepKind.SHUTDOWN
    control.broadcast(header)


def send_step(control: TPGroup, device_group: TPGroup, fb: ForwardBatch, writes: list[PoolWrite]) -> None:
    """Rank 0: broadcast ``fb``'s inputs (and the pending pool writes)."""
    extend = fb.extend is not None
    n_logits = -1 if fb.logits_indices is None else int(fb.logits_indices.numel())
    n_slots = sum(int(w.slots.numel()) for w in writes)
    spec = fb.spec_info
    if spec is not None and not fb.forward_mode.is_target_verify():
        raise ValueError(f"a {fb.forward_mode.name} step with a spec input cannot be broadcast: only verify "
                         "batches run on every rank")
    if spec is not None and spec.custom_mask is None:
        raise ValueError("a verify batch without a tree mask cannot be broadcast: the ranks receive the mask "
                         "(EngineConfig.causal_chain_verify is off under tensor parallelism)")
    mask = None if spec is None or spec.custom_mask is None else spec.custom_mask.reshape(-1)
    widths: list[int] = []
    if spec is not None:
        w = spec.num_tokens_per_req
        widths = [w] * fb.batch_size if isinstance(w, int) else list(w)
    header = torch.tensor([StepKind.FORWARD, int(fb.forward_mode), fb.batch_size, fb.num_tokens, n_logits,
                           len(writes), n_slots, int(extend), -1 if mask is None else mask.numel()],
                          dtype=torch.int64)
    control.broadcast(header)
    host: list[int] = list(fb.seq_lens_cpu)
    if extend:
        assert fb.extend is not None
        host += list(fb.extend.seq_lens_cpu) + list(fb.extend.prefix_lens_cpu)
    host += [int(w.slots.numel()) for w in writes] + widths
    if host:
        control.broadcast(torch.tensor(host, dtype=torch.int64))
    parts = [fb.input_ids, fb.positions, fb.req_pool_indices, fb.seq_lens, fb.out_cache_loc]
    if extend:
        assert fb.extend is not None
        parts += [fb.extend.seq_lens, fb.extend.prefix_lens, fb.extend.start_loc]
    if fb.logits_indices is not None:
        parts.append(fb.logits_indices)
    parts += [t for w in writes for t in (w.rows, w.positions, w.slots)]
    payload = torch.cat([p.to(torch.int64).reshape(-1) for p in parts])
    if payload.numel():
        device_group.broadcast(payload)
    if mask is not None and mask.numel():
        device_group.broadcast(mask.to(torch.uint8))


def recv_step(control: TPGroup, device_group: TPGroup, device: torch.device | str) -> StepMessage:
    """Ranks > 0: wait (without a timeout) for rank 0's next message and rebuild the ForwardBatch."""
    header = torch.empty(HEADER_LEN, dtype=torch.int64)
    control.broadcast(header, timeout=IDLE_WAIT)
    kind, mode, bs, T, n_logits, n_writes, n_slots, extend, n_mask = header.tolist()
    if kind == StepKind.SHUTDOWN:
        return StepMessage(StepKind.SHUTDOWN)
    n_host = bs + (2 * bs if extend else 0) + n_writes + (bs if n_mask >= 0 else 0)
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
    w_lens, widths = host[:n_writes], host[n_writes:]
    sizes = ([T, T, bs, bs, T] + ([bs] * 3 if extend else []) + ([n_logits] if n_logits >= 0 else [])
             + [3 * n_slots])
    payload = torch.empty(sum(sizes), dtype=torch.int64, device=device)
    if payload.numel():
        device_group.broadcast(payload)
    mask = None
    if n_mask >= 0:
        mask = torch.empty(n_mask, dtype=torch.uint8, device=device)
        if n_mask:
            device_group.broadcast(mask)
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
    if mask is not None:
        fb.spec_info = VerifyInputCopy(num_tokens_per_req=widths, custom_mask=mask.bool())
    triples = rest[0]
    writes: list[PoolWrite] = []
    offset = 0
    for n in w_lens:
        rows, positions, slots = triples[offset : offset + 3 * n].split(n)
        writes.append(PoolWrite(rows, positions, slots))
        offset += 3 * n
    return StepMessage(StepKind.FORWARD, fb, writes)
