"""What the draft-model workers (EAGLE heads, STANDALONE draft models) share.

Both own a KV pool with the target's slot numbering (one ``req_to_token`` map and one slot allocator
serve both models), two draft backends over it (``plait.speculative.draft_backend``: an extend backend
and a multi-step decode container), and the same drafting and catching-up machinery:
  * chains (topk 1): ``num_steps`` DECODE steps, step s at position ``kv_len + position_offset + s``;
    positions at or above ``kv_len`` write temporary slots freed right after the loop. Every step
    is planned up front through the multi-step backend (each batch marked); a captured graph of the
    whole loop serves the batch when one fits (``plait.speculative.draft_graph``);
  * top-k trees: the device expansion of ``plait.speculative.draft_tree``, one DRAFT_EXTEND per step
    over the partial trees (KV into the dummy slot), replayed from a captured graph when one fits
    (``plait.speculative.tree_draft_graph``);
  * catching up: DRAFT_EXTEND batches over positions whose slots ``req_to_token`` already maps
    (``draft_extend_batch``), after plain target forwards and after acceptance.
Drafts are argmaxes (one-hot), so sampled requests use the one-hot acceptance rule and keep the
target distribution exactly.
"""

from __future__ import annotations

import itertools
from abc import abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from plait.attention.base import AttentionBackend
from plait.config import EngineConfig
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool
from plait.scheduler.interface import SchedulerAPI
from plait.scheduler.req import Req
from plait.speculative.draft_backend import DraftBackendFactory
from plait.speculative.draft_graph import DraftLoopGraphRunner, draft_graph_batch_sizes
from plait.speculative.draft_tree import expand_on_device, trees_from_packed
from plait.speculative.tree import DraftTree
from plait.speculative.tree_draft_graph import TreeDraftGraphRunner, TreeDraftInputs, TreeStep
from plait.speculative.verify_batch import DraftRow, tree_draft_batch
from plait.speculative.worker import BaseSpecWorker
from plait.transfer import ints_to_device

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner


class DraftModelWorker(BaseSpecWorker):
    # Where chain step 0 runs relative to the request's kv_len: 0 (the root's position, STANDALONE)
    # or -1 (the pending position, whose slot the request holds already: EAGLE).
    position_offset = 0
    # Width of the hidden state step 0 reads ([bs, hidden_in_dim]); None: the draft reads none.
    hidden_in_dim: int | None = None

    def __init__(self, config: EngineConfig, runner: ModelRunner, kv_pool: MHATokenToKVPool,
                 num_q_heads: int) -> None:
        """Subclasses load their draft first and call this last: it captures the draft graphs, which
        run the draft."""
        super().__init__(config, runner)
        assert self.position_offset in (0, -1)
        self.kv_pool = kv_pool
        factory = DraftBackendFactory(config, runner.req_to_token_pool, kv_pool, num_q_heads)
        self.extend_backend: AttentionBackend = factory.create_extend_backend()
        self.decode_backend = factory.create_decode_backend(self.num_steps)
        self.draft_graphs: DraftLoopGraphRunner | None = None  # the chain loop (topk 1)
        self.tree_graphs: TreeDraftGraphRunner | None = None  # the tree expansion (topk > 1)
        batch_sizes = draft_graph_batch_sizes(config, runner.device)
        if batch_sizes is not None and self.topk == 1:
            self.draft_graphs = self.build_draft_graphs(batch_sizes)
        elif batch_sizes is not None:
            self.tree_graphs = self.build_tree_graphs(batch_sizes)

    # --- what a draft model provides ----------------------------------------------------------------
    @abstractmethod
    def chain_step(self, fb: ForwardBatch, backend: AttentionBackend, hidden: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One chain step as device ops only (it runs inside the captured loop): (target-vocab argmax
        ids [bs], the hidden state the next step reads, or None)."""

    @abstractmethod
    def _tree_step(self, root_hidden: torch.Tensor | None) -> TreeStep:
        """The draft's forward for one tree-expansion step, eager and in the graph alike."""

    @abstractmethod
    def _tree_inputs(self, reqs: list[Req], max_depths: list[int]) -> TreeDraftInputs | None:
        """The requests that draft a tree now and what the expansion reads; None: nobody can."""

    def can_draft(self, req: Req) -> bool:
        """Whether the draft holds what ``req``'s chain step 0 reads."""
        return True

    def chain_hidden(self, reqs: list[Req]) -> torch.Tensor | None:
        """The hidden states chain step 0 reads, [len(reqs), hidden_in_dim] (None: the draft reads none)."""
        return None

    # --- graphs -------------------------------------------------------------------------------------
    def build_draft_graphs(self, batch_sizes: Sequence[int], graph_factory: Any = None) -> DraftLoopGraphRunner:
        """Capture the chain draft loop per (steps, batch bucket); tests pass an EagerGraph factory."""
        extra = {} if graph_factory is None else {"graph_factory": graph_factory}
        return DraftLoopGraphRunner(self.decode_backend, self.chain_step, batch_sizes, self.num_steps,
                                    position_offset=self.position_offset, device=self.runner.device,
                                    hidden_dim=self.hidden_in_dim, hidden_dtype=self.runner.model_config.dtype,
                                    **extra)

    def build_tree_graphs(self, batch_sizes: Sequence[int], graph_factory: Any = None) -> TreeDraftGraphRunner:
        """Capture the top-k tree expansion per (steps, batch bucket) on the per-step draft backends;
        tests pass an EagerGraph factory."""
        extra = {} if graph_factory is None else {"graph_factory": graph_factory}
        return TreeDraftGraphRunner(self.decode_backend, self._tree_step, batch_sizes, self.num_steps, self.topk,
                                    self.runner.max_context_len, self.runner.device, hidden_dim=self.hidden_in_dim,
                                    hidden_dtype=self.runner.model_config.dtype, **extra)

    def close(self) -> None:
        self.draft_graphs = None
        self.tree_graphs = None
        # Dropped, not set to None: reading one after close raises AttributeError.
        for name in ("kv_pool", "extend_backend", "decode_backend"):
            vars(self).pop(name, None)

    # --- catching up --------------------------------------------------------------------------------
    def draft_extend_batch(self, rows: list[int], starts: list[int], lens: list[int],
                           ids: torch.Tensor | list[int]) -> ForwardBatch | None:
        """DRAFT_EXTEND: request-pool row ``rows[i]`` computes positions ``[starts[i], starts[i] +
        lens[i])`` from the packed ``ids`` (one token per position; host ids travel in the batch's one
        host-to-device copy), writing the draft KV into the slots ``req_to_token`` maps those
        positions to. Rows with nothing to compute are left out; None when no row has anything."""
        keep = [i for i, n in enumerate(lens) if n > 0]
        if not keep:
            return None
        rows = [rows[i] for i in keep]
        pre = [starts[i] for i in keep]
        ext = [lens[i] for i in keep]
        pos = [p + j for p, n in zip(pre, ext, strict=True) for j in range(n)]
        token_rows = [r for r, n in zip(rows, ext, strict=True) for _ in range(n)]
        seq = [p + n for p, n in zip(pre, ext, strict=True)]
        loc = list(itertools.accumulate(ext[:-1], initial=0))
        host_ids = [] if isinstance(ids, torch.Tensor) else ids
        parts = [pos, token_rows, rows, seq, ext, pre, loc, host_ids]
        pos_t, token_rows_t, rows_t, seq_t, ext_t, pre_t, loc_t, ids_t = ints_to_device(parts, self.runner.device)
        slots = self.runner.req_to_token_pool.req_to_token[token_rows_t, pos_t].to(torch.int64)
        return ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=len(rows),
            input_ids=ids if isinstance(ids, torch.Tensor) else ids_t, req_pool_indices=rows_t,
            seq_lens=seq_t, out_cache_loc=slots, positions=pos_t, seq_lens_cpu=seq, seq_lens_sum=sum(seq),
            extend=ExtendInfo(num_tokens=len(pos), seq_lens=ext_t, prefix_lens=pre_t, start_loc=loc_t,
                              seq_lens_cpu=ext, prefix_lens_cpu=pre))

    # --- drafting -----------------------------------------------------------------------------------
    def propose(self, sched: SchedulerAPI, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        if self.topk > 1:
            return self._propose_trees(reqs, max_depths)
        # Every request runs the same number of draft steps (one batch per step); a request too
        # close to the end of its context for that many positions decodes normally instead.
        k = max(max_depths)
        limit = self.runner.max_context_len
        out: list[DraftTree | None] = [None] * len(reqs)
        use = [i for i, r in enumerate(reqs) if r.kv_len + k <= limit and self.can_draft(r)]
        if not use:
            return out
        drafting = [reqs[i] for i in use]
        bs = len(use)
        num_temp = k + self.position_offset  # steps at or above kv_len
        temp = sched.alloc_kv_slots(bs * num_temp)
        if temp is None:
            return out
        device = self.runner.device
        prefix = [r.kv_len for r in drafting]
        rows = torch.tensor([r.req_pool_idx for r in drafting], dtype=torch.int64, device=device)
        pre_t = torch.tensor(prefix, dtype=torch.int64, device=device)
        temp = temp.view(bs, num_temp)
        # Map the temporary slots now, before planning (backends read req_to_token when they plan).
        sched.map_kv_slots(rows[:, None], pre_t[:, None] + torch.arange(num_temp, device=device)[None, :], temp)
        step_slots = temp.t()  # [k, bs]: step s's KV slots
        if self.position_offset < 0:  # step 0 recomputes the pending position, in the request's own slot
            own = self.runner.req_to_token_pool.req_to_token[rows, pre_t - 1].to(torch.int64)
            step_slots = torch.cat([own[None], step_slots])
        tokens = torch.empty(k + 1, bs, dtype=torch.int64, device=device)
        tokens[0] = torch.tensor([r.output_ids[-1] for r in drafting], dtype=torch.int64)
        hidden = self.chain_hidden(drafting)
        if self.draft_graphs is not None and self.draft_graphs.can_run(bs, k):
            tokens[1:] = self.draft_graphs.replay(tokens[0], rows, prefix, pre_t, step_slots, hidden)
        else:
            self._draft_chain_eager(tokens, rows, prefix, pre_t, step_slots, hidden)
        if num_temp:
            sched.free_kv_slots(temp.flatten())
        guesses = tokens[1:].t().tolist()
        for j, i in enumerate(use):
            out[i] = DraftTree.chain(reqs[i].output_ids[-1], guesses[j][: max_depths[i]])
        return out

    def _draft_chain_eager(self, tokens: torch.Tensor, rows: torch.Tensor, prefix: list[int], pre_t: torch.Tensor,
                           step_slots: torch.Tensor, hidden: torch.Tensor | None) -> None:
        """The chain loop without graphs: every step planned up front, each batch marked; step s's
        argmax goes to ``tokens[s + 1]``."""
        k, bs = step_slots.shape
        batches = []
        for s in range(k):
            offset = self.position_offset + s
            seq = [p + offset + 1 for p in prefix]
            batches.append(ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=tokens[s], req_pool_indices=rows,
                seq_lens=pre_t + (offset + 1), out_cache_loc=step_slots[s].contiguous(), positions=pre_t + offset,
                seq_lens_cpu=seq, seq_lens_sum=sum(seq)))
        self.decode_backend.plan_steps(batches)  # every step planned up front, each batch marked
        for s, fb in enumerate(batches):
            tokens[s + 1], hidden = self.chain_step(fb, self.decode_backend.children[s], hidden)

    def _expand_eager(self, inp: TreeDraftInputs) -> torch.Tensor:
        """The tree expansion without graphs: each step a DRAFT_EXTEND planned on the extend backend."""
        rows = [DraftRow(p, r) for p, r in zip(inp.prefix, inp.rows, strict=True)]
        step_fn = self._tree_step(inp.hidden)

        def step(width: int, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
            fb = tree_draft_batch(rows, tokens, ancestors, self.topk)
            return step_fn(width, fb, self.extend_backend, parents)

        return expand_on_device(inp.roots, max(inp.max_depths), self.topk, step)

    def _propose_trees(self, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        """Top-k trees, expanded on the device: the partial tree is recomputed each step with the
        custom ancestor mask; KV goes to the dummy slot (no tree state held; the accepted path is
        re-extended after verification). One graph replay when the tree graphs take the batch, else
        step by step."""
        result: list[DraftTree | None] = [None] * len(reqs)
        inp = self._tree_inputs(reqs, max_depths)
        if inp is None:
            return result
        graphs = self.tree_graphs
        if graphs is not None and graphs.can_run(len(inp.use), max(inp.max_depths)):
            packed = graphs.replay(inp)
        else:
            packed = self._expand_eager(inp)
        for i, tree in zip(inp.use, trees_from_packed(packed, inp.max_depths, self.topk, self.num_draft_tokens),
                           strict=True):
            result[i] = tree
        return result
