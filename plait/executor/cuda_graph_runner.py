"""CudaGraphRunner: captures the decode forward per batch-size bucket and replays it.

Capture (largest bucket first, all into one memory pool): a batch over the static buffers is planned
outside the capture with ``init_forward_metadata_out_graph(fb, in_capture=True)`` and marked
planned; the recorded function starts with ``init_forward_metadata_in_graph(fb)`` and then runs the
model, so every replay rebuilds the KV indices on the device.

Replay: copy the live batch into the static buffers, pad to the bucket (padded rows read the
reserved request row 0 with the backend's seq-len fill value and write their KV into the reserved
dummy slot 0, never a live request's), plan on a padded view unless the batch is already planned
(and mark the view, as every pre-planning site does), replay, and slice the logits back to the live
rows.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from plait.executor.graph_utils import (
    CaptureTarget,
    CudaGraph,
    Graph,
    GraphFactory,
    bucket_for,
    dp_graph_batch_size,
    holds,
    stage,
    warm_and_capture,
)
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW
from plait.models.llama import LogitsOutput

logger = logging.getLogger(__name__)


class CudaGraphRunner:
    def __init__(self, target: CaptureTarget, batch_sizes: Sequence[int], graph_factory: GraphFactory = CudaGraph,
                 pad: bool = True) -> None:
        self.target = target
        self.pad = pad  # False: only a captured batch size replays (graph_utils.holds)
        self.backend = target.backend
        self.batch_sizes = list(batch_sizes)  # ascending (graph_utils.graph_batch_sizes)
        self.max_bs = max_bs = self.batch_sizes[-1]
        self.fill_value = self.backend.get_cuda_graph_seq_len_fill_value()
        i64 = dict(dtype=torch.int64, device=target.device)
        # Static inputs: every captured graph reads prefixes of these.
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.req_pool_indices = torch.full((max_bs,), DUMMY_REQ_ROW, **i64)
        self.seq_lens = torch.full((max_bs,), self.fill_value, **i64)
        self.out_cache_loc = torch.full((max_bs,), DUMMY_KV_SLOT, **i64)
        # Static output: every graph's LM head writes its logits here (one buffer, not one per graph).
        self.logits_buffer = target.logits_buffer(max_bs)
        self.backend.init_cuda_graph_state(max_bs, max_bs)
        self.graphs: dict[int, Graph] = {}
        self.capture_batches: dict[int, ForwardBatch] = {}  # the planned static batch of each graph
        self.outputs: dict[int, LogitsOutput] = {}
        self._graph_factory = graph_factory
        self.capture()

    # --- capture ----------------------------------------------------------------------------------
    def _static_batch(self, bs: int, seq_lens_cpu: list[int]) -> ForwardBatch:
        return ForwardBatch(
            forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
            out_cache_loc=self.out_cache_loc[:bs], positions=self.positions[:bs],
            seq_lens_cpu=seq_lens_cpu, seq_lens_sum=sum(seq_lens_cpu), attn_backend=self.backend,
            next_token_logits_buffer=self.logits_buffer, hidden_capture=self.target.hidden_capture,
        )

    def capture(self) -> None:
        pool = None
        model = self.target.model
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs, [self.fill_value] * bs)
            self.target.prepare_capture(fb)
            self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
            fb.mark_forward_metadata_ready()
            self.capture_batches[bs] = fb

            def run(fb: ForwardBatch = fb) -> LogitsOutput:
                self.backend.init_forward_metadata_in_graph(fb)
                return model(fb.input_ids, fb.positions, fb)

            graph = self._graph_factory()
            self.outputs[bs] = warm_and_capture(graph, run, pool, self.input_ids.is_cuda)
            pool = graph.pool()
            self.graphs[bs] = graph
        logger.info("captured CUDA graphs for batch sizes %s", self.batch_sizes)

    # --- replay -----------------------------------------------------------------------------------
    # The DP graph batch size (can_run and replay both ask it), shared with the verify graphs.
    max_dp_batch_size = staticmethod(dp_graph_batch_size)

    def graph_batch_size(self, fb: ForwardBatch) -> int:
        return self.max_dp_batch_size(fb) if fb.mlp_sync.global_num_tokens_cpu is not None else fb.batch_size

    def can_run(self, fb: ForwardBatch) -> bool:
        if fb.spec_info is not None:
            return False
        if fb.mlp_sync.global_num_tokens_cpu is not None:
            # DP attention: the graphs hold the MLP collectives, so every rank must decide alike, from
            # the global counts only. A rank with no requests (IDLE) replays the bucket on padding rows.
            return (fb.mlp_sync.can_run_dp_cuda_graph and (fb.forward_mode.is_decode() or fb.forward_mode.is_idle())
                    and holds(self.batch_sizes, self.max_dp_batch_size(fb), self.pad))
        return fb.forward_mode.is_decode() and holds(self.batch_sizes, fb.batch_size, self.pad)

    def bucket(self, bs: int) -> int:
        return bucket_for(self.batch_sizes, bs)

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        bs = fb.batch_size
        padded = self.bucket(self.graph_batch_size(fb))
        stage(self.input_ids, fb.input_ids, padded, 0)
        stage(self.positions, fb.positions, padded, 0)
        stage(self.req_pool_indices, fb.req_pool_indices, padded, DUMMY_REQ_ROW)
        stage(self.seq_lens, fb.seq_lens, padded, self.fill_value)
        stage(self.out_cache_loc, fb.out_cache_loc, padded, DUMMY_KV_SLOT)
        if fb.needs_forward_metadata_init():
            seq_lens_cpu = list(fb.seq_lens_cpu) + [self.fill_value] * (padded - bs)
            view = self._static_batch(padded, seq_lens_cpu)
            view.actual_forward_mode = fb.forward_mode
            # The captured step's MLP sync: under DP attention with two-batch overlap, whether the
            # graph runs two micro-batches was decided at capture, and the view must split as it did.
            view.mlp_sync = self.capture_batches[padded].mlp_sync
            self.backend.init_forward_metadata_out_graph(view)
            view.mark_forward_metadata_ready()  # a pre-planning site marks what it planned
        self.graphs[padded].replay()
        return LogitsOutput(next_token_logits=self.outputs[padded].next_token_logits[:bs])
