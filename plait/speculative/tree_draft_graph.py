"""TreeDraftGraphRunner: the whole top-k tree expansion (topk > 1) captured per (steps, batch bucket).

The eager tree draft (plait.speculative.draft_tree) runs step s as one DRAFT_EXTEND over the first
``w_s = 1 + s * topk`` nodes of every request (node n at ``prefix + depth(n)``, KV into the dummy
slot, custom mask: ones over the prefix, the ancestor matrix over the nodes). The static node layout
makes every step's shape a function of (bs, topk, s) only, so ``expand_on_device`` (the device half
of the expansion: the draft forwards, top-k, sort, the ancestor matrix) is recorded whole, and one
replay drafts every step. The host reads the packed result once (``trees_from_packed``), as eagerly.

Static buffers (owned by the runner; every graph reads prefixes of them):
  requests  roots, req_pool_indices, prefix_lens ``[max_bs]``; seq_lens and extend_lens
            ``[num_steps, max_bs]`` (row s: prefix + w_s and w_s); EAGLE's root hidden ``[max_bs, H]``
  tokens    per step s: input_ids and positions ``[max_bs * w_s]`` (written inside the graph from the
            expansion state and prefix_lens); out_cache_loc ``[max_bs * w_last]``, all DUMMY_KV_SLOT
            (the partial tree is recomputed each step, so no KV slot is held)
  mask      one flat custom mask ``[max_bs * w_last * max_context_len]`` shared by the steps. Invariant:
            all ones outside a step's forward. Inside the graph each step writes its node region
            (``node_mask_positions`` of prefix_lens: where the ancestor matrix goes) before its forward
            and sets it back to ones after, so the prefix region is ones for every request and no
            host write of the mask is needed at replay.
Planning (docs/architecture.md §3.1): step s runs on child s of the multi-step draft backend. At capture every
step's static batch is planned with ``out_graph(in_capture=True)`` and marked, and the recorded
function starts with every child's ``in_graph``. At replay the runner copies the live batch in, pads
to the bucket (padded requests: prefix 0, the reserved request row DUMMY_REQ_ROW, root token 0, KV
into DUMMY_KV_SLOT), plans one padded view per step through ``plan_steps_out_graph`` (each marked) and
replays. Padded rows expand garbage trees that nobody reads; rows never mix.

``make_step(hidden) -> step(width, fb, backend, parents) -> log-probs [bs, F, V]`` is the worker's
draft forward over one step's batch (the same function the eager path calls, so both compute alike);
``hidden`` is the root hidden ``[bs, H]`` (EAGLE) or None.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from plait.executor.graph_utils import CudaGraph, Graph, bucket_for, warm_and_capture
from plait.executor.verify_graph_runner import StaticVerifyInfo
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW
from plait.speculative.draft_backend import MultiStepDraftBackend
from plait.speculative.draft_tree import expand_on_device, node_depth
from plait.speculative.tree import node_mask_positions
from plait.transfer import ints_to_device

logger = logging.getLogger(__name__)

TreeStep = Callable[[int, ForwardBatch, Any, torch.Tensor], torch.Tensor]
MakeTreeStep = Callable[["torch.Tensor | None"], TreeStep]


@dataclass
class TreeDraftInputs:
    """The requests of one tree draft (those that draft this step) and what the expansion reads."""

    use: list[int]  # their indices in the propose call's request list
    prefix: list[int]  # extend prefix per request: node n sits at prefix + depth(n)
    rows: list[int]  # req_to_token rows
    roots: torch.Tensor  # int64 [bs]: the root tokens, on the draft's device
    max_depths: list[int]
    hidden: torch.Tensor | None = None  # [bs, H]: EAGLE's pending target hiddens (None: STANDALONE)


class TreeDraftGraphRunner:
    def __init__(self, multi: MultiStepDraftBackend, make_step: MakeTreeStep, batch_sizes: Sequence[int],
                 num_steps: int, topk: int, max_context_len: int, device: torch.device | str,
                 hidden_dim: int | None = None, hidden_dtype: torch.dtype = torch.float32,
                 graph_factory: Callable[[], Graph] = CudaGraph) -> None:
        if len(multi.children) < num_steps:
            raise ValueError(f"{num_steps} draft steps but {len(multi.children)} per-step backends")
        self.multi = multi
        self.make_step = make_step
        self.batch_sizes = list(batch_sizes)  # ascending (graph_utils.graph_batch_sizes)
        self.max_bs = max_bs = self.batch_sizes[-1]
        self.num_steps = num_steps
        self.topk = topk
        self.widths = [1 + s * topk for s in range(num_steps)]  # step s runs over w_s nodes per request
        w_last = self.widths[-1]
        i64 = dict(dtype=torch.int64, device=device)
        self.roots = torch.zeros(max_bs, **i64)
        self.req_pool_indices = torch.full((max_bs,), DUMMY_REQ_ROW, **i64)
        self.prefix_lens = torch.zeros(max_bs, **i64)
        widths_t = torch.tensor(self.widths, **i64)[:, None]  # [num_steps, 1]
        self._widths_t = widths_t
        self.extend_lens = widths_t.expand(num_steps, max_bs).contiguous()  # constant: never written again
        self.seq_lens = self.extend_lens.clone()  # prefix + w_s; padded rows have prefix 0
        self.input_ids = [torch.zeros(max_bs * w, **i64) for w in self.widths]
        self.positions = [torch.zeros(max_bs * w, **i64) for w in self.widths]
        self.out_cache_loc = torch.full((max_bs * w_last,), DUMMY_KV_SLOT, **i64)
        self._depths = torch.tensor([node_depth(n, topk) for n in range(w_last)], **i64)
        # A request's block is w x (prefix + w) and prefix + w <= the context length.
        self.custom_mask = torch.ones(max_bs * w_last * max_context_len, dtype=torch.bool, device=device)
        self.hidden = (torch.zeros(max_bs, hidden_dim, dtype=hidden_dtype, device=device)
                       if hidden_dim is not None else None)
        self._start_locs: dict[tuple[int, int], torch.Tensor] = {}
        # max_num_tokens > max_bs: the children get the multi-token (verify) static buffers, which
        # serve DRAFT_EXTEND plans with a custom mask too.
        for child in multi.children[:num_steps]:
            child.init_cuda_graph_state(max_bs, max_bs * max(2, w_last))
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.capture_batches: dict[tuple[int, int], list[ForwardBatch]] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}  # packed [bs, 3 * (1 + k * topk)] float64
        self.last_views: list[ForwardBatch] = []  # the padded per-step views of the latest replay
        self._graph_factory = graph_factory
        self.capture()

    # --- static batches ---------------------------------------------------------------------------
    def _step_batch(self, s: int, bs: int, prefix_cpu: list[int]) -> ForwardBatch:
        w = self.widths[s]
        starts = self._start_locs.get((s, bs))
        if starts is None:
            starts = self._start_locs[(s, bs)] = torch.arange(bs, device=self.roots.device) * w
        seq_cpu = [p + w for p in prefix_cpu]
        return ForwardBatch(
            forward_mode=ForwardMode.DRAFT_EXTEND, batch_size=bs, input_ids=self.input_ids[s][: bs * w],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[s, :bs],
            out_cache_loc=self.out_cache_loc[: bs * w], positions=self.positions[s][: bs * w],
            seq_lens_cpu=seq_cpu, seq_lens_sum=sum(seq_cpu),
            extend=ExtendInfo(num_tokens=bs * w, seq_lens=self.extend_lens[s, :bs], prefix_lens=self.prefix_lens[:bs],
                              start_loc=starts, seq_lens_cpu=[w] * bs, prefix_lens_cpu=prefix_cpu),
            attn_backend=self.multi.children[s], spec_info=StaticVerifyInfo(self.custom_mask, w))

    @torch.inference_mode()
    def _run(self, batches: list[ForwardBatch], bs: int) -> torch.Tensor:
        """The recorded function: the whole expansion over the static buffers of bucket ``bs``."""
        children = self.multi.children
        for child, fb in zip(children, batches, strict=False):
            child.init_forward_metadata_in_graph(fb)
        prefix = self.prefix_lens[:bs]
        for s, w in enumerate(self.widths[: len(batches)]):  # node n at prefix + depth(n)
            torch.add(prefix[:, None], self._depths[None, :w], out=self.positions[s][: bs * w].view(bs, w))
        step_fn = self.make_step(self.hidden[:bs] if self.hidden is not None else None)

        def step(width: int, tokens: torch.Tensor, parents: torch.Tensor, ancestors: torch.Tensor) -> torch.Tensor:
            s = (width - 1) // self.topk
            self.input_ids[s][: bs * width].view(bs, width).copy_(tokens)
            where = node_mask_positions(prefix, width)
            self.custom_mask[where] = ancestors.reshape(-1)
            lp = step_fn(width, batches[s], children[s], parents)
            self.custom_mask.index_fill_(0, where, True)  # back to all ones (the invariant)
            return lp

        return expand_on_device(self.roots[:bs], len(batches), self.topk, step)

    def capture(self) -> None:
        pool = None
        for k in reversed(range(1, self.num_steps + 1)):
            for bs in reversed(self.batch_sizes):
                # Captured on padding-like rows (the buffers' initial values): prefix 0, dummy request row.
                batches = [self._step_batch(s, bs, [0] * bs) for s in range(k)]
                self.multi.plan_steps_out_graph(batches, in_capture=True)  # marks every step's batch
                self.capture_batches[(k, bs)] = batches

                def run(batches: list[ForwardBatch] = batches, bs: int = bs) -> torch.Tensor:
                    return self._run(batches, bs)

                graph = self._graph_factory()
                self.outputs[(k, bs)] = warm_and_capture(graph, run, pool, self.roots.is_cuda)
                pool = graph.pool()
                self.graphs[(k, bs)] = graph
        logger.info("captured tree-draft graphs (topk %d) for %d steps x batch sizes %s", self.topk,
                    self.num_steps, self.batch_sizes)

    # --- replay -----------------------------------------------------------------------------------
    def can_run(self, bs: int, k: int) -> bool:
        return 0 < bs <= self.max_bs and 1 <= k <= self.num_steps

    def bucket(self, bs: int) -> int:
        return bucket_for(self.batch_sizes, bs)

    def replay(self, inp: TreeDraftInputs) -> torch.Tensor:
        """The packed expansion ``[bs, 3 * (1 + k * topk)]`` (k = max depth) that ``expand_on_device``
        gives eagerly: a view of the graph's output, read it before the next replay."""
        bs, k = len(inp.prefix), max(inp.max_depths)
        padded = self.bucket(bs)
        rows_t, prefix_t = ints_to_device([inp.rows, inp.prefix], self.roots.device)
        self.roots[:bs].copy_(inp.roots)
        self.req_pool_indices[:bs].copy_(rows_t)
        self.prefix_lens[:bs].copy_(prefix_t)
        torch.add(prefix_t[None, :], self._widths_t[:k], out=self.seq_lens[:k, :bs])
        if self.hidden is not None:
            assert inp.hidden is not None
            self.hidden[:bs].copy_(inp.hidden)
        if padded > bs:
            self.roots[bs:padded].zero_()
            self.req_pool_indices[bs:padded].fill_(DUMMY_REQ_ROW)
            self.prefix_lens[bs:padded].zero_()
            self.seq_lens[:k, bs:padded].copy_(self.extend_lens[:k, bs:padded])
            if self.hidden is not None:
                self.hidden[bs:padded].zero_()
        views = [self._step_batch(s, padded, list(inp.prefix) + [0] * (padded - bs)) for s in range(k)]
        self.multi.plan_steps_out_graph(views)  # the multi-step pre-planning site: each view marked
        self.last_views = views
        self.graphs[(k, padded)].replay()
        return self.outputs[(k, padded)][:bs]
