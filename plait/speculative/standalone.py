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
Drafting (``plait.speculative.draft_model``): chain step s runs at ``kv_len + s``, from the root
token; tree nodes sit at ``kv_len + depth``.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from plait.attention.base import AttentionBackend
from plait.config import EngineConfig
from plait.distributed.parallel_state import SINGLE
from plait.forward_batch import ForwardBatch
from plait.mem.pools import MHATokenToKVPool, log_device_memory
from plait.models.loader import load_model, load_model_config
from plait.sampling.sampler import greedy_ids
from plait.scheduler.req import Req
from plait.speculative.draft_model import DraftModelWorker
from plait.speculative.tree import DraftTree
from plait.speculative.tree_draft_graph import TreeDraftInputs, TreeStep
from plait.transfer import ints_to_device

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner


class StandaloneWorker(DraftModelWorker):
    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
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
        kv_pool = MHATokenToKVPool(runner.max_total_tokens, mc.dtype, mc.num_layers, mc.num_kv_heads,
                                   mc.head_dim, runner.device)
        super().__init__(config, runner, kv_pool, mc.num_heads)

    def chain_step(self, fb: ForwardBatch, backend: AttentionBackend, hidden: torch.Tensor | None
                   ) -> tuple[torch.Tensor, None]:
        logits = self._forward(fb, backend, logits=True)
        assert logits is not None
        return greedy_ids(logits), None

    def close(self) -> None:
        super().close()
        vars(self).pop("draft_model", None)

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
        ids = [t for tree, (path, _) in zip(trees, results, strict=True) for t in tree.path_tokens(path)]
        fb = self.draft_extend_batch([r.row for r in reqs], old_kv_lens,
                                     [len(path) for path, _ in results], ids)
        if fb is not None:
            self._forward(fb, self.extend_backend, logits=False)

    # --- drafting ---------------------------------------------------------------------------------
    def _tree_step(self, root_hidden: torch.Tensor | None) -> TreeStep:
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
