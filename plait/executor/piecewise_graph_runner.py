"""PiecewiseCudaGraphRunner: EXTEND and MIXED forwards as breakable graphs, one per token bucket.

A prefill's attention depends on the batch (its requests, their prefix and new-token lengths), but
everything between two attention calls (norms, projections, rotary and the KV store, the MLP,
residuals) only on the token count. So the model's hidden-state forward is captured per token
bucket (powers of two from 16 up to ``--piecewise-cuda-graph-max-tokens``, the maximum itself
included) as a list of segments, each a graph, all buckets and segments in one memory pool, cut at
every attention call:

  capture: segment 0 begins; the model runs over static buffers; at each attention call
           (``AttentionBreaks.forward``, which is the static batch's ``attn_backend``) q/k/v are
           copied into static buffers inside the open segment, the segment ends, the attention step
           is recorded (its layer and static q/k/v/out views) and the next segment begins; after
           the final norm the last segment ends.
  replay:  the live batch's input_ids/positions/out_cache_loc are copied into the static buffers
           and padded to the bucket (padded tokens: token 0 at position 0, their K/V into the dummy
           slot); the backend plans the live batch eagerly (``init_forward_metadata``, outside any
           graph); then segment i replays and attention step i runs eagerly on the live rows of its
           static q/k/v into its static output, for every i. The LM head runs eagerly over the live
           rows (``compute_logits`` with the live batch: its ``logits_indices``, prompt logprob rows
           included), exactly as the eager path.

The attention kernel is launched eagerly, so its grid follows the batch; only its inputs and output
are static. Padded rows of the attention output keep whatever they held (finite values from an
earlier step or zeros): every later op is row-wise, so they never reach a live row or the logits.

A forward the graphs do not cover runs eagerly; ``fallback_reason`` says why (see there).

The graph object is injected (``BreakableGraphFactory``): ``CudaBreakableGraph`` on a GPU,
``EagerBreakableGraph`` on the CPU under ``PLAIT_CPU_GRAPHS=1``, whose replay re-runs the recorded
forward and, at each attention call, runs the recorded step over the static buffers: the buckets,
padding, staging, the step list and its order run in CPU tests.
"""

from __future__ import annotations

import collections
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

import torch

from plait.attention.base import AttentionBackend
from plait.executor.graph_utils import (
    CaptureTarget,
    CudaGraph,
    CudaGraphSegments,
    EagerGraph,
    bucket_for,
    graph_factory_for,
    stage,
)
from plait.forward_batch import AttentionLayer, ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW
from plait.models.llama import LogitsOutput

logger = logging.getLogger(__name__)

SMALLEST_BUCKET = 16


def piecewise_token_buckets(max_tokens: int) -> list[int]:
    """Token counts a piecewise graph is captured for, ascending: powers of two from 16 below
    ``max_tokens``, then ``max_tokens`` itself (alone when it is at most 16)."""
    if max_tokens < 1:
        raise ValueError(f"piecewise_cuda_graph_max_tokens must be >= 1, got {max_tokens}")
    sizes: list[int] = []
    size = SMALLEST_BUCKET
    while size < max_tokens:
        sizes.append(size)
        size *= 2
    return [*sizes, max_tokens]


@runtime_checkable
class PiecewiseModel(Protocol):
    """A model whose forward splits into the hidden-state forward (captured) and the LM head (eager):
    plait.models.llama.LlamaForCausalLM and every decoder built on it."""

    def forward_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, fb: ForwardBatch) -> torch.Tensor: ...

    def compute_logits(self, hidden: torch.Tensor, fb: ForwardBatch) -> LogitsOutput: ...


@dataclass(frozen=True)
class AttentionStep:
    """One attention call of a captured forward: the layer, and views [bucket, width] of the static
    buffers the segment before it writes q/k/v into and the segment after it reads ``out`` from."""

    layer: AttentionLayer
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor
    save_kv_cache: bool

    def run(self, backend: AttentionBackend, live: ForwardBatch) -> None:
        """Attention of the live batch's rows (the first ``live.num_tokens``) with the plan the backend
        made for ``live``, into the static output."""
        n = live.num_tokens
        out = backend.forward(self.q[:n], self.k[:n], self.v[:n], self.layer, live, self.save_kv_cache)
        self.out[:n].copy_(out.reshape(n, -1))


class BreakableGraph(Protocol):
    """One token bucket's captured forward: segments between attention calls.

    ``capture(fn, pool)`` runs ``fn`` (the forward over static buffers); every attention call in it
    calls ``split(step)``. ``replay(run_step)`` replays the segments in order and calls
    ``run_step(i)`` after segment i for every recorded step. ``steps`` is the recorded list."""

    steps: list[AttentionStep]

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> torch.Tensor: ...
    def split(self, step: AttentionStep) -> None: ...
    def replay(self, run_step: Callable[[int], None]) -> None: ...
    def pool(self) -> Any: ...


BreakableGraphFactory = Callable[[], BreakableGraph]


class CudaBreakableGraph(CudaGraphSegments):
    """Segments as torch.cuda.CUDAGraph objects sharing one pool, captured on the capture stream, one
    per stretch between attention calls (buckets captured one at a time)."""

    def __init__(self) -> None:
        super().__init__()
        self.steps: list[AttentionStep] = []

    def split(self, step: AttentionStep) -> None:
        # The attention itself is not captured: at capture its output buffer keeps what it holds.
        self._end()
        self.steps.append(step)
        self._begin()

    def replay(self, run_step: Callable[[int], None]) -> None:
        last = len(self.segments) - 1
        for i, segment in enumerate(self.segments):
            segment.replay()
            if i < last:
                run_step(i)


class EagerBreakableGraph:
    """Stand-in for CPU tests: capture runs ``fn`` and records its steps; replay re-runs ``fn`` (each
    "segment" executes again) and at its i-th attention call runs recorded step i, which must be the
    same layer over the same static buffers; the forward's output is copied into the captured one."""

    def __init__(self) -> None:
        self.steps: list[AttentionStep] = []
        self.replays = 0
        self._fn: Callable[[], torch.Tensor] | None = None
        self._out: torch.Tensor | None = None
        self._run_step: Callable[[int], None] | None = None
        self._next = 0

    @property
    def num_segments(self) -> int:
        return len(self.steps) + 1

    def capture(self, fn: Callable[[], torch.Tensor], pool: Any) -> torch.Tensor:
        self._fn = fn
        self._out = fn()
        return self._out

    def split(self, step: AttentionStep) -> None:
        if self._run_step is None:  # capturing
            self.steps.append(step)
            return
        recorded = self.steps[self._next]
        if recorded.layer is not step.layer or recorded.q.data_ptr() != step.q.data_ptr() \
                or recorded.out.data_ptr() != step.out.data_ptr():
            raise RuntimeError(f"piecewise replay: attention call {self._next} is not the recorded step")
        self._run_step(self._next)
        self._next += 1

    def replay(self, run_step: Callable[[int], None]) -> None:
        assert self._fn is not None and self._out is not None
        self._run_step, self._next = run_step, 0
        try:
            self._out.copy_(self._fn())
        finally:
            self._run_step = None
        if self._next != len(self.steps):
            raise RuntimeError(f"piecewise replay ran {self._next} of {len(self.steps)} attention steps")
        self.replays += 1

    def pool(self) -> Any:
        return None


def breakable_graph_factory_for(device: str) -> BreakableGraphFactory | None:
    """The breakable graph kind matching ``graph_factory_for(device)`` (CUDA graphs on a GPU, the
    eager stand-in on a CPU under ``PLAIT_CPU_GRAPHS=1``), or None (no graphs on this device)."""
    kind = graph_factory_for(device)
    if kind is CudaGraph:
        return CudaBreakableGraph
    if kind is EagerGraph:
        return EagerBreakableGraph
    return None


def _ignore_step(step: AttentionStep) -> None:
    return None


class AttentionBreaks:
    """The ``attn_backend`` of the static batches: each attention call copies q/k/v into static
    buffers and hands an ``AttentionStep`` to ``on_break`` (the graph being captured or replayed;
    ignored during warm-up), then returns the step's static output for the next segment.

    Static buffers are keyed by (role, row width, dtype) and hold ``max_tokens`` rows: layers and
    buckets share them, since steps run one at a time and each output is read only by the segment
    right after it."""

    def __init__(self, backend: AttentionBackend, max_tokens: int) -> None:
        self.backend = backend
        self.max_tokens = max_tokens
        self.on_break: Callable[[AttentionStep], None] = _ignore_step
        self._buffers: dict[tuple[str, int, torch.dtype], torch.Tensor] = {}

    def _buffer(self, role: str, like: torch.Tensor, rows: int, width: int) -> torch.Tensor:
        key = (role, width, like.dtype)
        if key not in self._buffers:
            # Filled with zeros: a padded row of an output never read before holds a finite value.
            self._buffers[key] = torch.zeros(self.max_tokens, width, dtype=like.dtype, device=like.device)
        return self._buffers[key][:rows]

    def _staged(self, role: str, x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        static = self._buffer(role, x, rows, x[0].numel() if rows else 0)
        static.copy_(x.reshape(rows, -1))
        return static

    def rope_kv_store_target(self, layer: AttentionLayer, fb: ForwardBatch
                             ) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.backend.rope_kv_store_target(layer, fb)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: AttentionLayer,
                fb: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        rows = q.shape[0]
        step = AttentionStep(layer, self._staged("q", q), self._staged("k", k), self._staged("v", v),
                             self._buffer("out", q, rows, layer.num_heads * layer.head_dim), save_kv_cache)
        self.on_break(step)
        return step.out


class PiecewiseCudaGraphRunner:
    """Captures the hidden-state forward of EXTEND/MIXED batches per token bucket (largest first,
    one pool) and replays the smallest bucket holding a live batch."""

    def __init__(self, target: CaptureTarget, max_tokens: int, graph_factory: BreakableGraphFactory) -> None:
        model = target.model
        if not isinstance(model, PiecewiseModel):
            raise TypeError(f"{type(model).__name__} has no forward_hidden/compute_logits: it cannot run "
                            "piecewise graphs (drop --enable-piecewise-cuda-graph)")
        self.model: PiecewiseModel = model
        self.target = target
        self.backend = target.backend
        self.max_tokens = max_tokens
        self.buckets = piecewise_token_buckets(max_tokens)
        i64 = dict(dtype=torch.int64, device=target.device)
        # Static inputs: every bucket's graph reads prefixes of these.
        self.input_ids = torch.zeros(max_tokens, **i64)
        self.positions = torch.zeros(max_tokens, **i64)
        self.out_cache_loc = torch.full((max_tokens,), DUMMY_KV_SLOT, **i64)
        self.breaks = AttentionBreaks(self.backend, max_tokens)
        self.graphs: dict[int, BreakableGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # each bucket's static final hidden states [bucket, H]
        self.replays: collections.Counter[int] = collections.Counter()  # bucket -> replays
        self.replayed_modes: collections.Counter[ForwardMode] = collections.Counter()  # mode -> replays
        # reason -> EXTEND/MIXED forwards that ran eagerly (other modes are not counted)
        self.fallbacks: collections.Counter[str] = collections.Counter()
        self._graph_factory = graph_factory
        self.capture()

    # --- capture ----------------------------------------------------------------------------------
    def _static_batch(self, tokens: int) -> ForwardBatch:
        """One request of ``tokens`` new tokens on the dummy request row, every K/V into the dummy slot.
        Never planned: the captured segments read only its static tensors and mode, and attention
        does not run at capture."""
        i64 = dict(dtype=torch.int64, device=self.input_ids.device)
        lens = torch.tensor([tokens], **i64)
        zero = torch.zeros(1, **i64)
        return ForwardBatch(
            forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=self.input_ids[:tokens],
            req_pool_indices=torch.full((1,), DUMMY_REQ_ROW, **i64), seq_lens=lens,
            out_cache_loc=self.out_cache_loc[:tokens], positions=self.positions[:tokens],
            seq_lens_cpu=[tokens], seq_lens_sum=tokens, attn_backend=self.breaks,
            extend=ExtendInfo(num_tokens=tokens, seq_lens=lens, prefix_lens=zero, start_loc=zero,
                              seq_lens_cpu=[tokens], prefix_lens_cpu=[0]))

    def capture(self) -> None:
        start = time.perf_counter()
        pool = None
        sync = self.input_ids.is_cuda
        with torch.inference_mode():
            for tokens in reversed(self.buckets):
                fb = self._static_batch(tokens)

                def run(fb: ForwardBatch = fb) -> torch.Tensor:
                    return self.model.forward_hidden(fb.input_ids, fb.positions, fb)

                # Warm-up outside the capture (Triton compiles, lazy initialisation, the static
                # attention buffers at their full size on the first, largest bucket).
                self.breaks.on_break = _ignore_step
                for _ in range(2):
                    run()
                if sync:
                    torch.cuda.synchronize()
                graph = self._graph_factory()
                self.breaks.on_break = graph.split
                try:
                    self.outputs[tokens] = graph.capture(run, pool)
                finally:
                    self.breaks.on_break = _ignore_step
                pool = graph.pool()
                self.graphs[tokens] = graph
        self.capture_seconds = time.perf_counter() - start
        logger.info("captured piecewise graphs for %s tokens (%d attention breaks each) in %.2f s", self.buckets,
                    len(self.graphs[self.buckets[-1]].steps), self.capture_seconds)

    # --- replay -----------------------------------------------------------------------------------
    def fallback_reason(self, fb: ForwardBatch) -> str | None:
        """Why ``fb`` runs eagerly, or None when a piecewise graph runs it."""
        mode = fb.forward_mode
        if mode not in (ForwardMode.EXTEND, ForwardMode.MIXED):
            return f"forward mode {mode.name} (piecewise graphs run EXTEND and MIXED)"
        if fb.spec_info is not None:
            return "speculative input (draft tree or custom mask)"
        if fb.tbo_children is not None:
            return "two-batch overlap (the batch runs as two micro-batches)"
        if fb.mlp_sync.global_num_tokens_cpu is not None:
            return "DP attention (the MLP gathers every rank's tokens)"
        if self.target.hidden_capture is not None:
            return "hidden-state capture (an EAGLE draft reads the target's hidden states)"
        n = fb.num_tokens
        if n == 0:
            return "no tokens"
        if n > self.max_tokens:
            return f"{n} tokens > --piecewise-cuda-graph-max-tokens {self.max_tokens}"
        return None

    def can_run(self, fb: ForwardBatch) -> bool:
        reason = self.fallback_reason(fb)
        if reason is not None and fb.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED):
            if reason not in self.fallbacks:
                logger.debug("piecewise graphs: eager forward: %s", reason)
            self.fallbacks[reason] += 1
        return reason is None

    def bucket(self, num_tokens: int) -> int:
        return bucket_for(self.buckets, num_tokens)

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        n = fb.num_tokens
        tokens = self.bucket(n)
        stage(self.input_ids, fb.input_ids, tokens, 0)
        stage(self.positions, fb.positions, tokens, 0)
        stage(self.out_cache_loc, fb.out_cache_loc, tokens, DUMMY_KV_SLOT)
        fb.attn_backend = self.backend
        # The attention steps run eagerly: the live batch is planned as the eager path plans it.
        if fb.needs_forward_metadata_init():
            self.backend.init_forward_metadata(fb)
            fb.mark_forward_metadata_ready()
        graph = self.graphs[tokens]

        def run_step(i: int) -> None:
            graph.steps[i].run(self.backend, fb)

        with torch.inference_mode():
            self.breaks.on_break = graph.split  # the eager stand-in's replay calls it; a CUDA replay does not
            try:
                graph.replay(run_step)
            finally:
                self.breaks.on_break = _ignore_step
            self.replays[tokens] += 1
            self.replayed_modes[fb.forward_mode] += 1
            return self.model.compute_logits(self.outputs[tokens][:n], fb)
