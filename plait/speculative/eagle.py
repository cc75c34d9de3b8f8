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

from typing import TYPE_CHECKING

import torch

from plait.attention.base import AttentionBackend
from plait.config import EngineConfig
from plait.distributed.parallel_state import SINGLE
from plait.forward_batch import ForwardBatch
from plait.layers.embedding import VocabParallelEmbedding
from plait.layers.logits import LogitsProcessor
from plait.mem.pools import MHATokenToKVPool
from plait.models.eagle import Eagle3Head, EagleHead, iter_checkpoint, load_head_config
from plait.models.loader import load_full_tensors
from plait.sampling.sampler import greedy_ids
from plait.scheduler.req import Req
from plait.speculative.draft_model import DraftModelWorker
from plait.speculative.tree import DraftTree
from plait.speculative.tree_draft_graph import TreeDraftInputs, TreeStep
from plait.transfer import ints_to_device

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner


def target_vocab_parts(config: EngineConfig, runner: ModelRunner
                       ) -> tuple[VocabParallelEmbedding, torch.Tensor, LogitsProcessor]:
    """(embedding, LM head weight, logits processor) of the target for a head that runs on this
    rank alone: the target's own on one rank, whole copies loaded from the checkpoint under tensor
    parallelism."""
    target = runner.model
    # DP attention keeps the embedding and LM head whole on every rank (only the MLP is sharded).
    if runner.tp.size == 1 or config.enable_dp_attention:
        return target.model.embed_tokens, target.lm_head_weight, target.logits_processor
    mc = runner.model_config
    tied = target.lm_head is None
    names = {"model.embed_tokens.weight"} | (set() if tied else {"lm_head.weight"})
    full = load_full_tensors(mc, names, config.load_format, config.seed, runner.device)
    embed = VocabParallelEmbedding(mc.vocab_size, full["model.embed_tokens.weight"].shape[1], SINGLE)
    embed.weight.data = full["model.embed_tokens.weight"]
    head = embed.weight if tied else full["lm_head.weight"]
    return embed, head, LogitsProcessor(mc.vocab_size, SINGLE)


class EagleWorker(DraftModelWorker):
    position_offset = -1  # chain step 0 recomputes the pending position (see the module docstring)

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        algo = config.speculative_algorithm
        path = config.speculative_draft_model_path
        assert path is not None
        try:
            cfg = load_head_config(path)
        except FileNotFoundError as e:
            raise ValueError(f"--speculative-draft-model-path {path!r}: no config.json ({e})") from e
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
        # The head runs on rank 0 alone: under tensor parallelism it reads whole copies of the
        # target's embedding and LM head (the target's own are vocabulary shards whose forward
        # sums over every rank).
        self.embed, self.lm_head_weight, self.logits_processor = target_vocab_parts(config, runner)
        if isinstance(self.head, Eagle3Head) and self.head.embed_tokens is not None:
            self.embed = self.head.embed_tokens.to(runner.device)
        num_heads = cfg.num_attention_heads
        self.head_num_q_heads = num_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        kv_pool = MHATokenToKVPool(runner.max_total_tokens, tcfg.dtype, cfg.num_hidden_layers,
                                   cfg.num_key_value_heads, head_dim, runner.device)
        # --- hidden states of the target: the model writes them (the runner's HiddenCapture) ---
        capture = runner.hidden_capture
        assert capture is not None, "the model runner makes the capture of EAGLE engines"
        self.capture = capture
        self.capture_layers = [li for li in capture.layers if li >= 0]
        # row -> (position, target hidden at that position): see the module docstring.
        self.pending: dict[int, tuple[int, torch.Tensor]] = {}
        self._verify_hidden: torch.Tensor | None = None  # the latest verify forward's hiddens
        self._verify_widths: list[int] = []  # its rows per request
        self.hidden_in_dim = tcfg.hidden_size * (len(self.capture_layers) if self.is_eagle3 else 1)
        super().__init__(config, runner, kv_pool, num_heads)

    # --- capture ----------------------------------------------------------------------------------
    def _take_hidden(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens, hidden_in_dim]: the latest target forward's hidden states (a view of the
        capture buffer, valid until the next target forward)."""
        return self.capture.read(num_tokens)

    def close(self) -> None:
        super().close()
        vars(self).pop("head", None)

    def on_finish(self, req: Req) -> None:
        super().on_finish(req)
        if req.req_pool_idx is not None:
            self.pending.pop(req.req_pool_idx, None)

    # --- draft forwards ---------------------------------------------------------------------------
    @torch.inference_mode()
    def _head(self, fb: ForwardBatch, backend: AttentionBackend, hidden_in: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """(target-vocab argmax ids, the head's hidden for the next step) for every row of fb."""
        logits, hidden = self._head_forward(fb, backend, hidden_in)
        ids = greedy_ids(logits)
        if isinstance(self.head, Eagle3Head):
            ids = self.head.draft_to_target(ids)
        return ids, hidden

    def _head_forward(self, fb: ForwardBatch, backend: AttentionBackend, hidden_in: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(logits over the head's vocabulary, the head's hidden) for every row of fb: for EAGLE3 the
        draft vocabulary (``draft_to_target`` maps its ids), else the target's. Plans on ``backend``
        unless the batch is marked planned (graph steps are)."""
        fb.attn_backend = backend
        if fb.needs_forward_metadata_init():
            backend.init_forward_metadata(fb)
        embeds = self.embed(fb.input_ids)
        if isinstance(self.head, Eagle3Head):
            return self.head(embeds, hidden_in, fb.positions, fb)
        hidden = self.head(embeds, hidden_in, fb.positions, fb)
        return self.logits_processor(hidden, self.lm_head_weight, fb), hidden

    def chain_step(self, fb: ForwardBatch, backend: AttentionBackend, hidden: torch.Tensor | None
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        assert hidden is not None
        return self._head(fb, backend, hidden)

    def can_draft(self, req: Req) -> bool:
        """The head drafts from the pending hidden at position kv_len - 1 (none right after a
        prefix-cache hit, for example: the request then decodes normally once)."""
        return self.pending.get(req.row, (-1,))[0] == req.kv_len - 1

    def chain_hidden(self, reqs: list[Req]) -> torch.Tensor:
        return torch.stack([self.pending[r.row][1] for r in reqs])

    def _draft_extend(self, rows: list[int], starts: list[int], lens: list[int], ids: torch.Tensor | list[int],
                      hidden: torch.Tensor) -> None:
        """The head over positions ``[starts[i], starts[i] + lens[i])`` of row ``rows[i]``, from the
        packed ``ids`` (token p + 1 for position p) and ``hidden`` (target hidden at p)."""
        fb = self.draft_extend_batch(rows, starts, lens, ids)
        if fb is not None:
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
            assert fb.extend is not None
            ext, pre = list(fb.extend.seq_lens_cpu), list(fb.extend.prefix_lens_cpu)
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
    def graph_pad_width(self, trees: list[DraftTree]) -> None:
        """Not padded for graphs (DP attention pads every verify block: ``verify_pad_width``)."""
        return None

    def after_verify_forward(self, fb: ForwardBatch) -> None:
        self._verify_hidden = self._take_hidden(fb.num_tokens)
        assert fb.spec_info is not None
        widths = fb.spec_info.num_tokens_per_req
        # Each request's block of the verify rows (padded or not): where after_accept finds its nodes.
        self._verify_widths = [widths] * fb.batch_size if isinstance(widths, int) else list(widths)

    def after_accept(self, reqs: list[Req], trees: list[DraftTree], results: list[tuple[list[int], int]],
                     old_kv_lens: list[int]) -> None:
        device = self.runner.device
        hidden = self._verify_hidden
        assert hidden is not None
        rows, starts, lens, ids, hid_idx = [], [], [], [], []
        off = 0
        for req, tree, (path, _), L, width in zip(reqs, trees, results, old_kv_lens, self._verify_widths,
                                                   strict=True):
            j = len(path) - 1
            rows.append(req.req_pool_idx)
            starts.append(L)
            lens.append(j)
            ids.extend(tree.path_tokens(path[1:]))
            hid_idx.extend(off + n for n in path[:-1])
            self.pending[req.req_pool_idx] = (L + j, hidden[off + path[-1]].clone())
            off += width
        if ids:
            self._draft_extend(rows, starts, lens, ids, hidden[torch.tensor(hid_idx, device=device)])
        self._verify_hidden = None

    # --- drafting ---------------------------------------------------------------------------------
    @torch.inference_mode()
    def _head_logprobs(self, fb: ForwardBatch, backend: AttentionBackend, hidden_in: torch.Tensor
                       ) -> tuple[torch.Tensor, torch.Tensor]:
        """(log-probabilities over the target vocabulary, the head's hidden) for every row of fb."""
        logits, hidden = self._head_forward(fb, backend, hidden_in)
        lp = torch.log_softmax(logits.float(), dim=-1)
        if not isinstance(self.head, Eagle3Head):
            return lp, hidden
        # Draft id d is target id d + d2t[d]; target ids outside the draft vocabulary get -inf.
        out = lp.new_full((lp.shape[0], self.runner.model_config.vocab_size), float("-inf"))
        out[:, self.head.draft_to_target(torch.arange(lp.shape[1], device=lp.device))] = lp
        return out, hidden

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
        use = [i for i, r in enumerate(reqs) if r.kv_len + k <= limit and self.can_draft(r)]
        if not use:
            return None
        sub = [reqs[i] for i in use]
        roots = ints_to_device([[r.output_ids[-1] for r in sub]], self.runner.device)[0]
        return TreeDraftInputs(use=use, prefix=[r.kv_len - 1 for r in sub], rows=[r.req_pool_idx for r in sub],
                               roots=roots, max_depths=[max_depths[i] for i in use], hidden=self.chain_hidden(sub))
