"""CudaGraphRunner: captures the decode forward per batch-size bucket and replays it.

Capture (largest bucket first, all into one memory pool): a batch over the static buffers is planned
outside the capture with ``init_forward_metadata_out_graph(fb, in_capture=True)`` and marked planned
(DESIGN 3.1); the recorded function starts with ``init_forward_metadata_in_graph(fb)`` and then runs
the model, so every replay rebuilds the KV indices on the device.

Replay: copy the live batch into the static buffers, pad to the bucket (padded rows read the
reserved request row 0 with the backend's seq-len fill value and write their KV into the reserved
dummy slot 0, never a live request's), plan on a padded view unless the batch is already planned,
replay, and slice the logits back to the live rows.

The graph object is injected (``graph_factory``) so the bucket/padding/plan logic runs on the CPU
in tests with an eager stand-in that re-executes the recorded function on replay.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from plait import envs
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW
from plait.models.llama import LogitsOutput

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


class Graph(Protocol):
    def capture(self, fn: Callable[[], Any], pool: Any) -> Any: ...
    def replay(self) -> None: ...
    def pool(self) -> Any: ...


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream() -> torch.cuda.Stream:
    """One side stream per device for graph captures (a capture must not run on the default stream)."""
    index = torch.cuda.current_device()
    if index not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[index] = torch.cuda.Stream(index)
    return _CAPTURE_STREAMS[index]


class CudaGraph:
    """A torch.cuda.CUDAGraph behind the Graph protocol."""

    def __init__(self) -> None:
        self.graph = torch.cuda.CUDAGraph()

    def capture(self, fn: Callable[[], Any], pool: Any) -> Any:
        # The capture stream is the current device's: torch.cuda.graph's default is one stream for the
        # process, made on whichever device captured first, so a second replica's capture on another
        # GPU recorded nothing (and Triton launched onto a foreign stream).
        with torch.cuda.graph(self.graph, pool=pool, stream=_capture_stream()):
            return fn()

    def replay(self) -> None:
        self.graph.replay()

    def pool(self) -> Any:
        return self.graph.pool()


class EagerGraph:
    """Stand-in for tests on the CPU: replay re-runs the recorded function into the same outputs
    (a LogitsOutput's logits, or a plain tensor such as the draft loop's tokens)."""

    def __init__(self) -> None:
        self.fn: Callable[[], Any] | None = None
        self.out: Any = None
        self.replays = 0

    def capture(self, fn: Callable[[], Any], pool: Any) -> Any:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        assert self.fn is not None and self.out is not None
        with torch.inference_mode():  # the recorded outputs are inference tensors
            new = self.fn()
            if isinstance(self.out, torch.Tensor):
                self.out.copy_(new)
            else:
                self.out.next_token_logits.copy_(new.next_token_logits)
                if self.out.greedy_ids is not None:
                    self.out.greedy_ids.copy_(new.greedy_ids)
        self.replays += 1

    def pool(self) -> Any:
        return None


def graph_factory_for(device: str) -> Callable[[], Graph] | None:
    """The graph kind a ModelRunner on ``device`` captures with, or None (no graphs). On a CPU,
    ``PLAIT_CPU_GRAPHS=1`` (tests) builds the graph runners over the eager stand-in, so capture, bucket
    padding and the DP graph batch size run in real engines, spawned ranks included (they inherit it)."""
    if device == "cuda":
        return CudaGraph
    return EagerGraph if envs.CPU_GRAPHS.get() else None


def warm_and_capture(graph: Graph, run: Callable[[], Any], pool: Any, sync: bool) -> Any:
    """Run ``run`` twice outside the capture (Triton compiles and autotuning, lazy initialisation),
    then capture it into ``graph`` sharing ``pool`` (buckets are captured largest first, so smaller
    ones reuse its memory). Returns the captured call's output. ``sync``: the buffers are on a GPU."""
    for _ in range(2):
        run()
    if sync:
        torch.cuda.synchronize()
    return graph.capture(run, pool)


def capture_batch_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 8 up to max_bs (max_bs itself included)."""
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs] + list(range(16, max_bs + 1, 8))
    if sizes[-1] != max_bs:
        sizes.append(max_bs)
    return sizes


def bucket_for(batch_sizes: list[int], bs: int) -> int:
    """The smallest captured batch size that holds ``bs`` (``batch_sizes`` ascending, as
    ``capture_batch_sizes`` returns them; callers check ``bs <= batch_sizes[-1]`` first)."""
    return batch_sizes[bisect.bisect_left(batch_sizes, bs)]


def default_cuda_graph_max_bs(max_running_requests: int) -> int:
    """By GPU memory: 256 on large cards (>= 80 GiB), else 160; never above the running limit."""
    if torch.cuda.is_available():
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory
        by_memory = 256 if total >= 80 * 2**30 else 160
    else:
        by_memory = 8
    return max(1, min(by_memory, max_running_requests))


def logits_buffer(runner: ModelRunner, rows: int) -> torch.Tensor:
    """float32 [rows, vocab columns] for a graph runner's logits. Graphs are replayed one at a time and
    each step consumes its logits (sampling, acceptance) on the stream before the next replay, so the
    buckets can share it. Columns: the LM head's rows (padded vocabulary) or the vocabulary."""
    cols = max(runner.model.lm_head_weight.shape[0], runner.model_config.vocab_size)
    return torch.empty(rows, cols, dtype=torch.float32, device=runner.device)


class CudaGraphRunner:
    def __init__(self, runner: ModelRunner, max_bs: int,
                 graph_factory: Callable[[], Graph] = CudaGraph) -> None:
        self.runner = runner
        self.backend = runner.attn_backend
        self.max_bs = max_bs
        self.batch_sizes = capture_batch_sizes(max_bs)
        self.fill_value = self.backend.get_cuda_graph_seq_len_fill_value()
        device = runner.device
        i64 = dict(dtype=torch.int64, device=device)
        # Static inputs: every captured graph reads prefixes of these.
        self.input_ids = torch.zeros(max_bs, **i64)
        self.positions = torch.zeros(max_bs, **i64)
        self.req_pool_indices = torch.full((max_bs,), DUMMY_REQ_ROW, **i64)
        self.seq_lens = torch.full((max_bs,), self.fill_value, **i64)
        self.out_cache_loc = torch.full((max_bs,), DUMMY_KV_SLOT, **i64)
        # Static output: every graph's LM head writes its logits here (one buffer, not one per graph).
        self.logits_buffer = logits_buffer(runner, max_bs)
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
            next_token_logits_buffer=self.logits_buffer, hidden_capture=self.runner.hidden_capture,
        )

    def capture(self) -> None:
        pool = None
        model = self.runner.model
        for bs in reversed(self.batch_sizes):
            fb = self._static_batch(bs, [self.fill_value] * bs)
            # DP attention: the MLP-sync metadata of a MAX_LEN step of bs rows on every rank.
            self.runner.init_capture_sync(fb)
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
    @staticmethod
    def max_dp_batch_size(fb: ForwardBatch) -> int:
        """The DP graph batch size: the largest raw per-rank count (requests, for decode and verify
        batches), so every rank replays the same bucket. can_run and replay both ask here."""
        if fb.original_global_num_tokens_cpu is None:
            raise RuntimeError("DP graph batch size needs original_global_num_tokens_cpu: call "
                               "ForwardBatch.init_mlp_sync_metadata before the graph runner")
        return max(fb.original_global_num_tokens_cpu)

    def graph_batch_size(self, fb: ForwardBatch) -> int:
        return self.max_dp_batch_size(fb) if fb.global_num_tokens_cpu is not None else fb.batch_size

    def can_run(self, fb: ForwardBatch) -> bool:
        if fb.spec_info is not None:
            return False
        if fb.global_num_tokens_cpu is not None:
            # DP attention: the graphs hold the MLP collectives, so every rank must decide alike, from
            # the global counts only. A rank with no requests (IDLE) replays the bucket on padding rows.
            return (fb.can_run_dp_cuda_graph and (fb.forward_mode.is_decode() or fb.forward_mode.is_idle())
                    and 0 < self.max_dp_batch_size(fb) <= self.max_bs)
        return fb.forward_mode.is_decode() and 0 < fb.batch_size <= self.max_bs

    def bucket(self, bs: int) -> int:
        return bucket_for(self.batch_sizes, bs)

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        bs = fb.batch_size
        padded = self.bucket(self.graph_batch_size(fb))
        self.input_ids[:bs].copy_(fb.input_ids)
        self.positions[:bs].copy_(fb.positions)
        self.req_pool_indices[:bs].copy_(fb.req_pool_indices)
        self.seq_lens[:bs].copy_(fb.seq_lens)
        self.out_cache_loc[:bs].copy_(fb.out_cache_loc)
        if padded > bs:
            self.req_pool_indices[bs:padded].fill_(DUMMY_REQ_ROW)
            self.seq_lens[bs:padded].fill_(self.fill_value)
            self.out_cache_loc[bs:padded].fill_(DUMMY_KV_SLOT)
            self.positions[bs:padded].zero_()
            self.input_ids[bs:padded].zero_()
        if fb.needs_forward_metadata_init():
            seq_lens_cpu = list(fb.seq_lens_cpu) + [self.fill_value] * (padded - bs)
            view = self._static_batch(padded, seq_lens_cpu)
            view.actual_forward_mode = fb.forward_mode
            self.backend.init_forward_metadata_out_graph(view)
        self.graphs[padded].replay()
        return LogitsOutput(next_token_logits=self.outputs[padded].next_token_logits[:bs])
