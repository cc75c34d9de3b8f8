"""The warm-up at engine start: every launch-shape class serving meets, run once before the first request.

Triton compiles a kernel variant per launch-shape class on its first launch: integer arguments are
specialised (== 1, divisible by 16), and plait picks tile sizes, block widths and GQA packing by
size class (the extend kernel's short and long configs, the decode kernel's large-batch tiles).
Unwarmed, those compiles land on the first requests' path (seconds for the first long prompt). CUDA
graph capture already compiles decode at the captured batch sizes; this covers the rest, through the
real scheduler and runner: prefill of each token-count class up to the chunked-prefill size, a
prompt longer than a chunk, batched prefill, a radix-cache hit, mixed prefill + decode steps, decode
at the batch sizes outside the graphs, the sampling variants and, when configured, speculative
verify.

The set is fixed and small (lengths at the class boundaries, not a sweep): ``warmup_plan`` derives it
from the config and the runner's sizes. ``run_warmup`` issues it, then puts the scheduler back in its
initial state (``Scheduler.reset``: empty prefix cache, every KV slot and request row free in their
initial order, counters zero, speculative state forgotten) and restores the global RNG, so what the
engine serves afterwards is what it would have served without it.

``EngineConfig.warmup``: ``auto`` runs it on a GPU only (never on the CPU or under the Triton
interpreter, so tests do not pay for it), ``on`` always (tests force it on the CPU), ``off`` never
(``--skip-warmup``).
"""

from __future__ import annotations

import logging
import math
import os
import random
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any, Protocol

import torch

from plait.attention.triton.decode import large_batch_min_bs
from plait.attention.triton.extend import SHORT_EXTEND_MAX_TOKENS
from plait.config import EngineConfig
from plait.layers.moe import routing_stats
from plait.layers.quantization.gemv_config import GEMV_MAX_TOKENS
from plait.layers.quantization.gemv_config import M_BUCKETS as GEMV_M_BUCKETS
from plait.sampling.params import SamplingParams
from plait.scheduler.req import FinishReason, Req
from plait.scheduler.scheduler import Scheduler

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner
    from plait.models.loader import ModelConfig
    from plait.parallel.roles import EngineScheduler

logger = logging.getLogger(__name__)

# Tokens each decode-class request generates: enough for several decode steps after its prefill.
DECODE_NEW_TOKENS = 4
# Prompt tokens of a decode-class request (short: the phase is about the decode batch size).
DECODE_PROMPT_TOKENS = 8
# Prefill lengths between the short-extend boundary and the chunk: powers of this base.
PREFILL_LENGTH_BASE = 4
# Requests of the batched-prefill phase: a multiple of 16 (Triton's divisibility class) and an odd count.
BATCHED_PREFILL_REQUESTS = (16, 3)
# Requests of the speculative-verify phase besides the single one.
SPEC_BATCH_REQUESTS = 16

SAMPLING_KINDS = ("greedy", "sample", "penalties", "logprobs", "input_logprobs")


@dataclass(frozen=True)
class WarmupShape:
    """What the plan needs from the built runner. ``graph_max_bs``: the largest decode batch the CUDA
    graphs hold (None: decode runs eagerly at every size). ``decode_large_bs``: the smallest decode
    batch the Triton decode kernel launches with its large-batch tiles (None: one config at every
    size, as on the CPU)."""

    max_context_len: int
    max_total_tokens: int
    graph_max_bs: int | None
    decode_large_bs: int | None
    # Token counts of the small-M GEMV's launch classes (``gemv_token_classes``), for the extends of
    # that few tokens; empty where the GEMV never runs (the CPU).
    small_m_tokens: tuple[int, ...] = ()


@dataclass(frozen=True)
class WarmupRequest:
    """One synthetic request. ``prefix_key``: its first ``prefix_len`` tokens are the fixed sequence
    named by the key (shared with other requests of the plan, so a later phase hits the radix cache);
    the rest are fresh."""

    input_len: int
    max_new_tokens: int
    sampling: str = "greedy"
    prefix_key: str | None = None
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.sampling not in SAMPLING_KINDS:
            raise ValueError(f"sampling must be one of {SAMPLING_KINDS}, got {self.sampling!r}")
        if not 0 <= self.prefix_len <= self.input_len:
            raise ValueError(f"prefix_len must be in [0, input_len={self.input_len}], got {self.prefix_len}")

    def sampling_params(self) -> SamplingParams:
        base = {"max_new_tokens": self.max_new_tokens, "ignore_eos": True, "seed": 0}
        kinds = {
            "greedy": {"temperature": 0.0},
            "sample": {"temperature": 0.7, "top_p": 0.9, "top_k": 50, "min_p": 0.05, "logit_bias": ((1, 0.5),)},
            "penalties": {"temperature": 0.0, "repetition_penalty": 1.1, "frequency_penalty": 0.5,
                          "presence_penalty": 0.5},
            "logprobs": {"temperature": 0.0, "logprobs": True, "top_logprobs": 5},
            "input_logprobs": {"temperature": 0.0, "logprobs": True, "top_logprobs": 2, "logprob_start_len": 0},
        }
        return SamplingParams(**base, **kinds[self.sampling])


@dataclass(frozen=True)
class WarmupPhase:
    """Requests run to completion together. ``late``: added once every request of ``requests`` is
    decoding, so the steps after carry prefill and decode rows in one batch."""

    name: str
    requests: tuple[WarmupRequest, ...]
    late: tuple[WarmupRequest, ...] = ()

    @property
    def all_requests(self) -> tuple[WarmupRequest, ...]:
        return self.requests + self.late


@dataclass
class WarmupReport:
    """What the warm-up ran (summed over data-parallel replicas): its phases, requests and prompt
    tokens, and the schedulers' counters just before their reset (``cached_tokens``: prompt tokens
    the radix cache served; ``verify_steps``: speculative verify forwards)."""

    seconds: float
    phases: list[str] = field(default_factory=list)
    requests: int = 0
    prompt_tokens: int = 0
    forward_steps: int = 0
    cached_tokens: int = 0
    verify_steps: int = 0


class WarmupCore(Protocol):
    """What the warm-up uses of the engine core (plait.engine.core.EngineCore)."""

    config: EngineConfig
    model_config: ModelConfig
    scheduler: EngineScheduler

    def new_request(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, seed: int) -> Req: ...


def should_warm_up(config: EngineConfig) -> bool:
    """``auto``: on a GPU, outside the Triton interpreter; ``on`` / ``off`` as said."""
    if config.warmup != "auto":
        return config.warmup == "on"
    return config.resolved_device() == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"


def _pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def prefill_lengths(chunk: int) -> list[int]:
    """Prompt lengths at the class boundaries up to one chunk: 1 token, an odd short extend, the
    short-extend limit and one past it (the extend kernel's two configs), powers of
    PREFILL_LENGTH_BASE in between, and the chunk itself."""
    lengths = {1, 17, SHORT_EXTEND_MAX_TOKENS, SHORT_EXTEND_MAX_TOKENS + 1, chunk}
    n = PREFILL_LENGTH_BASE ** math.ceil(math.log(SHORT_EXTEND_MAX_TOKENS + 2, PREFILL_LENGTH_BASE))
    while n < chunk:
        lengths.add(n)
        n *= PREFILL_LENGTH_BASE
    return sorted(x for x in lengths if 1 <= x <= chunk)


def gemv_token_classes() -> tuple[int, ...]:
    """One token count per launch class of the small-M GEMV (plait.layers.quantization.gemv): its
    tiles follow the smallest tuned bucket >= M, and Triton specialises M == 1 and M % 16 == 0, so
    each bucket's bounds (the first count above the bucket below, and the bucket itself)."""
    counts: set[int] = set()
    below = 0
    for bucket in sorted(b for b in GEMV_M_BUCKETS if b <= GEMV_MAX_TOKENS):
        counts.update({below + 1, bucket})
        below = bucket
    return tuple(sorted(counts))


def decode_class(bs: int, large_bs: int | None) -> tuple[int, bool, bool, bool]:
    """What a decode launch specialises on for ``bs`` requests: its power-of-two size class (launch
    choices that follow the token count, such as MoE tiles by the nearest tuned bucket and the rotary
    kernel's heads per program), Triton's integer classes (== 1, divisible by 16) and the large-batch
    tiles."""
    return _pow2(bs), bs == 1, bs % 16 == 0, large_bs is not None and bs >= large_bs


def eager_decode_sizes(max_running: int, graph_max_bs: int | None, large_bs: int | None) -> list[int]:
    """One decode batch size per launch class the graphs do not hold (every size when there are none),
    up to ``max_running`` requests."""
    floor = graph_max_bs if graph_max_bs is not None else 0
    candidates = {1, 2, 16, 17, max_running, floor + 1}
    if large_bs is not None:
        candidates.add(large_bs)
    b = 1
    while b <= max_running:
        candidates.add(b)
        b *= 2
    sizes: list[int] = []
    seen: set[tuple[int, bool, bool, bool]] = set()
    for bs in sorted(candidates):
        if not floor < bs <= max_running:
            continue
        key = decode_class(bs, large_bs)
        if key not in seen:
            seen.add(key)
            sizes.append(bs)
    return sizes


def warmup_plan(config: EngineConfig, shape: WarmupShape) -> list[WarmupPhase]:
    """The fixed request set for ``config`` on a runner of ``shape``. Every request fits the context
    and the KV pool; no phase holds more requests than ``max_running_requests``."""
    limit = min(shape.max_context_len, shape.max_total_tokens)
    max_running = config.max_running_requests
    chunk = config.prefill_token_budget(shape.max_context_len)
    new = 2

    def fit(n: int, max_new: int = new) -> int:
        return max(1, min(n, limit - max_new - 1))

    phases: list[WarmupPhase] = []
    singles = sorted({fit(n) for n in (*prefill_lengths(chunk), *shape.small_m_tokens) if n <= chunk})
    for n in singles:
        phases.append(WarmupPhase(f"prefill-{n}", (WarmupRequest(n, new),)))
    if fit(chunk + SHORT_EXTEND_MAX_TOKENS + 1) > chunk:  # two chunks: the second extends a prefix
        n = fit(chunk + SHORT_EXTEND_MAX_TOKENS + 1)
        phases.append(WarmupPhase(f"chunked-prefill-{n}", (WarmupRequest(n, new),)))
    for count in sorted({min(c, max_running) for c in BATCHED_PREFILL_REQUESTS}, reverse=True):
        if count > 1:
            n = fit(max(1, chunk // count))
            phases.append(WarmupPhase(f"prefill-batch-{count}x{n}", tuple(WarmupRequest(n, new) for _ in range(count))))
    if not config.disable_radix_cache:
        base = fit(min(chunk, 4 * SHORT_EXTEND_MAX_TOKENS + 17), max_new=SHORT_EXTEND_MAX_TOKENS + 2)
        phases.append(WarmupPhase("radix-fill", (WarmupRequest(base, new, prefix_key="radix", prefix_len=base),)))
        # Hits extended by a short and by a long tail (the extend kernel's two configs over a prefix).
        hits = tuple(WarmupRequest(fit(base + tail), new, prefix_key="radix", prefix_len=base)
                     for tail in (17, SHORT_EXTEND_MAX_TOKENS + 1) if fit(base + tail) > base)
        if hits:
            phases.append(WarmupPhase("radix-hit", hits[: max_running]))
    if max_running >= 2:
        # Decoding requests, then a prompt arriving: mixed steps (decode rows + a prefill chunk).
        first = tuple(WarmupRequest(DECODE_PROMPT_TOKENS, 4 * DECODE_NEW_TOKENS)
                      for _ in range(min(4, max_running - 1)))
        phases.append(WarmupPhase("mixed", first, late=(WarmupRequest(fit(min(chunk, 1024)), new),)))
    for bs in eager_decode_sizes(max_running, shape.graph_max_bs, shape.decode_large_bs):
        phases.append(WarmupPhase(f"decode-bs{bs}", tuple(
            WarmupRequest(DECODE_PROMPT_TOKENS, DECODE_NEW_TOKENS) for _ in range(bs))))
    kinds = SAMPLING_KINDS[: max_running]
    phases.append(WarmupPhase("sampling-mixed", tuple(WarmupRequest(fit(33), DECODE_NEW_TOKENS, k) for k in kinds)))
    for kind in SAMPLING_KINDS[1:]:
        phases.append(WarmupPhase(f"sampling-{kind}", (WarmupRequest(fit(33), DECODE_NEW_TOKENS, kind),)))
    if config.speculative_algorithm is not None:
        # The prompts run once, then again: greedy repeats its output, so an n-gram drafter proposes
        # from what the first pass taught it (a draft model proposes anyway), and verify runs.
        steps = config.speculative_num_steps or 1
        spec_new = 2 * (steps + 1)
        n = fit(96, max_new=spec_new)
        count = min(SPEC_BATCH_REQUESTS, max_running)

        def spec(i: int) -> WarmupRequest:
            return WarmupRequest(n, spec_new, prefix_key=f"spec-{i}", prefix_len=n)

        phases.append(WarmupPhase("spec-seed", tuple(spec(i) for i in range(count))))
        for bs in sorted({1, count}):
            phases.append(WarmupPhase(f"spec-verify-bs{bs}", tuple(spec(i) for i in range(bs))))
    return phases


def runner_shape(runner: ModelRunner) -> WarmupShape:
    graphs = runner.graph_runner
    large: int | None = None
    if runner.device == "cuda":
        sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
        large = large_batch_min_bs(sms, runner.kv_pool.num_kv_heads, runner.kv_pool.head_dim)
    return WarmupShape(runner.max_context_len, runner.max_total_tokens,
                       graphs.max_bs if graphs is not None else None, large,
                       gemv_token_classes() if runner.device == "cuda" else ())


class _Prompts:
    """Token ids for the plan's requests: seeded, inside the vocabulary, away from its edges (special
    tokens sit there), the same on every start."""

    def __init__(self, vocab_size: int, seed: int) -> None:
        self.rng = random.Random(seed)
        lo = min(1000, vocab_size // 4)
        self.lo, self.hi = lo, max(lo + 1, vocab_size - lo)
        self.shared: dict[str, list[int]] = {}

    def fresh(self, n: int) -> list[int]:
        return [self.rng.randrange(self.lo, self.hi) for _ in range(n)]

    def for_request(self, w: WarmupRequest) -> list[int]:
        ids: list[int] = []
        if w.prefix_key is not None:
            shared = self.shared.setdefault(w.prefix_key, [])
            if len(shared) < w.prefix_len:
                shared.extend(self.fresh(w.prefix_len - len(shared)))
            ids = shared[: w.prefix_len]
        return ids + self.fresh(w.input_len - len(ids))


def _run_phase(core: WarmupCore, scheduler: Scheduler, phase: WarmupPhase, prompts: _Prompts,
               counter: list[int]) -> None:
    def submit(ws: tuple[WarmupRequest, ...]) -> list[Req]:
        reqs = []
        for w in ws:
            counter[0] += 1
            req = core.new_request(f"warmup-{counter[0]}", prompts.for_request(w), w.sampling_params(), seed=0)
            scheduler.add_request(req)
            reqs.append(req)
        return reqs

    reqs = submit(phase.requests)
    if phase.late:
        while any(not r.finished for r in reqs) and (scheduler.waiting or scheduler.prefilling):
            scheduler.step()
        reqs += submit(phase.late)
    while any(not r.finished for r in reqs):
        scheduler.step()
    scheduler.flush()
    failed = [r for r in reqs if r.finish_reason == FinishReason.ABORT]
    if failed:
        raise RuntimeError(f"warm-up phase {phase.name}: request {failed[0].rid} aborted: {failed[0].finish_message}")


def _replica_schedulers(scheduler: object) -> list[tuple[Callable[[], AbstractContextManager[Any]], Scheduler]] | None:
    """The schedulers to warm, each with the device context calls into it run under: the one
    ``Scheduler`` (one device, or rank 0 of tensor parallelism), or every data-parallel replica's.
    None for DP attention (its ranks schedule in lockstep, in other processes)."""
    from plait.parallel.data_parallel import DataParallelScheduler  # as the core imports it: when used

    if isinstance(scheduler, Scheduler):
        return [(nullcontext, scheduler)]
    if isinstance(scheduler, DataParallelScheduler):
        return [(partial(scheduler.runner.on_replica, i), s) for i, s in enumerate(scheduler.replicas)]
    return None


def _warm_one(core: WarmupCore, scheduler: Scheduler, report: WarmupReport) -> None:
    """The plan through one scheduler, then its reset; adds what ran to ``report``."""
    if scheduler.has_work():
        raise RuntimeError("warm-up runs on an idle engine, before its first request")
    plan = warmup_plan(core.config, runner_shape(scheduler.runner))
    prompts = _Prompts(core.model_config.vocab_size, core.config.seed)
    rid_counter = [report.requests]
    for phase in plan:
        _run_phase(core, scheduler, phase, prompts, rid_counter)
        report.phases.append(phase.name)
        report.requests += len(phase.all_requests)
        report.prompt_tokens += sum(w.input_len for w in phase.all_requests)
    if scheduler.runner.device == "cuda":
        torch.cuda.synchronize()
    report.forward_steps += scheduler.stats.forward_steps
    report.cached_tokens += scheduler.stats.cached_tokens
    spec_stats = getattr(scheduler.spec_worker, "stats", None)  # BaseSpecWorker's counters
    report.verify_steps += spec_stats.verify_steps if spec_stats is not None else 0
    scheduler.reset()
    experts = routing_stats.counter_of(scheduler.runner.model)
    if experts is not None:  # benchmarks count the experts their own requests route to
        experts.reset()


def run_warmup(core: WarmupCore) -> WarmupReport | None:
    """Run the plan through ``core``'s scheduler (each data-parallel replica's in turn) and reset
    it; restore the global RNG. None (nothing run) under DP attention."""
    schedulers = _replica_schedulers(core.scheduler)
    if schedulers is None:
        logger.info("warm-up skipped: the %s layout is not warmed up yet", type(core.scheduler).__name__)
        return None
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    start = time.perf_counter()
    report = WarmupReport(0.0)
    for context, scheduler in schedulers:
        with context():
            _warm_one(core, scheduler, report)
    torch.random.set_rng_state(cpu_rng)
    if cuda_rng is not None:
        torch.cuda.set_rng_state_all(cuda_rng)
    report.seconds = time.perf_counter() - start
    logger.info("warm-up: %d phases, %d requests, %d prompt tokens in %.2f s (%d scheduler%s)", len(report.phases),
                report.requests, report.prompt_tokens, report.seconds, len(schedulers),
                "" if len(schedulers) == 1 else "s")
    return report
