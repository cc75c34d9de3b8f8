"""STANDALONE: a separate small draft model with the target's tokenizer.

Memory: the draft owns a KV pool with the target's slot numbering, so one ``req_to_token`` map and
one slot allocator serve both models: slot s holds position p of a request in the target pool and in
the draft pool alike. The invariant is that the draft has KV for every position below a request's
``kv_len``:
  * every plain target forward (prefill chunks, decodes of requests that did not speculate) is
    mirrored by the draft on the same batch (``after_target_forward``), so prefix-cache hits and
    re-prefills after retraction carry draft KV too;
  * after verification the draft extends over the accepted tokens (root + accepted drafts) into
    their final slots (``after_accept``, DRAFT_EXTEND).
Drafting: ``num_steps`` decode steps over temporary slots (freed right after), all planned up front
through the multi-step draft backend, each step's batch marked. Drafts are the draft model's argmax
(a one-hot draft distribution), so sampled requests use the one-hot tree acceptance rule and the
target distribution is kept exactly.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import torch

from plait.attention.base import AttentionBackend
from plait.config import EngineConfig
from plait.distributed.parallel_state import SINGLE
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool, log_device_memory
from plait.models.loader import load_model, load_model_config
from plait.sampling.sampler import greedy_ids
from plait.speculative.draft_backend import DraftBackendFactory
from plait.speculative.draft_graph import DraftLoopGraphRunner, draft_graph_max_bs
from plait.speculative.draft_tree import expand_on_device, trees_from_packed
from plait.speculative.tree import DraftTree
from plait.speculative.tree_draft_graph import TreeDraftGraphRunner, TreeDraftInputs, TreeStep
from plait.speculative.worker import SpecWorker
from plait.transfer import ints_to_device

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner
    from plait.scheduler.req import Req
    from plait.scheduler.scheduler import Scheduler


class StandaloneWorker(SpecWorker):
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        path = config.speculative_draft_model_path
        assert path is not None
        try:
            mc = load_model_config(path, config.dtype, runner.device, runner.max_context_len)
        except (ValueError, FileNotFoundError) as e:
            raise ValueError(f"--speculative-draft-model-path {path!r}: {e}") from e
        target_mc = runner.model_config
        if mc.vocab_size != target_mc.vocab_size:
            raise ValueError(f"--speculative-draft-model-path: the draft's vocabulary ({mc.vocab_size}) differs "
                             f"from the target's ({target_mc.vocab_size}); STANDALONE needs the same tokenizer")
        self.draft_config = mc
        self.draft_model = load_model(mc, runner.device, config.load_format, SINGLE, config.seed)
        log_device_memory("the draft model's weights", runner.device)
        self.kv_pool = MHATokenToKVPool(runner.max_total_tokens, mc.dtype, mc.num_layers, mc.num_kv_heads,
                                        mc.head_dim, runner.device)
        name = config.speculative_draft_attention_backend or config.attention_backends()[1]
        factory = DraftBackendFactory(name, runner.req_to_token_pool, self.kv_pool, mc.num_heads,
                                      stamps_children=True)
        self.extend_backend: AttentionBackend = factory.create_extend_backend()
        self.decode_backend = factory.create_decode_backend(self.num_steps)
        self.draft_graphs: DraftLoopGraphRunner | None = None  # the chain loop (topk 1)
        self.tree_graphs: TreeDraftGraphRunner | None = None  # the tree expansion (topk > 1)
        max_bs = draft_graph_max_bs(config, runner.device)
        if max_bs is not None and self.topk == 1:
            self.draft_graphs = self.build_draft_graphs(max_bs)
        elif max_bs is not None:
            self.tree_graphs = self.build_tree_graphs(max_bs)

    def build_draft_graphs(self, max_bs: int, graph_factory: Any = None) -> DraftLoopGraphRunner:
        """Capture the chain draft loop per (steps, batch bucket); tests pass an EagerGraph factory."""
        extra = {} if graph_factory is None else {"graph_factory": graph_factory}
        return DraftLoopGraphRunner(self.decode_backend, self._draft_step, max_bs, self.num_steps,
                                    position_offset=0, device=self.runner.device, **extra)

    def build_tree_graphs(self, max_bs: int, graph_factory: Any = None) -> TreeDraftGraphRunner:
        """Capture the top-k tree expansion per (steps, batch bucket) on the per-step draft backends;
        tests pass an EagerGraph factory."""
        extra = {} if graph_factory is None else {"graph_factory": graph_factory}
        return TreeDraftGraphRunner(self.decode_backend, self._tree_step, max_bs, self.num_steps, self.topk,
                                    self.runner.max_context_len, self.runner.device, **extra)

    def _draft_step(self, fb: ForwardBatch, backend: AttentionBackend, hidden: torch.Tensor | None
                    ) -> tuple[torch.Tensor, None]:
        """One chain step: the draft's argmax, as device ops only (it runs inside the captured loop)."""
        logits = self._forward(fb, backend, logits=True)
        assert logits is not None
        return greedy_ids(logits), None

    def close(self) -> None:
        self.draft_model = None  # type: ignore[assignment]
        self.kv_pool = None  # type: ignore[assignment]
        self.extend_backend = None  # type: ignore[assignment]
        self.decode_backend = None  # type: ignore[assignment]
        self.draft_graphs = None
        self.tree_graphs = None

    # --- draft forwards ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, fb: ForwardBatch, backend: AttentionBackend, logits: bool) -> torch.Tensor | None:
        fb.attn_backend = backend
        if fb.needs_forward_metadata_init():
            backend.init_forward_metadata(fb)
        hidden = self.draft_model.model(fb.input_ids, fb.positions, fb)
        if not logits:
            return None
        return self.draft_model.logits_processor(hidden, self.draft_model.lm_head_weight, fb)

    def after_target_forward(self, fb: ForwardBatch) -> None:
        if fb.forward_mode.is_idle():
            return
        # A derived batch: its own backend, no sampling or logits rows, and a fresh plan marker.
        view = dataclasses.replace(fb, attn_backend=None, sampling_info=None, spec_info=None, logits_indices=None)
        view.reset_forward_metadata_marker()
        self._forward(view, self.extend_backend, logits=False)

    def after_accept(self, reqs: list[Req], trees: list[DraftTree], results: list[tuple[list[int], int]],
                     old_kv_lens: list[int]) -> None:
        """DRAFT_EXTEND over the root and the accepted drafts, into their final slots."""
        device = self.runner.device
        r2t = self.runner.req_to_token_pool.req_to_token
        ids: list[int] = []
        pos: list[int] = []
        ext = [len(path) for path, _ in results]
        locs = []
        for req, tree, (path, _), pre in zip(reqs, trees, results, old_kv_lens, strict=True):
            ids.extend(tree.path_tokens(path))
            pos.extend(range(pre, pre + len(path)))
            locs.append(r2t[req.req_pool_idx, pre : pre + len(path)])
        seq = [p + e for p, e in zip(old_kv_lens, ext, strict=True)]
        starts = [sum(ext[:i]) for i in range(len(ext))]
        rows = [r.req_pool_idx for r in reqs]
        parts = [ids, pos, rows, seq, ext, old_kv_lens, starts]
        ids_t, pos_t, rows_t, seq_t, ext_t, pre_t, starts_t = ints_to_device(parts, device)
        fb = ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=len(reqs), input_ids=ids_t, req_pool_indices=rows_t,
            seq_lens=seq_t, out_cache_loc=torch.cat(locs).to(torch.int64), positions=pos_t, seq_lens_cpu=seq,
            seq_lens_sum=sum(seq), extend_num_tokens=len(ids), extend_seq_lens=ext_t, extend_prefix_lens=pre_t,
            extend_start_loc=starts_t, extend_seq_lens_cpu=ext, extend_prefix_lens_cpu=list(old_kv_lens),
        )
        self._forward(fb, self.extend_backend, logits=False)

    # --- drafting ---------------------------------------------------------------------------------
    def _tree_step(self, hidden: torch.Tensor | None) -> TreeStep:
        """The draft's forward for one tree-expansion step, eager and in the graph alike: logits only
        at the frontier (the last F nodes of each request; device ops, no host sync), as log-probs."""

        def step(width: int, fb: ForwardBatch, backend: AttentionBackend, parents: torch.Tensor) -> torch.Tensor:
            bs, device = fb.batch_size, fb.input_ids.device
            frontier = 1 if width == 1 else self.topk
            nodes = torch.arange(width - frontier, width, device=device)
            fb.logits_indices = (torch.arange(bs, device=device)[:, None] * width + nodes[None, :]).reshape(-1)
            logits = self._forward(fb, backend, logits=True)
            assert logits is not None
            return torch.log_softmax(logits.float(), dim=-1).reshape(bs, frontier, -1)

        return step

    def _tree_inputs(self, reqs: list[Req], max_depths: list[int]) -> TreeDraftInputs:
        """Every request drafts: node n at kv_len + depth(n) (the draft has KV below kv_len)."""
        roots = ints_to_device([[r.output_ids[-1] for r in reqs]], self.runner.device)[0]
        return TreeDraftInputs(use=list(range(len(reqs))), prefix=[r.kv_len for r in reqs],
                               rows=[r.req_pool_idx for r in reqs], roots=roots, max_depths=list(max_depths))

    def _expand_eager(self, inp: TreeDraftInputs) -> torch.Tensor:
        """The expansion without graphs: each step an extend planned on the extend backend."""
        from types import SimpleNamespace

        reqs = [SimpleNamespace(kv_len=p, req_pool_idx=r) for p, r in zip(inp.prefix, inp.rows, strict=True)]
        step_fn = self._tree_step(None)

        def step(width: int, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
            return step_fn(width, self.tree_draft_batch(reqs, tokens, ancestors), self.extend_backend, parents)

        return expand_on_device(inp.roots, max(inp.max_depths), self.topk, step)

    def _propose_trees(self, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        """Top-k trees, expanded on the device: each step is one extend over every node of the partial
        trees (custom ancestor mask, node i at kv_len + depth(i)); KV goes to the reserved dummy slot,
        as the tree is recomputed each step and the accepted path is re-extended after verification.
        One graph replay when the tree graphs take the batch, else step by step."""
        inp = self._tree_inputs(reqs, max_depths)
        graphs = self.tree_graphs
        if graphs is not None and graphs.can_run(len(inp.use), max(inp.max_depths)):
            packed = graphs.replay(inp)
        else:
            packed = self._expand_eager(inp)
        return list(trees_from_packed(packed, inp.max_depths, self.topk, self.num_draft_tokens))

    def propose(self, sched: Scheduler, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        if self.topk > 1:
            return self._propose_trees(reqs, max_depths)
        # Every request runs the same number of draft steps (one batch per step); a request too
        # close to the end of its context for that many positions decodes normally instead.
        k = max(max_depths)
        limit = self.runner.max_context_len
        use = [i for i, r in enumerate(reqs) if r.kv_len + k <= limit]
        out: list[DraftTree | None] = [None] * len(reqs)
        if not use:
            return out
        bs = len(use)
        temp = sched._alloc(bs * k)
        if temp is None:
            return out
        device = self.runner.device
        temp = temp.view(bs, k)
        r2t = self.runner.req_to_token_pool.req_to_token
        prefix = [reqs[i].kv_len for i in use]
        rows = torch.tensor([reqs[i].req_pool_idx for i in use], dtype=torch.int64, device=device)
        pre_t = torch.tensor(prefix, dtype=torch.int64, device=device)
        steps = torch.arange(k, device=device)
        # Draft step s writes position prefix + s; map those positions to the temporary slots now,
        # before planning (backends read req_to_token when they plan).
        r2t[rows[:, None], pre_t[:, None] + steps[None, :]] = temp.to(torch.int32)
        tokens = torch.empty(k + 1, bs, dtype=torch.int64, device=device)
        tokens[0] = torch.tensor([reqs[i].output_ids[-1] for i in use], dtype=torch.int64)
        if self.draft_graphs is not None and self.draft_graphs.can_run(bs, k):
            tokens[1:] = self.draft_graphs.replay(tokens[0], rows, prefix, pre_t, temp.t(), None)
        else:
            batches = []
            for s in range(k):
                seq = [p + s + 1 for p in prefix]
                batches.append(ForwardBatch(
                    forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=tokens[s], req_pool_indices=rows,
                    seq_lens=pre_t + s + 1, out_cache_loc=temp[:, s].contiguous(), positions=pre_t + s,
                    seq_lens_cpu=seq, seq_lens_sum=sum(seq)))
            self.decode_backend.plan_steps(batches)  # every step planned up front, each batch marked
            for s, fb in enumerate(batches):
                tokens[s + 1] = self._draft_step(fb, self.decode_backend.children[s], None)[0]
        sched.allocator.free(temp.flatten())
        guesses = tokens[1:].t().tolist()
        for j, i in enumerate(use):
            out[i] = DraftTree.chain(reqs[i].output_ids[-1], guesses[j][: max_depths[i]])
        return out
