"""What the graph runners share: the Graph seam, bucket choice, warm-up and capture, static buffers.

Every graph runner (decode, TARGET_VERIFY, and the speculative draft loops) captures one graph per
batch-size bucket into one memory pool, largest bucket first, and replays the smallest bucket that
holds a live batch after copying it into static buffers and padding the rest. The graph object is
injected (a ``Graph`` factory) so the bucket, padding and plan logic runs on the CPU in tests with
``EagerGraph``, which re-executes the recorded function on replay.

A runner of the target model depends on a ``CaptureTarget`` (the model, its attention backend, the
hidden-state capture), never on the ModelRunner that owns them.
"""

from __future__ import annotations

import bisect
import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from plait import envs
from plait.attention.base import AttentionBackend
from plait.config import EngineConfig
from plait.forward_batch import ForwardBatch
from plait.layers.hidden_capture import HiddenCapture
from plait.models.llama import LogitsOutput


class Graph(Protocol):
    def capture(self, fn: Callable[[], Any], pool: Any) -> Any: ...
    def replay(self) -> None: ...
    def pool(self) -> Any: ...


GraphFactory = Callable[[], Graph]

_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def capture_stream() -> torch.cuda.Stream:
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
        with torch.cuda.graph(self.graph, pool=pool, stream=capture_stream()):
            return fn()

    def replay(self) -> None:
        self.graph.replay()

    def pool(self) -> Any:
        return self.graph.pool()


def segment_starts(num_layers: int) -> list[int]:
    """The decoder layers a segmented graph cuts before (``SegmentedCudaGraph``): 1, 3, 7, 15, ... while
    at least as many layers follow a cut as the segment before it holds. The first segment (the
    embedding and layer 0) is short to launch, and each later one, about twice the one before it, is
    launched while that one runs (launching a layer takes far less host time than the GPU takes to run
    it)."""
    starts: list[int] = []
    start = 1
    while num_layers - start >= (start + 1) // 2:
        starts.append(start)
        start = 2 * start + 1
    return starts


def decoder_layers(model: object) -> list[torch.nn.Module]:
    """The decoder layers of a causal LM built on plait.models.llama.LlamaModel (``model.model.layers``),
    or [] for a model without them."""
    layers = getattr(getattr(model, "model", None), "layers", None)
    return list(layers) if isinstance(layers, torch.nn.ModuleList) else []


class CudaGraphSegments:
    """Consecutive torch.cuda.CUDAGraph segments sharing one pool: ``_begin`` opens a segment on the
    current (capture) stream, ``_end`` closes it into ``segments``. Replay order equals capture order, so
    memory a segment frees may back a later segment's tensors."""

    def __init__(self) -> None:
        self.segments: list[torch.cuda.CUDAGraph] = []
        self._open: torch.cuda.CUDAGraph | None = None
        self._pool: Any = None

    def _begin(self) -> None:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self._pool)
        self._open = graph

    def _end(self) -> None:
        assert self._open is not None
        self._open.capture_end()
        self.segments.append(self._open)
        self._open = None

    def capture(self, fn: Callable[[], Any], pool: Any) -> Any:
        """Run ``fn`` on the capture stream inside a first segment (``fn`` may close it and open more)."""
        self._pool = pool if pool is not None else torch.cuda.graph_pool_handle()
        torch.cuda.synchronize()
        with torch.cuda.stream(capture_stream()):
            self._begin()
            out = fn()
            self._end()
        torch.cuda.synchronize()
        return out

    def pool(self) -> Any:
        return self._pool


class SegmentedCudaGraph(CudaGraphSegments):
    """A forward captured as consecutive CUDA graphs (segments), cut before each module of
    ``cut_before`` (forward pre-hooks, present only during the capture); replay launches them in order.

    Why it exists: a chained verify is launched onto an idle GPU (after the host read the previous
    verify's result), and a short first segment would start the GPU before the rest is launched. A
    whole verify graph's launch measured far shorter than that gap, so it stays behind
    ``PLAIT_SEGMENTED_VERIFY_GRAPHS`` until measured on its own (docs/speculative-decoding.md)."""

    def __init__(self, cut_before: Sequence[torch.nn.Module]) -> None:
        super().__init__()
        self.cut_before = list(cut_before)

    def _cut(self, module: torch.nn.Module, args: Any) -> None:
        self._end()
        self._begin()

    @contextlib.contextmanager
    def cuts(self) -> Iterator[None]:
        """The cuts, in place while the forward is captured and removed after."""
        handles = [m.register_forward_pre_hook(self._cut) for m in self.cut_before]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def capture(self, fn: Callable[[], Any], pool: Any) -> Any:
        with self.cuts():
            return super().capture(fn, pool)

    def replay(self) -> None:
        for segment in self.segments:
            segment.replay()


def segmented_graph_factory(model: object) -> GraphFactory:
    """Graphs of ``model``'s forward cut at ``segment_starts`` of its decoder layers (one segment when it
    has none to cut at)."""
    layers = decoder_layers(model)
    cut_before = [layers[i] for i in segment_starts(len(layers))]
    return functools.partial(SegmentedCudaGraph, cut_before)


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


def graph_factory_for(device: str) -> GraphFactory | None:
    """The graph kind a runner on ``device`` captures with, or None (no graphs). On a CPU,
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


def holds(batch_sizes: list[int], bs: int, pad: bool) -> bool:
    """Whether graphs captured at ``batch_sizes`` (ascending) replay a batch of ``bs`` rows: any size
    up to the largest, padded to the next captured one; without ``pad`` (SGLang's
    --disable-cuda-graph-padding) a captured size exactly."""
    return 0 < bs <= batch_sizes[-1] and (pad or bs in batch_sizes)


def graph_batch_sizes(config: EngineConfig) -> list[int]:
    """The batch sizes decode-shaped graphs (decode, verify, draft loops) are captured for:
    ``cuda_graph_bs`` as given, else ``capture_batch_sizes`` up to ``cuda_graph_max_bs`` (default by
    GPU memory). A larger batch runs eagerly; a smaller one replays the next size up, padded."""
    if config.cuda_graph_bs is not None:
        return list(config.cuda_graph_bs)
    return capture_batch_sizes(config.cuda_graph_max_bs or default_cuda_graph_max_bs(config.max_running_requests))


def device_total_memory() -> int | None:
    """The current card's total memory in bytes as the driver reports it; None without a GPU."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def default_cuda_graph_max_bs(max_running_requests: int) -> int:
    """``graph_max_bs_for_memory`` of the current card."""
    return graph_max_bs_for_memory(device_total_memory(), max_running_requests)


# 80 GB cards report less than 80 GiB (torch gives an H100 80GB HBM3 85017493504 bytes, 79.2 GiB), so the large-card
# class starts well below the marketed size: a card held to 160 runs its bs 161-256 decode steps
# eagerly, each paying the whole forward's kernel launches on the host.
LARGE_CARD_BYTES = 64 * 2**30


def graph_max_bs_for_memory(total_memory: int | None, max_running_requests: int) -> int:
    """The largest decode graph batch for a card of ``total_memory`` bytes: 256 on 80 GB class cards
    and larger (H100, A100 80GB, H200), else 160; 8 without a GPU (None); never above the running limit."""
    if total_memory is None:
        by_memory = 8
    else:
        by_memory = 256 if total_memory >= LARGE_CARD_BYTES else 160
    return max(1, min(by_memory, max_running_requests))


def dp_graph_batch_size(fb: ForwardBatch) -> int:
    """The DP graph batch size: the largest raw per-rank count (requests, for decode and verify
    batches: ``original_global_num_tokens_cpu``, never the width-scaled token counts), so every rank
    replays the same bucket. The decode and verify graph runners' ``can_run`` and ``replay`` all ask
    here."""
    if fb.mlp_sync.original_global_num_tokens_cpu is None:
        raise RuntimeError("DP graph batch size needs original_global_num_tokens_cpu: call "
                           "ForwardBatch.init_mlp_sync_metadata before the graph runner")
    return max(fb.mlp_sync.original_global_num_tokens_cpu)


def stage(static: torch.Tensor, live: torch.Tensor, padded: int, pad_value: int | bool) -> None:
    """Copy ``live`` into the first rows of the static buffer ``static`` and fill the rows after it,
    up to ``padded``, with ``pad_value`` (a reserved row, slot or fill value: never a live one)."""
    n = live.shape[0]
    static[:n].copy_(live)
    if padded > n:
        static[n:padded].fill_(pad_value)


class CapturedModel(Protocol):
    """The target model as a graph records it."""

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> LogitsOutput: ...


def _no_capture_sync(fb: ForwardBatch) -> None:
    return None


@dataclass(frozen=True)
class CaptureTarget:
    """What a graph runner of the target model records and replays.

    ``logits_columns``: width of the static logits buffer (the LM head's rows, which may pad the
    vocabulary). ``prepare_capture`` fills what a static batch needs beyond its buffers before it is
    planned (DP attention: the MLP-sync metadata of a MAX_LEN step on every rank)."""

    model: CapturedModel
    backend: AttentionBackend
    device: str
    logits_columns: int
    max_context_len: int
    hidden_capture: HiddenCapture | None = None
    prepare_capture: Callable[[ForwardBatch], None] = _no_capture_sync
    # EngineConfig.causal_chain_verify: verify batches of chains carry no tree mask.
    causal_chain_verify: bool = False

    def logits_buffer(self, rows: int) -> torch.Tensor:
        """float32 [rows, logits_columns]. Graphs are replayed one at a time and each step consumes its
        logits (sampling, acceptance) on the stream before the next replay, so buckets share it."""
        return torch.empty(rows, self.logits_columns, dtype=torch.float32, device=self.device)
