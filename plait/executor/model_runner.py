"""ModelRunner: owns the model, the KV pools and the attention backend; runs one ForwardBatch.

``forward_batch`` is the scheduler's one call per step: forward, sampler and the asynchronous host
copy of the sampled ids (``ForwardOutput``). ``forward`` alone serves the callers that read logits
themselves (speculative verify, draft mirrors, the other tensor-parallel ranks).

Forward paths plan attention metadata only when the batch says it needs it: a batch a
pre-planner marked (graph replay preparation, multi-step draft planning) is not planned again.
"""

from __future__ import annotations

import functools
import gc
import logging
from collections.abc import Callable
from typing import Any

import torch

from plait import envs
from plait.attention.base import AttentionBackend
from plait.attention.hybrid import serving_backend_name
from plait.attention.plan_check import maybe_check_plans
from plait.attention.registry import create_attention_backend
from plait.attention.tbo_backend import TboAttnBackend
from plait.config import EngineConfig
from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.executor.cuda_graph_runner import CudaGraphRunner
from plait.executor.forward_output import ForwardOutput, HostCopy, InputLogprobs, score_prompt_rows
from plait.executor.graph_utils import (
    CaptureTarget,
    CudaGraph,
    graph_batch_sizes,
    graph_factory_for,
    segmented_graph_factory,
)
from plait.executor.piecewise_graph_runner import (
    PiecewiseCudaGraphRunner,
    PiecewiseModel,
    breakable_graph_factory_for,
)
from plait.executor.sizing import eagle_hidden_capture, kv_capacity_tokens, use_rank_device, verify_graph_widths
from plait.executor.verify_graph_runner import VerifyGraphRunner
from plait.forward_batch import ForwardBatch, apply_deprecated_skip_attn_backend_init
from plait.layers.moe import routing_stats
from plait.layers.radix_attention import model_has_sinks, model_kv_scales, model_sliding_windows
from plait.mem.pools import (
    MHATokenToKVPool,
    ReqToTokenPool,
    TokenToKVPoolAllocator,
    kv_cache_dtype,
    log_device_memory,
)
from plait.models.llama import LogitsOutput
from plait.models.loader import ModelConfig, load_model, load_model_config
from plait.sampling import Sampler
from plait.two_batch_overlap import choose_dp_split, choose_split

logger = logging.getLogger(__name__)


class ModelRunner:
    """One rank's executor: owns the model, the KV pools, the attention backend and the graphs, and
    runs one ForwardBatch per call (``forward``; ``forward_batch`` adds the sampler and host copy)."""

    # What ``close`` drops (the members holding device memory).
    DEVICE_STATE = ("graph_runner", "verify_graph_runner", "piecewise_runner", "attn_backend", "model", "kv_pool",
                    "req_to_token_pool", "allocator", "hidden_capture")

    def __init__(self, config: EngineConfig, mc: ModelConfig, tp: TPGroup = SINGLE) -> None:
        self.closed = False
        self.config = config
        self.model_config = mc
        self.device = use_rank_device(config, tp)
        self.tp = tp
        # DP attention: attention (and its KV cache) is unsharded on each rank; only the MLP is split.
        attn_tp = SINGLE if config.enable_dp_attention else tp
        self.model = load_model(mc, self.device, config.load_format, tp, config.seed, attn_tp=attn_tp,
                                ep_size=config.ep_size, moe_a2a_backend=config.moe_a2a_backend)
        if envs.COUNT_ROUTED_EXPERTS.get():  # benchmarks: before any graph is captured
            routing_stats.attach(self.model, self.device)
        log_device_memory("the weights", self.device)
        # Rank 0 schedules KV slots for every rank: all ranks take the smallest capacity.
        draft = None
        if config.speculative_algorithm == "STANDALONE" and config.speculative_draft_model_path:
            path = config.speculative_draft_model_path
            try:
                draft = load_model_config(path, config.dtype, self.device, mc.context_length)
            except (ValueError, FileNotFoundError) as e:
                raise ValueError(f"--speculative-draft-model-path {path!r}: {e}") from e
        self.max_total_tokens = tp.min_across_ranks(
            kv_capacity_tokens(config, mc, self.device, attn_tp.size, draft=draft))
        self.max_context_len = mc.context_length
        self.req_to_token_pool = ReqToTokenPool(config.max_running_requests, self.max_context_len, self.device)
        kv_dtype = kv_cache_dtype(config.kv_cache_dtype, mc.dtype)
        k_scales, v_scales = model_kv_scales(self.model)
        self.kv_pool = MHATokenToKVPool(self.max_total_tokens, kv_dtype, mc.num_layers,
                                        mc.num_kv_heads_per_rank(attn_tp.size), mc.head_dim, self.device,
                                        k_scales=k_scales, v_scales=v_scales)
        self.allocator = TokenToKVPoolAllocator(self.max_total_tokens, self.device)
        log_device_memory("the weights and the KV pool", self.device)
        def new_backend() -> AttentionBackend:
            return create_attention_backend(
                config.attention_backends(), self.req_to_token_pool, self.kv_pool, mc.num_heads // attn_tp.size,
                config.speculative_attention_mode, sliding_windows=model_sliding_windows(self.model),
                has_sinks=model_has_sinks(self.model))

        self.attn_backend: AttentionBackend = new_backend()
        if config.enable_two_batch_overlap:
            # One more backend per micro-batch: the children's plans live beside the whole batch's.
            # Under DP attention the step's count exchange decides for every rank (choose_dp_split).
            policy = (functools.partial(choose_dp_split, threshold=config.tbo_token_distribution_threshold)
                      if config.enable_dp_attention else
                      functools.partial(choose_split, has_communication=tp.size > 1,
                                        min_tokens=config.tbo_min_split_tokens,
                                        threshold=config.tbo_token_distribution_threshold))
            children = (maybe_check_plans(new_backend()), maybe_check_plans(new_backend()))
            self.attn_backend = TboAttnBackend(self.attn_backend, children, policy)
        # PLAIT_CHECK_PLANS=1 (debug; the speculative tests run with it): raise on a forward whose
        # plan does not match its batch. Off, this returns the backend itself.
        self.attn_backend = maybe_check_plans(self.attn_backend)
        self.sampler = Sampler()
        self.graph_runner: CudaGraphRunner | None = None
        self.verify_graph_runner: VerifyGraphRunner | None = None
        graph_factory = None if config.disable_cuda_graph else graph_factory_for(self.device)
        graphs = graph_factory is not None
        if graphs and config.moe_a2a_backend == "all_to_all":
            logger.info("moe_a2a_backend all_to_all: prefill steps (DP attention: SUM_LEN rounds) dispatch experts by "
                        "all-to-all; decode and verify steps (DP attention: MAX_LEN rounds), which CUDA graphs are "
                        "captured for, keep the all-gather path")
        batch_sizes = graph_batch_sizes(config)
        max_bs = batch_sizes[-1]
        widths = verify_graph_widths(config)
        # Sized for the largest graph before any capture (replays write into it; never reallocated).
        self.hidden_capture = eagle_hidden_capture(config, mc, max_bs * max([1, *widths]) if graphs else 0,
                                                   self.device)
        if graphs:
            target = self.capture_target()
            pad = not config.disable_cuda_graph_padding
            self.graph_runner = CudaGraphRunner(target, batch_sizes, graph_factory, pad=pad)
            if widths:
                segmented = graph_factory is CudaGraph and envs.SEGMENTED_VERIFY_GRAPHS.get()
                verify_factory = segmented_graph_factory(self.model) if segmented else graph_factory
                self.verify_graph_runner = VerifyGraphRunner(target, batch_sizes, widths, verify_factory, pad=pad)
        self.piecewise_runner = self.build_piecewise_runner()
        log_device_memory("graph capture", self.device)
        logger.info(
            "KV cache: %d tokens (%.2f GiB, %s), attention backend %s, context %d",
            self.max_total_tokens,
            self.max_total_tokens * MHATokenToKVPool.bytes_per_token(
                kv_dtype, mc.num_layers, mc.num_kv_heads_per_rank(attn_tp.size), mc.head_dim) / 2**30,
            kv_dtype, self.attn_backend.name, self.max_context_len)

    def build_piecewise_runner(self) -> PiecewiseCudaGraphRunner | None:
        """The EXTEND/MIXED breakable graphs under --enable-piecewise-cuda-graph, where this device
        has graphs (a GPU; the CPU under PLAIT_CPU_GRAPHS=1) and the model splits at its LM head."""
        if not self.config.enable_piecewise_cuda_graph:
            return None
        factory = breakable_graph_factory_for(self.device)
        if factory is None:
            logger.info("--enable-piecewise-cuda-graph: no graphs on %s; extend steps run eagerly", self.device)
            return None
        if self.hidden_capture is not None:
            logger.info("--enable-piecewise-cuda-graph: an EAGLE target captures hidden states, which the "
                        "piecewise graphs do not; extend steps run eagerly")
            return None
        if not isinstance(self.model, PiecewiseModel):
            logger.info("--enable-piecewise-cuda-graph: %s has no forward_hidden/compute_logits; extend steps run "
                        "eagerly", type(self.model).__name__)
            return None
        return PiecewiseCudaGraphRunner(self.capture_target(), self.config.piecewise_cuda_graph_max_tokens, factory)

    def capture_target(self) -> CaptureTarget:
        """What the graph runners record: this runner's model, backend and hidden capture."""
        columns = max(self.model.lm_head_weight.shape[0], self.model_config.vocab_size)
        return CaptureTarget(self.model, self.attn_backend, self.device, columns, self.max_context_len,
                             self.hidden_capture, self.init_capture_sync, self.config.causal_chain_verify)

    # --- forward paths --------------------------------------------------------------------------
    def forward(self, fb: ForwardBatch, skip_attn_backend_init: bool | None = None) -> LogitsOutput:
        """Public entry. ``skip_attn_backend_init`` is deprecated: it maps onto the batch's plan
        marker (True marks the batch planned) and warns once per process."""
        apply_deprecated_skip_attn_backend_init(fb, skip_attn_backend_init)
        if fb.forward_mode.is_idle():
            return self.forward_idle(fb)
        if fb.forward_mode.is_decode():
            return self.forward_decode(fb)
        return self.forward_extend(fb)

    def _run_model(self, fb: ForwardBatch) -> LogitsOutput:
        fb.attn_backend = self.attn_backend
        fb.hidden_capture = self.hidden_capture
        if fb.needs_forward_metadata_init():
            self.attn_backend.init_forward_metadata(fb)
        return self.model(fb.input_ids, fb.positions, fb)

    def forward_decode(self, fb: ForwardBatch) -> LogitsOutput:
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            fb.attn_backend = self.attn_backend
            return self.graph_runner.replay(fb)
        return self._run_model(fb)

    def forward_extend(self, fb: ForwardBatch) -> LogitsOutput:
        # TARGET_VERIFY of a uniform captured width replays its graph; the eager path plans inside
        # _run_model, after the batch has its final shape (a plan made before padding would not fit).
        if self.verify_graph_runner is not None and self.verify_graph_runner.can_run(fb):
            fb.attn_backend = self.attn_backend
            return self.verify_graph_runner.replay(fb)
        if fb.lens_on_device:
            raise RuntimeError("a verify batch whose lengths are on the device only runs in a verify graph: the eager "
                               "path plans from the host lists")
        if self.piecewise_runner is not None and self.piecewise_runner.can_run(fb):
            return self.piecewise_runner.replay(fb)
        return self._run_model(fb)

    def stage(self, fb: ForwardBatch) -> Callable[[], LogitsOutput] | None:
        """``forward(fb)`` in two halves for a batch a verify graph replays: its inputs staged now (the
        graph's buffers filled and planned, queued behind the work before), the returned call launches
        it (``VerifyGraphRunner.stage``). None: no graph replays ``fb`` (nothing staged)."""
        graphs = self.verify_graph_runner
        if graphs is None or not fb.forward_mode.is_target_verify() or not graphs.can_run(fb):
            return None
        fb.attn_backend = self.attn_backend
        return graphs.stage(fb)

    def init_capture_sync(self, fb: ForwardBatch) -> None:
        """Fill what a graph-captured batch needs beyond its static buffers (DP attention: the
        MLP-sync metadata). Nothing for a plain runner."""

    def forward_idle(self, fb: ForwardBatch) -> LogitsOutput:
        # No tokens: the model still runs (collectives of TP/DP ranks must match), on empty input.
        return self._run_model(fb)

    def forward_batch(self, fb: ForwardBatch, sample: bool = True) -> ForwardOutput:
        """One scheduler step: the forward, then, when the batch samples (``fb.sampling_info``), the
        sampler and the asynchronous host copy of its results. Nothing here waits for the device:
        the caller reads the copy later (``HostCopy.wait``), after launching the next step.

        ``sample=False`` returns after the forward: the caller finishes the batch's info first (a
        constrained batch's vocabulary mask) and then calls ``sample``."""
        logits = self.forward(fb)
        scored = None
        if fb.input_logprobs is not None:
            scored, logits = score_prompt_rows(logits, fb.input_logprobs)
        if fb.sampling_info is None or not sample:
            return ForwardOutput(logits, input_logprobs=scored)
        return self.sample(fb, logits, scored)

    def sample(self, fb: ForwardBatch, logits: LogitsOutput, input_logprobs: InputLogprobs | None = None
               ) -> ForwardOutput:
        """The sampler on a forward's logits with ``fb.sampling_info``, and the host copy
        (``input_logprobs``: the forward's prompt scores, passed through)."""
        assert fb.sampling_info is not None
        sample = self.sampler(logits.next_token_logits, fb.sampling_info)
        return ForwardOutput(logits, sample, HostCopy.start(sample), input_logprobs)

    def close(self) -> None:
        """Drop the model, pools, backend and graphs so their device memory can be reused (graphs and
        backends reference each other: the cycle is broken here, not left to the garbage collector).
        Idempotent; reading a dropped member afterwards raises AttributeError."""
        self.closed = True
        for name in self.DEVICE_STATE:
            vars(self).pop(name, None)
        gc.collect()
        if self.device == "cuda":
            torch.cuda.empty_cache()

    @property
    def total_kv_tokens(self) -> int:
        """KV slots of this runner's one pool (data-parallel replicas report their sum)."""
        return self.max_total_tokens

    def info(self) -> dict[str, Any]:
        return {"max_total_tokens": self.max_total_tokens, "attention_backend": serving_backend_name(self.attn_backend),
                "dtype": str(self.model_config.dtype), "kv_cache_dtype": str(self.kv_pool.dtype), "device": self.device}
