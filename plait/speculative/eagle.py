"""EAGLE / EAGLE3: a draft head over the target's hidden states (chains, and top-k trees when topk > 1).

Hidden states: the target model writes, for every token of every target forward, EAGLE's input
(the final normed hidden state) or EAGLE3's (the residual-stream inputs of layers [2, L//2, L-3],
concatenated) into the runner's ``HiddenCapture`` (plait.layers.hidden_capture); replayed target
graphs (decode and TARGET_VERIFY) write it too.

Draft KV, positions and the invariant: the head's position p reads (token p + 1, target hidden at p),
so position p can be computed once token p + 1 exists. Per request row the worker keeps the target
hidden of the newest position whose next token was not known yet (``pending``); the draft has KV
for every position before it.
  * plain target forwards (prefill chunks, normal decodes) are followed by a DRAFT_EXTEND over
    [pending position, last new position) with the shifted tokens, and the last new position's
    hidden becomes pending;
  * drafting: step 0 runs at the pending position L - 1 with the root token (real inputs, written to
    its real slot); step s >= 1 runs at L - 1 + s on the head's own previous output, into temporary
    slots freed after the loop; all steps are planned up front by the multi-step draft backend and
    each step's batch is marked;
  * after verification a DRAFT_EXTEND recomputes positions L .. L + j - 1 from the target hiddens of
    the accepted nodes (j accepted drafts), and the last accepted node's hidden becomes pending.
A request with no pending hidden (e.g. right after a prefix-cache hit) decodes normally once.
Drafts are argmaxes (one-hot), so sampled requests keep the target distribution exactly.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from plait.attention.base import AttentionBackend
from plait.config import EngineConfig
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool
from plait.models.eagle import Eagle3Head, EagleHead, iter_checkpoint, load_head_config
from plait.sampling.sampler import greedy_ids
from plait.speculative.draft_backend import DraftBackendFactory
from plait.speculative.draft_graph import DraftLoopGraphRunner, draft_graph_max_bs
from plait.speculative.draft_tree import expand_on_device, trees_from_packed
from plait.speculative.tree import DraftTree
from plait.speculative.tree_draft_graph import TreeDraftGraphRunner, TreeDraftInputs, TreeStep
from plait.speculative.worker import SpecWorker
from plait.transfer import ints_to_device, to_device

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner
    from plait.scheduler.req import Req
    from plait.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


class EagleWorker(SpecWorker):
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        algo = config.speculative_algorithm
        path = config.speculative_draft_model_path
        assert path is not None
        try:
            cfg = load_head_config(path)
        except FileNotFoundError as e:
            raise ValueError(f"--speculative-draft-model-path {path!r}: no config.json ({e})") from e
        target = runner.model
        tcfg = runner.model_config
        self.is_eagle3 = algo == "EAGLE3"
        self.head: EagleHead | Eagle3Head = Eagle3Head(cfg) if self.is_eagle3 else EagleHead(cfg)
        self.head.load_weights(iter_checkpoint(path))
        self.head.to(device=runner.device, dtype=tcfg.dtype).eval()
        if self.is_eagle3:
            self.head.d2t = self.head.d2t.to(torch.int64)
        if cfg.hidden_size != tcfg.hidden_size:
            raise ValueError(f"--speculative-draft-model-path: the head's hidden size {cfg.hidden_size} differs from "
                             f"the target's {tcfg.hidden_size}")
        self.embed = target.model.embed_tokens
        if isinstance(self.head, Eagle3Head) and self.head.embed_tokens is not None:
            self.embed = self.head.embed_tokens.to(runner.device)
        num_heads = cfg.num_attention_heads
        self.head_num_q_heads = num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        self.kv_pool = MHATokenToKVPool(runner.max_total_tokens, tcfg.dtype, cfg.num_hidden_layers,
                                        cfg.num_key_value_heads, head_dim, runner.device)
        name = config.speculative_draft_attention_backend or config.attention_backends()[1]
        factory = DraftBackendFactory(name, runner.req_to_token_pool, self.kv_pool, num_heads, stamps_children=True)
        self.extend_backend: AttentionBackend = factory.create_extend_backend()
        self.decode_backend = factory.create_decode_backend(self.num_steps)
        # --- hidden states of the target: the model writes them (the runner's HiddenCapture) ---
        capture = runner.hidden_capture
        assert capture is not None, "the model runner makes the capture of EAGLE engines"
        self.capture = capture
        self.capture_layers = [li for li in capture.layers if li >= 0]
        # row -> (position, target hidden at that position): see the module docstring.
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}
        self.hidden_in_dim = tcfg.hidden_size * (len(self.capture_layers) if self.is_eagle3 else 1)
        self.draft_graphs: DraftLoopGraphRunner | None = None  # the chain loop (topk 1)
        self.tree_graphs: TreeDraftGraphRunner | None = None  # the tree expansion (topk > 1)
        max_bs = draft_graph_max_bs(config, runner.device)
        if max_bs is not None and self.topk == 1:
            self.draft_graphs = self.build_draft_graphs(max_bs)
        elif max_bs is not None:
            self.tree_graphs = self.build_tree_graphs(max_bs)

    def build_draft_graphs(self, max_bs: int, graph_factory: Any = None) -> DraftLoopGraphRunner:
        """Capture the chain draft loop per (steps, batch bucket): step 0 reads the pending target
        hidden (through ``fc``), later steps the head's own output; tests pass an EagerGraph factory."""
        extra = {} if graph_factory is None else {"graph_factory": graph_factory}
        return DraftLoopGraphRunner(self.decode_backend, self._head, max_bs, self.num_steps, position_offset=-1,
                                    device=self.runner.device, hidden_dim=self.hidden_in_dim,
                                    hidden_dtype=self.runner.model_config.dtype, **extra)

    def build_tree_graphs(self, max_bs: int, graph_factory: Any = None) -> TreeDraftGraphRunner:
        """Capture the top-k tree expansion per (steps, batch bucket) on the per-step draft backends;
        tests pass an EagerGraph factory."""
        extra = {} if graph_factory is None else {"graph_factory": graph_factory}
        return TreeDraftGraphRunner(self.decode_backend, self._tree_step, max_bs, self.num_steps, self.topk,
                                    self.runner.max_context_len, self.runner.device, hidden_dim=self.hidden_in_dim,
                                    hidden_dtype=self.runner.model_config.dtype, **extra)

    # --- capture ----------------------------------------------------------------------------------
    def _take_hidden(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens, hidden_in_dim]: the latest target forward's hidden states (a view of the
        capture buffer, valid until the next target forward)."""
        return self.capture.read(num_tokens)

    def close(self) -> None:
        self.tree_graphs = None
        self.head = None  # type: ignore[assignment]
        self.kv_pool = None  # type: ignore[assignment]

    def on_finish(self, req: Req) -> None:
        super().on_finish(req)
        if req.req_pool_idx is not None:
            self.pending.pop(req.req_pool_idx, None)

    # --- draft forwards ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _head(self, fb: ForwardBatch, backend: AttentionBackend, hidden_in: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(target-vocab argmax ids, the head's hidden for the next step) for every row of fb."""
        fb.attn_backend = backend
        if fb.needs_forward_metadata_init():
            backend.init_forward_metadata(fb)
        embeds = self.embed(fb.input_ids)
        if isinstance(self.head, Eagle3Head):
            logits, hidden = self.head(embeds, hidden_in, fb.positions, fb)
            return self.head.draft_to_target(greedy_ids(logits)), hidden
        hidden = self.head(embeds, hidden_in, fb.positions, fb)
        target = self.runner.model
        logits = target.logits_processor(hidden, target.lm_head_weight, fb)
        return greedy_ids(logits), hidden

    def _draft_extend(self, rows: list[int], starts: list[int], lens: list[int], ids: torch.Tensor,
                      hidden: torch.Tensor) -> None:
        """DRAFT_EXTEND: request i computes positions [starts[i], starts[i] + lens[i]) from the
        packed ``ids`` (token p + 1 for position p) and ``hidden`` (target hidden at p)."""
        keep = [i for i, n in enumerate(lens) if n > 0]
        if not keep:
            return
        device = self.runner.device
        r2t = self.runner.req_to_token_pool.req_to_token
        rows = [rows[i] for i in keep]
        pre = [starts[i] for i in keep]
        ext = [lens[i] for i in keep]
        pos = to_device(torch.cat([torch.arange(p, p + n) for p, n in zip(pre, ext, strict=True)]), device)
        row_t = torch.tensor(rows, dtype=torch.int64, device=device)
        token_rows = torch.repeat_interleave(row_t, torch.tensor(ext, device=device))
        seq = [p + n for p, n in zip(pre, ext, strict=True)]
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=len(rows), input_ids=ids, req_pool_indices=row_t,
            seq_lens=torch.tensor(seq, device=device), out_cache_loc=r2t[token_rows, pos].to(torch.int64),
            positions=pos, seq_lens_cpu=seq, seq_lens_sum=sum(seq), extend_num_tokens=sum(ext),
            extend_seq_lens=torch.tensor(ext, device=device), extend_prefix_lens=torch.tensor(pre, device=device),
            extend_start_loc=torch.tensor([sum(ext[:i]) for i in range(len(ext))], device=device),
            extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=pre)
        self._head(fb, self.extend_backend, hidden)

    def after_target_forward(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_idle():
            return
        hidden = self._take_hidden(fb.num_tokens)  # [T, d]: every token of the forward
        # Host copies of the layout (a small sync; speculative engines run with overlap drained).
        rows = fb.req_pool_indices.tolist()
        if fb.forward_mode.is_decode():
            ext = [1] * len(rows)
            pre = [s - 1 for s in fb.seq_lens_cpu]
        else:
            assert fb.extend_seq_lens_cpu is not None and fb.extend_prefix_lens_cpu is not None
            ext, pre = list(fb.extend_seq_lens_cpu), list(fb.extend_prefix_lens_cpu)
        ids_parts, hid_parts, starts, lens = [], [], [], []
        off = 0
        for row, a, e in zip(rows, pre, ext, strict=True):
            pend = self.pending.get(row)
            use_pending = pend is not None and pend[0] == a - 1
            start = a - 1 if use_pending else a
            # positions [start, a + e - 1): tokens x[start + 1 .. a + e - 1] are this forward's inputs
            ids_parts.append(fb.input_ids[off + (start + 1 - a) : off + e])
            if use_pending:
                assert pend is not None
                hid_parts.append(pend[1][None])
            hid_parts.append(hidden[off : off + e - 1])
            starts.append(start)
            lens.append(a + e - 1 - start)
            self.pending[row] = (a + e - 1, hidden[off + e - 1].clone())
            off += e
        self._draft_extend(rows, starts, lens, torch.cat(ids_parts), torch.cat(hid_parts))

    # --- verify with hidden capture ---------------------------------------------------------------
    def verify(self, sched: Scheduler, reqs: list[Req], trees: list[DraftTree], slots: torch.Tensor) -> None:
        fb = self.build_verify_batch(reqs, trees, slots)
        out = self.runner.forward(fb)
        self._verify_hidden = self._take_hidden(fb.num_tokens)
        sched.stats.forward_steps += 1
        self.deferred_work(sched)  # the forward is queued: hide host work behind it
        self.commit(sched, reqs, trees, slots, self.accept(reqs, trees, out.next_token_logits, greedy=out.greedy_ids))

    def after_accept(self, reqs: list[Req], trees: list[DraftTree], results: list[tuple[list[int], int]],
                     old_kv_lens: list[int]) -> None:
        device = self.runner.device
        hidden = self._verify_hidden
        rows, starts, lens, ids, hid_idx = [], [], [], [], []
        off = 0
        for req, tree, (path, _), L in zip(reqs, trees, results, old_kv_lens, strict=True):
            j = len(path) - 1
            rows.append(req.req_pool_idx)
            starts.append(L)
            lens.append(j)
            ids.extend(tree.path_tokens(path[1:]))
            hid_idx.extend(off + n for n in path[:-1])
            self.pending[req.req_pool_idx] = (L + j, hidden[off + path[-1]].clone())
            off += tree.width
        if ids:
            self._draft_extend(rows, starts, lens, torch.tensor(ids, dtype=torch.int64, device=device),
                               hidden[torch.tensor(hid_idx, device=device)])
        self._verify_hidden = None

    # --- drafting ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def _head_logprobs(self, fb: ForwardBatch, backend: AttentionBackend, hidden_in: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities over the target vocabulary, the head's hidden) for every row of fb.
        Plans on ``backend`` unless the batch is marked planned (graph steps are)."""
        fb.attn_backend = backend
        if fb.needs_forward_metadata_init():
            backend.init_forward_metadata(fb)
        embeds = self.embed(fb.input_ids)
        if isinstance(self.head, Eagle3Head):
            logits, hidden = self.head(embeds, hidden_in, fb.positions, fb)
            lp = torch.log_softmax(logits.float(), dim=-1)
            # Draft id d is target id d + d2t[d]; target ids outside the draft vocabulary get -inf.
            out = lp.new_full((lp.shape[0], self.runner.model_config.vocab_size), float("-inf"))
            ids = torch.arange(lp.shape[1], device=lp.device)
            out[:, self.head.draft_to_target(ids)] = lp
            return out, hidden
        hidden = self.head(embeds, hidden_in, fb.positions, fb)
        target = self.runner.model
        return torch.log_softmax(target.logits_processor(hidden, target.lm_head_weight, fb).float(), dim=-1), hidden

    @torch.inference_mode()
    def _tree_step(self, root_hidden: torch.Tensor | None) -> TreeStep:
        """The head's forward for one tree-expansion step, eager and in the graph alike: node n reads
        the head's output of its parent from the step before (the root reads the pending target
        hidden ``[bs, hidden_in_dim]``, through ``fc`` for EAGLE3). Returns the frontier's log-probs."""
        assert root_hidden is not None
        if isinstance(self.head, Eagle3Head):  # the root's 3h capture through fc, as step 0 does
            root_hidden = self.head.fc(root_hidden)
        bs = root_hidden.shape[0]
        outputs: list[torch.Tensor] = []  # the head's hidden per node of the previous step [bs, w, h]

        def step(width: int, fb: ForwardBatch, backend: AttentionBackend, parents: torch.Tensor) -> torch.Tensor:
            hidden_in = root_hidden[:, None, :]
            if width > 1:  # node n reads its parent's output of the step before
                prev = outputs[-1]
                index = parents[:, 1:, None].expand(bs, width - 1, prev.shape[-1])
                hidden_in = torch.cat([hidden_in, prev.gather(1, index)], dim=1)
            lp, hidden = self._head_logprobs(fb, backend, hidden_in.reshape(bs * width, -1))
            outputs.append(hidden.reshape(bs, width, -1))
            frontier = 1 if width == 1 else self.topk
            return lp.reshape(bs, width, -1)[:, width - frontier :]

        return step

    def _tree_inputs(self, reqs: list[Req], max_depths: list[int]) -> TreeDraftInputs | None:
        """The requests that draft a tree: the root at the pending position kv_len - 1 (the draft has KV
        below it), so the extend prefix is kv_len - 1. None: nobody can draft."""
        limit = self.runner.max_context_len
        k = max(max_depths)
        use = [i for i, r in enumerate(reqs)
               if r.kv_len + k <= limit and self.pending.get(r.req_pool_idx, (-1,))[0] == r.kv_len - 1]
        if not use:
            return None
        sub = [reqs[i] for i in use]
        roots = ints_to_device([[r.output_ids[-1] for r in sub]], self.runner.device)[0]
        return TreeDraftInputs(use=use, prefix=[r.kv_len - 1 for r in sub], rows=[r.req_pool_idx for r in sub],
                               roots=roots, max_depths=[max_depths[i] for i in use],
                               hidden=torch.stack([self.pending[r.req_pool_idx][1] for r in sub]))

    def _expand_eager(self, inp: TreeDraftInputs) -> torch.Tensor:
        """The expansion without graphs: each step a DRAFT_EXTEND planned on the extend backend."""
        from types import SimpleNamespace

        reqs = [SimpleNamespace(kv_len=p, req_pool_idx=r) for p, r in zip(inp.prefix, inp.rows, strict=True)]
        step_fn = self._tree_step(inp.hidden)

        def step(width: int, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
            return step_fn(width, self.tree_draft_batch(reqs, tokens, ancestors), self.extend_backend, parents)

        return expand_on_device(inp.roots, max(inp.max_depths), self.topk, step)

    def _propose_trees(self, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        """Top-k trees, expanded on the device: the partial tree is recomputed each step with the
        custom ancestor mask, node n at kv_len - 1 + depth(n); KV goes to the dummy slot (no tree state
        held). One graph replay when the tree graphs take the batch, else step by step."""
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

    def propose(self, sched: Scheduler, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        if self.topk > 1:
            return self._propose_trees(reqs, max_depths)
        k = max(max_depths)
        limit = self.runner.max_context_len
        out: list[DraftTree | None] = [None] * len(reqs)
        use = [i for i, r in enumerate(reqs)
               if r.kv_len + k <= limit and self.pending.get(r.req_pool_idx, (-1,))[0] == r.kv_len - 1]
        if not use:
            return out
        bs = len(use)
        temp = sched._alloc(bs * (k - 1)) if k > 1 else torch.empty(0, dtype=torch.int64)
        if temp is None:
            return out
        device = self.runner.device
        r2t = self.runner.req_to_token_pool.req_to_token
        prefix = [reqs[i].kv_len for i in use]  # L: the root sits at L, step 0 at L - 1
        rows = torch.tensor([reqs[i].req_pool_idx for i in use], dtype=torch.int64, device=device)
        pre_t = torch.tensor(prefix, dtype=torch.int64, device=device)
        if k > 1:
            temp = temp.view(bs, k - 1)
            r2t[rows[:, None], pre_t[:, None] + torch.arange(k - 1, device=device)[None, :]] = temp.to(torch.int32)
        step0_slots = r2t[rows, pre_t - 1].to(torch.int64)
        tokens = torch.empty(k + 1, bs, dtype=torch.int64, device=device)
        tokens[0] = torch.tensor([reqs[i].output_ids[-1] for i in use], dtype=torch.int64)
        hidden = torch.stack([self.pending[reqs[i].req_pool_idx][1] for i in use])
        if self.draft_graphs is not None and self.draft_graphs.can_run(bs, k):
            slots = torch.cat([step0_slots[None], temp.t()]) if k > 1 else step0_slots[None]
            tokens[1:] = self.draft_graphs.replay(tokens[0], rows, prefix, pre_t, slots, hidden)
        else:
            self._draft_eager(tokens, rows, prefix, pre_t, step0_slots, temp, hidden)
        if k > 1:
            sched.allocator.free(temp.flatten())
        guesses = tokens[1:].t().tolist()
        for j, i in enumerate(use):
            out[i] = DraftTree.chain(reqs[i].output_ids[-1], guesses[j][: max_depths[i]])
        return out

    def _draft_eager(self, tokens: torch.Tensor, rows: torch.Tensor, prefix: list[int], pre_t: torch.Tensor,
                     step0_slots: torch.Tensor, temp: torch.Tensor, hidden: torch.Tensor) -> None:
        """The chain loop without graphs: every step planned up front, each batch marked."""
        k, bs = tokens.shape[0] - 1, tokens.shape[1]
        batches = []
        for s in range(k):
            seq = [p + s for p in prefix]
            batches.append(ForwardBatch(
                forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=tokens[s], req_pool_indices=rows,
                seq_lens=pre_t + s, out_cache_loc=step0_slots if s == 0 else temp[:, s - 1].contiguous(),
                positions=pre_t - 1 + s, seq_lens_cpu=seq, seq_lens_sum=sum(seq)))
        self.decode_backend.plan_steps(batches)  # every step planned up front, each batch marked
        for s, fb in enumerate(batches):
            tokens[s + 1], hidden = self._head(fb, self.decode_backend.children[s], hidden)
