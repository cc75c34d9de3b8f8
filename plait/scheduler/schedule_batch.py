"""ScheduleBatch: the scheduler's choice for one step, and its conversion to a ForwardBatch.

A step holds decode entries (one token each, at the request's next position) followed by extend
entries (a chunk of fill tokens on top of the KV the request already has). With any extend entry of
more than one token (or one that samples nothing) the forward runs in EXTEND or MIXED mode,
otherwise DECODE.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode, InputLogprobRows
from plait.scheduler.req import Req
from plait.transfer import ints_to_device


@dataclass(slots=True)
class BatchEntry:
    req: Req
    prefix_len: int  # positions with KV before this step
    extend_len: int  # new tokens this step (1 for decode)
    sample: bool  # whether this step samples a token for the request (False for a non-final chunk)
    is_decode: bool

    @property
    def input_ids(self) -> list[int]:
        """Host token ids; a decode whose input is still on the device gets a placeholder 0 that
        ``to_forward_batch`` overwrites from ``req.future_token``."""
        if self.is_decode:
            return [0] if self.req.future_token is not None else [self.req.output_ids[-1]]
        return self.req.fill_ids[self.prefix_len : self.prefix_len + self.extend_len]


@dataclass
class HostLists:
    """A batch's host ints before their one copy to the device (entry order; T = its new tokens)."""

    input_ids: list[int]  # [T]; 0 where the token is still on the device (future_rows)
    positions: list[int]  # [T]
    token_rows: list[int]  # [T] request-pool row of each token
    logits_rows: list[int]  # token indices whose logits are computed (scored prompt positions, then samples)
    future_rows: list[int]  # token indices whose input the in-flight batch samples
    future_src: list[int]  # their rows in that batch's sampled ids
    future_tensor: torch.Tensor | None  # that batch's sampled ids on the device
    scored_at: list[int]  # prompt scoring (logprob_start_len): logits_rows positions scored
    scored_next: list[int]  # the prompt token each scores
    sample_at: list[int]  # logits_rows positions the sampler reads
    scored_counts: list[int]  # per entry, prompt positions scored
    top_k: int  # the widest top_logprobs among scoring entries


@dataclass
class ScheduleBatch:
    entries: list[BatchEntry]
    out_cache_loc: torch.Tensor  # [T] KV slots of the new tokens, in entry order
    token_rows: torch.Tensor | None = None  # [T] request-pool row of each new token (set by to_forward_batch)
    # DP attention (docs/architecture.md §3.4): every rank's token count this step (request counts for decode),
    # set after the ranks exchanged them; read by ForwardBatch.init_mlp_sync_metadata.
    global_num_tokens: list[int] | None = None
    global_num_tokens_for_logprob: list[int] | None = None
    can_run_dp_cuda_graph: bool = False

    @property
    def forward_mode(self) -> ForwardMode:
        # A prefill whose only new token is its last (a prefix-cache hit on the whole prompt but the
        # token that gives the logits) is a decode row: such batches run as DECODE, so a CUDA graph
        # serves them instead of an eager extend forward (which costs several replays at small batch).
        if all(e.extend_len == 1 and e.sample for e in self.entries):
            return ForwardMode.DECODE
        has_extend = any(not e.is_decode for e in self.entries)
        has_decode = any(e.is_decode for e in self.entries)
        if not has_extend:
            return ForwardMode.DECODE
        return ForwardMode.MIXED if has_decode else ForwardMode.EXTEND

    @property
    def sampled(self) -> list[BatchEntry]:
        return [e for e in self.entries if e.sample]

    def host_lists(self) -> HostLists:
        """The batch's per-token and per-entry host ints, for any mix of decode and extend entries."""
        input_ids: list[int] = []
        positions: list[int] = []
        token_rows: list[int] = []
        logits_rows: list[int] = []
        future_rows: list[int] = []
        future_src: list[int] = []
        future_tensor: torch.Tensor | None = None
        # Prompt scoring (logprob_start_len): positions of logits_rows that are scored, the token
        # each scores, the positions the sampler reads, and how many each entry scored.
        scored_at: list[int] = []
        scored_next: list[int] = []
        sample_at: list[int] = []
        scored_counts: list[int] = []
        top_k = 0
        for e in self.entries:
            if e.is_decode and e.req.future_token is not None:
                future_tensor, idx = e.req.future_token
                future_rows.append(len(input_ids))
                future_src.append(idx)
            base = len(input_ids)
            input_ids.extend(e.input_ids)
            positions.extend(range(e.prefix_len, e.prefix_len + e.extend_len))
            token_rows.extend([e.req.row] * e.extend_len)
            first = None if e.is_decode else e.req.next_scored_position
            n_scored = 0
            if first is not None:
                prompt = e.req.origin_input_ids
                for q in range(max(first, e.prefix_len), min(len(prompt) - 2, e.prefix_len + e.extend_len - 1) + 1):
                    scored_at.append(len(logits_rows))
                    scored_next.append(prompt[q + 1])
                    logits_rows.append(base + q - e.prefix_len)
                    n_scored += 1
                top_k = max(top_k, e.req.sampling_params.top_logprobs)
            scored_counts.append(n_scored)
            if e.sample:
                sample_at.append(len(logits_rows))
                logits_rows.append(len(input_ids) - 1)
        return HostLists(input_ids, positions, token_rows, logits_rows, future_rows, future_src, future_tensor,
                         scored_at, scored_next, sample_at, scored_counts, top_k)

    def decode_lists(self) -> HostLists:
        """``host_lists`` for a batch of decode entries only (one token each, every one sampled, nothing
        scored): the same lists, built per field in one pass each (the steady decode step's host path
        at hundreds of requests)."""
        entries = self.entries
        reqs = [e.req for e in entries]
        futures = [(i, r.future_token) for i, r in enumerate(reqs) if r.future_token is not None]
        n = len(entries)
        return HostLists(
            input_ids=[0 if r.future_token is not None else r.output_ids[-1] for r in reqs],
            positions=[e.prefix_len for e in entries],
            token_rows=[r.row for r in reqs],
            logits_rows=list(range(n)),
            future_rows=[i for i, _ in futures],
            future_src=[f[1] for _, f in futures],
            future_tensor=futures[-1][1][0] if futures else None,
            scored_at=[], scored_next=[], sample_at=list(range(n)), scored_counts=[0] * n, top_k=0)

    def to_forward_batch(self, device: torch.device | str) -> ForwardBatch:
        """Device tensors for the batch, from one packed host-to-device copy (pinned, non-blocking:
        a pageable copy would wait for the batch still running on the GPU)."""
        mode = self.forward_mode
        h = self.decode_lists() if all(e.is_decode for e in self.entries) else self.host_lists()
        seq_lens_cpu = [e.prefix_len + e.extend_len for e in self.entries]
        # Only EXTEND / MIXED forwards read the per-entry extend layout and the logits rows.
        ext = [e.extend_len for e in self.entries] if mode != ForwardMode.DECODE else []
        pre = [e.prefix_len for e in self.entries] if mode != ForwardMode.DECODE else []
        starts = [0] if ext else []
        for n in ext[:-1]:
            starts.append(starts[-1] + n)
        parts = [h.input_ids, h.positions, h.token_rows, [e.req.req_pool_idx for e in self.entries], seq_lens_cpu,
                 ext, pre, starts, h.logits_rows if ext else [], h.future_rows, h.future_src, h.scored_at,
                 h.scored_next, h.sample_at if ext else []]
        (ids, pos, rows, req_pool_indices, seq_lens, ext_t, pre_t, starts_t, logits_t, f_rows, f_src,
         scored_t, next_t, sample_t) = ints_to_device(parts, device)
        if h.future_tensor is not None:
            # Inputs sampled by the in-flight batch: gathered on the device, no host sync.
            ids[f_rows] = h.future_tensor[f_src]
        fb = ForwardBatch(
            forward_mode=mode,
            batch_size=len(self.entries),
            input_ids=ids,
            req_pool_indices=req_pool_indices,
            seq_lens=seq_lens,
            out_cache_loc=self.out_cache_loc,
            positions=pos,
            seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=sum(seq_lens_cpu),
        )
        self.token_rows = rows
        fb.init_mlp_sync_metadata(self, device)
        if mode != ForwardMode.DECODE:
            fb.extend = ExtendInfo(num_tokens=len(h.input_ids), seq_lens=ext_t, prefix_lens=pre_t, start_loc=starts_t,
                                   seq_lens_cpu=ext, prefix_lens_cpu=pre)
            # Decode rows sample every step; chunks that do not finish a prefill sample nothing.
            fb.logits_indices = logits_t
            if h.scored_at:
                fb.input_logprobs = InputLogprobRows(scored_t, next_t, sample_t, h.scored_counts, h.top_k)
        else:
            assert not h.scored_at, "a batch that scores prompt positions extends"
        return fb
