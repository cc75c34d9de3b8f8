"""DraftLoopGraphRunner: the whole k-step chain draft loop (topk = 1) captured per (k, batch bucket).

Step s of a chain draft is a DECODE forward of one token per request at position
``prefix + offset + s`` (offset 0 for STANDALONE, -1 for EAGLE, whose step 0 recomputes the pending
position) writing its KV into ``slots[s]``; its argmax is step s + 1's input. Inside the recorded
function that hand-off is a device copy into the static token buffer, so the loop has no host sync.

Planning goes through the multi-step draft backend (docs/architecture.md §3.1): at capture every step's static
batch is planned on its own child (``out_graph(in_capture=True)``) and marked; the recorded function
starts with every child's ``in_graph``. At replay the runner builds one padded view per step, plans
them through ``MultiStepDraftBackend.plan_steps_out_graph`` (each view marked), and replays.
Padded requests read the reserved request row with seq len 1 and write the reserved dummy KV slot.

``step_fn(fb, backend, hidden) -> (target token ids [bs], next hidden or None)`` is the worker's one
draft forward; ``hidden_dim`` sizes the static hidden input of step 0 (EAGLE; None for STANDALONE).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch

from plait.config import EngineConfig
from plait.executor.graph_utils import CudaGraph, Graph, bucket_for, graph_batch_sizes, warm_and_capture
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW
from plait.speculative.draft_backend import MultiStepDraftBackend

logger = logging.getLogger(__name__)

StepFn = Callable[[ForwardBatch, Any, "torch.Tensor | None"], "tuple[torch.Tensor, torch.Tensor | None]"]


def draft_graph_batch_sizes(config: EngineConfig, device: str) -> list[int] | None:
    """The draft loop's captured batch sizes (the decode graphs'), or None: no draft graphs (not on a
    GPU, or graphs disabled)."""
    if device != "cuda" or config.disable_cuda_graph:
        return None
    return graph_batch_sizes(config)


class DraftLoopGraphRunner:
    def __init__(self, multi: MultiStepDraftBackend, step_fn: StepFn, batch_sizes: Sequence[int], num_steps: int,
                 position_offset: int, device: torch.device | str, hidden_dim: int | None = None,
                 hidden_dtype: torch.dtype = torch.float32, graph_factory: Callable[[], Graph] = CudaGraph) -> None:
        if len(multi.children) < num_steps:
            raise ValueError(f"{num_steps} draft steps but {len(multi.children)} per-step backends")
        self.multi = multi
        self.step_fn = step_fn
        self.batch_sizes = list(batch_sizes)  # ascending (graph_utils.graph_batch_sizes)
        self.max_bs = max_bs = self.batch_sizes[-1]
        self.num_steps = num_steps
        self.position_offset = position_offset
        i64 = dict(dtype=torch.int64, device=device)
        k = num_steps
        self.tokens = torch.zeros(k + 1, max_bs, **i64)  # row 0: roots; row s + 1: step s's argmax
        self.req_pool_indices = torch.full((max_bs,), DUMMY_REQ_ROW, **i64)
        self.positions = torch.zeros(k, max_bs, **i64)
        self.seq_lens = torch.ones(k, max_bs, **i64)
        self.out_cache_loc = torch.full((k, max_bs), DUMMY_KV_SLOT, **i64)
        self._step_offsets = (torch.arange(k, **i64) + position_offset)[:, None]  # [k, 1]: step s's position - prefix
        self.hidden = (torch.zeros(max_bs, hidden_dim, dtype=hidden_dtype, device=device)
                       if hidden_dim is not None else None)
        for child in multi.children[:k]:
            child.init_cuda_graph_state(max_bs, max_bs)
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.capture_batches: dict[tuple[int, int], list[ForwardBatch]] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.last_views: list[ForwardBatch] = []  # the padded per-step views of the latest replay
        self._graph_factory = graph_factory
        self.capture()

    def _step_batch(self, s: int, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.tokens[s, :bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[s, :bs],
            out_cache_loc=self.out_cache_loc[s, :bs], positions=self.positions[s, :bs],
            seq_lens_cpu=seq_lens_cpu, seq_lens_sum=sum(seq_lens_cpu), attn_backend=self.multi.children[s])

    def capture(self) -> None:
        pool = None
        for k in reversed(range(1, self.num_steps + 1)):
            for bs in reversed(self.batch_sizes):
                batches = [self._step_batch(s, bs, [1] * bs) for s in range(k)]
                self.multi.plan_steps_out_graph(batches, in_capture=True)  # marks every step's batch
                self.capture_batches[(k, bs)] = batches

                def run(batches: list[ForwardBatch] = batches, k: int = k, bs: int = bs) -> torch.Tensor:
                    for child, fb in zip(self.multi.children, batches, strict=False):
                        child.init_forward_metadata_in_graph(fb)
                    hidden = self.hidden[:bs] if self.hidden is not None else None
                    for s, fb in enumerate(batches):
                        ids, hidden = self.step_fn(fb, self.multi.children[s], hidden)
                        self.tokens[s + 1, :bs].copy_(ids)
                    return self.tokens[1 : k + 1, :bs]

                graph = self._graph_factory()
                self.outputs[(k, bs)] = warm_and_capture(graph, run, pool, self.tokens.is_cuda)
                pool = graph.pool()
                self.graphs[(k, bs)] = graph
        logger.info("captured draft-loop graphs for %d steps x batch sizes %s", self.num_steps, self.batch_sizes)

    def can_run(self, bs: int, k: int) -> bool:
        return 0 < bs <= self.max_bs and 1 <= k <= self.num_steps

    def bucket(self, bs: int) -> int:
        return bucket_for(self.batch_sizes, bs)

    def replay(self, roots: torch.Tensor, rows: torch.Tensor, prefix: list[int], prefix_t: torch.Tensor,
               slots: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
        """roots/rows/prefix_t [bs], slots [k, bs] (step s's KV slots), hidden [bs, H] or None.
        Returns the drafted tokens [k, bs] (a view of the static buffer: read it before the next replay)."""
        k, bs = slots.shape
        padded = self.bucket(bs)
        self.tokens[0, :bs].copy_(roots)
        self.req_pool_indices[:bs].copy_(rows)
        # Written in place (one kernel each): replay staging is launched while the GPU idles.
        torch.add(prefix_t[None, :], self._step_offsets[:k], out=self.positions[:k, :bs])
        torch.add(self.positions[:k, :bs], 1, out=self.seq_lens[:k, :bs])
        self.out_cache_loc[:k, :bs].copy_(slots)
        if self.hidden is not None:
            assert hidden is not None
            self.hidden[:bs].copy_(hidden)
        if padded > bs:
            self.tokens[0, bs:padded].zero_()
            self.req_pool_indices[bs:padded].fill_(DUMMY_REQ_ROW)
            self.positions[:k, bs:padded].zero_()
            self.seq_lens[:k, bs:padded].fill_(1)
            self.out_cache_loc[:k, bs:padded].fill_(DUMMY_KV_SLOT)
        pad = [1] * (padded - bs)
        views = [self._step_batch(s, padded, [p + self.position_offset + s + 1 for p in prefix] + pad)
                 for s in range(k)]
        self.multi.plan_steps_out_graph(views)  # the multi-step pre-planning site: each view marked
        self.last_views = views
        self.graphs[(k, padded)].replay()
        return self.outputs[(k, padded)][:, :bs]
