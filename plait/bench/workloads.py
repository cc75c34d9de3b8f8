"""The named workloads for plait (docs/benchmarks.md), with their floors.

decode-bs1          one request, 128 in / 256 out, greedy: decode tokens/s (prefill excluded)
offline-throughput  256 requests, 512 in / 128 out, ignore_eos: output tokens/s
nano-vllm           256 requests, in and out uniform in [100, 1024], seed 0, ignore_eos
prefill             8 x 2048-token prompts: prefill tokens/s and MFU
"""

from __future__ import annotations

import gc
import os
import random
import time
from dataclasses import dataclass
from typing import Any

import torch

from plait import envs
from plait.bench.hardware import bench_dtype, sync
from plait.bench.shapes import (
    attention_flops,
    expected_distinct_experts,
    is_moe,
    kv_bytes_per_token,
    moe_counts,
    param_counts,
)
from plait.engine.heap import gc_pauses
from plait.engine.step_timing import step_timing
from plait.layers.moe import routing_stats
from plait.layers.moe.routing_stats import RoutedExpertCounter


@dataclass(frozen=True)
class Limits:
    copy_bw: float  # bytes/s, read + write
    read_bw: float  # bytes/s, read only
    matmul_rate: float  # bf16 FLOP/s


def make_engine(shape_dir: str, count_experts: bool = False, **options: Any):
    """``count_experts``: the engine counts the distinct experts each sparse-layer call routes to
    (plait.layers.moe.routing_stats; read back with ``routed_expert_counts``)."""
    from plait.engine import Engine

    options.setdefault("load_format", "dummy")
    options.setdefault("dtype", bench_dtype())
    options.setdefault("context_length", 4096)
    if not torch.cuda.is_available():  # CPU smoke runs: a pool sized from host memory costs seconds per step
        options.setdefault("max_total_tokens", 16384)
    if not count_experts:
        return Engine(model=shape_dir, **options)
    # Read while the engine builds its model (and inherited by spawned ranks), before graph capture.
    name, before = envs.COUNT_ROUTED_EXPERTS.name, os.environ.get(envs.COUNT_ROUTED_EXPERTS.name)
    os.environ[name] = "1"
    try:
        return Engine(model=shape_dir, **options)
    finally:
        if before is None:
            del os.environ[name]
        else:
            os.environ[name] = before


def routed_expert_counter(engine: Any) -> RoutedExpertCounter:
    counter = routing_stats.counter_of(engine.runner.model)
    assert counter is not None, "the engine was not built with count_experts=True (or its model is dense)"
    return counter


def release(engine: Any) -> None:
    engine.shutdown()
    del engine
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def random_prompts(n: int, length: int | list[int], vocab: int, seed: int) -> list[list[int]]:
    """Uniform ids at least 1000 (an eighth of a small vocabulary) from both ends of it."""
    rng = random.Random(seed)
    lengths = [length] * n if isinstance(length, int) else length
    edge = min(1000, vocab // 8)
    return [[rng.randrange(edge, vocab - edge) for _ in range(L)] for L in lengths]


def nano_vllm_requests(n: int, seed: int = 0) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """nano-vllm's own benchmark recipe (its ``random.seed(0)``): ``n`` prompts of ids in [0, 10000]
    and lengths uniform in [100, 1024], each with an output length uniform in [100, 1024], sampled at
    temperature 0.6 with ignore_eos (request i seeded i). Another ``seed``: fresh requests alike."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(n)]
    params = [{"temperature": 0.6, "ignore_eos": True, "max_new_tokens": rng.randint(100, 1024), "seed": i}
              for i in range(n)]
    return prompts, params


def timed(fn: Any) -> tuple[Any, float]:
    sync()
    t0 = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t0


# --- floors -------------------------------------------------------------------------------------
def decode_step_bytes(shape: str, contexts: list[int], distinct_experts: float | None = None,
                      weight_bytes: float | None = None, kv_dtype_bytes: int = 2) -> float:
    """Bytes one decode step must read: every matmul weight (bf16) plus the KV cache of the batch. A
    mixture of experts reads its dense weights plus, per sparse layer, the experts the step routes to:
    ``distinct_experts`` per layer (counted in the run: ``distinct_for_step``), else the expectation
    under uniform routing. ``weight_bytes``: the weights in all as a quantized model stores them;
    ``kv_dtype_bytes``: bytes per KV element."""
    kv = kv_bytes_per_token(shape, kv_dtype_bytes) * sum(contexts)
    if weight_bytes is not None:
        return weight_bytes + kv
    if not is_moe(shape):
        return 2 * param_counts(shape)["matmul"] + kv
    m = moe_counts(shape)
    routed = expected_distinct_experts(shape, len(contexts)) if distinct_experts is None else distinct_experts
    return 2 * (param_counts(shape)["dense_matmul"] + m["sparse_layers"] * routed * m["per_expert"]) + kv


def distinct_for_step(measured: dict[int, float] | None, tokens: int) -> float | None:
    """The run's mean distinct experts per layer call for a decode step of ``tokens`` requests: the
    calls of the smallest recorded size in [tokens, 2 * tokens] (a CUDA graph pads the batch up to its
    bucket, and the padding rows route too); None when the run recorded no such call."""
    sizes = [t for t in (measured or {}) if tokens <= t <= 2 * tokens]
    return measured[min(sizes)] if measured and sizes else None


def decode_step_flops(shape: str, contexts: list[int]) -> float:
    return 2 * param_counts(shape)["matmul"] * len(contexts) + sum(attention_flops(shape, 1, c) for c in contexts)


def prefill_flops(shape: str, prompt_lens: list[int]) -> float:
    """2 x layer parameters x tokens + causal attention + the LM head on each prompt's last token."""
    p = param_counts(shape)
    return sum(2 * p["layers"] * n + 2 * p["lm_head"] + attention_flops(shape, n, n) for n in prompt_lens)


def throughput_floor_seconds(shape: str, prompt_lens: list[int], output_lens: list[int], lim: Limits,
                             weight_bytes: float | None = None, kv_dtype_bytes: int = 2,
                             distinct_by_tokens: dict[int, float] | None = None) -> float:
    """Sum over steps of max(FLOPs / matmul rate, bytes / copy bandwidth): all prefill compute-bound,
    then one decode step per output position over the requests still running. ``weight_bytes`` /
    ``kv_dtype_bytes``: a quantized run's storage (decode_step_bytes); ``lim.matmul_rate`` is the
    ceiling of the run's matmul type (FP8 for FP8 weights). ``distinct_by_tokens``: a MoE run's
    counted distinct experts per layer call, by call size (``distinct_for_step``)."""
    seconds = prefill_flops(shape, prompt_lens) / lim.matmul_rate
    for step in range(1, max(output_lens)):
        contexts = [p + step for p, o in zip(prompt_lens, output_lens, strict=True) if o > step]
        seconds += max(decode_step_flops(shape, contexts) / lim.matmul_rate,
                       decode_step_bytes(shape, contexts, distinct_for_step(distinct_by_tokens, len(contexts)),
                                         weight_bytes=weight_bytes, kv_dtype_bytes=kv_dtype_bytes) / lim.copy_bw)
    return seconds


# --- workloads ----------------------------------------------------------------------------------
def plait_decode_bs1(shape: str, shape_dir: str, prompt: list[int], new_tokens: int,
                     count_experts: bool | None = None, **options: Any) -> dict[str, Any]:
    """A MoE shape also counts (``count_experts``, by default for MoE shapes) the distinct experts of
    the timed run's decode steps (one token each: top_k of them at most), per layer:
    ``distinct_experts_per_layer_step``. The counter is device work inside the timed steps, so a
    headline figure is taken with it off."""
    moe = is_moe(shape) if count_experts is None else count_experts and is_moe(shape)
    engine = make_engine(shape_dir, count_experts=moe, disable_radix_cache=True, max_running_requests=8, **options)
    params = {"temperature": 0.0, "ignore_eos": True}
    engine.generate(prompt, {**params, "max_new_tokens": min(32, new_tokens)})  # warm-up
    t_one = min(timed(lambda: engine.generate(prompt, {**params, "max_new_tokens": 1}))[1] for _ in range(3))
    if moe:
        routed_expert_counter(engine).reset()
    # The best of two, like the prefill's best of three: a decode of a few steps on a loaded host can
    # otherwise come out shorter than the noise in the prefill time it is measured against.
    t_all = min(timed(lambda: engine.generate(prompt, {**params, "max_new_tokens": new_tokens}))[1] for _ in range(2))
    routing: dict[str, Any] = {}
    if moe:
        by_tokens = routed_expert_counter(engine).mean_distinct_by_tokens()
        routing = {"distinct_experts_per_layer_step": by_tokens.get(1), "routing_calls_by_tokens": by_tokens}
    info = {**routing, "kv_capacity_tokens": engine.runner.max_total_tokens,
            "attention_backend": engine.runner.attn_backend.name,
            "cuda_graph": engine.runner.graph_runner is not None, **symmetric_paths(engine)}
    release(engine)
    if t_all <= t_one:
        raise RuntimeError(f"decode-bs1: {new_tokens} tokens took {t_all:.4f} s, no longer than the prefill alone "
                           f"({t_one:.4f} s): measure more output tokens (--output-len)")
    tok_s = (new_tokens - 1) / (t_all - t_one)
    return {"tok_s": tok_s, "ms_per_step": 1e3 / tok_s, "prefill_s": t_one, "total_s": t_all, **info}


def plait_prefill(shape: str, shape_dir: str, n: int, length: int, vocab: int, **options: Any) -> dict[str, Any]:
    engine = make_engine(shape_dir, disable_radix_cache=True, chunked_prefill_size=n * length, max_running_requests=n,
                         **options)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 1}
    engine.generate(random_prompts(n, length, vocab, seed=1), params)  # warm-up
    prompts = random_prompts(n, length, vocab, seed=2)
    _, seconds = timed(lambda: engine.generate(prompts, params))
    backend = engine.runner.attn_backend.name
    release(engine)
    return {"tokens_per_s": n * length / seconds, "seconds": seconds, "attention_backend": backend}


# Timed passes of an offline workload (after its warm-up pass): the figure is the median pass. One
# pass of a short workload moves by several percent between runs of the same code.
TIMED_REPEATS = 3


def plait_throughput(shape_dir: str, prompts: list[list[int]], params: list[dict[str, Any]],
                     count_experts: bool = False, repeats: int = TIMED_REPEATS, **options: Any) -> dict[str, Any]:
    """The workload once to warm up, then ``repeats`` timed passes on an emptied prefix cache; the
    result is the median pass (its seconds, steps and collector stalls), with every pass's output
    tok/s in ``runs_output_tok_s``. ``count_experts`` (MoE shapes): ``distinct_experts_by_tokens``,
    the median pass's mean distinct experts per sparse-layer call, by the call's token count."""
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1 timed pass, got {repeats}")
    engine = make_engine(shape_dir, count_experts=count_experts, **options)
    # Warm-up is the whole workload once: Triton compiles a kernel variant per launch shape class
    # (tile sizes, integer specialisations), and a partial warm-up leaves compiles inside the timing.
    engine.generate(prompts, params)
    passes = []
    for _ in range(repeats):
        engine.scheduler.tree_cache.reset()
        if count_experts:
            routed_expert_counter(engine).reset()
        with step_timing(engine.scheduler) as steps, gc_pauses() as pauses:
            outs, seconds = timed(lambda: engine.generate(prompts, params))
        routing = ({"distinct_experts_by_tokens": routed_expert_counter(engine).mean_distinct_by_tokens()}
                   if count_experts else {})
        generated = sum(len(o.token_ids) for o in outs)
        passes.append({"seconds": seconds, "generated": generated, "steps": steps.summary(seconds),
                       "gc_pauses": pauses, "routing": routing})
    median = sorted(passes, key=lambda p: p["seconds"])[len(passes) // 2]
    stats = engine.scheduler.stats
    info = {"kv_capacity_tokens": engine.runner.max_total_tokens, "retractions": stats.num_retractions,
            "attention_backend": engine.runner.attn_backend.name, "cuda_graph": engine.runner.graph_runner is not None,
            "forward_steps": stats.forward_steps, "kv_tokens_in_use_after": engine.scheduler.kv_tokens_in_use(),
            "gc_pauses": median["gc_pauses"], "timed_passes": repeats,
            "runs_output_tok_s": [p["generated"] / p["seconds"] for p in passes],
            **symmetric_paths(engine), **median["routing"], **piecewise_stats(engine)}
    release(engine)
    return {"output_tok_s": median["generated"] / median["seconds"], "seconds": median["seconds"],
            "generated_tokens": median["generated"], **info, "steps": median["steps"]}


def piecewise_stats(engine: Any) -> dict[str, Any]:
    """Under --enable-piecewise-cuda-graph: the piecewise replays per bucket and the eager forwards
    per fallback reason over the engine's life (warm-up and timed runs together)."""
    runner = getattr(engine.runner, "piecewise_runner", None)
    if runner is None:
        return {}
    return {"piecewise_replays": dict(runner.replays), "piecewise_fallbacks": dict(runner.fallbacks)}


def symmetric_paths(engine: Any) -> dict[str, bool]:
    """Whether the run's collectives took the symmetric-memory paths (they fall back to NCCL silently
    but for a warning): tensor parallelism's custom all-reduce, DP attention's row exchange."""
    runner = engine.runner
    return {"custom_all_reduce": getattr(runner.tp, "p2p_all_reduce", None) is not None,
            "dp_row_exchange": getattr(runner, "row_exchange", None) is not None}


def steady_decode_timing(engine: Any, bs: int, vocab: int, steps: int = 50, seed: int = 5,
                         on_steady: Any = None, after_timed: Any = None, prompt_len: int = 128) -> dict[str, float]:
    """Fill the engine with ``bs`` decoding requests of ``prompt_len`` prompt tokens, then time
    ``steps`` scheduler steps and as many replays of the bucket's CUDA graph alone. ``on_steady()``
    runs once the batch is steady, just before the timed steps, and ``after_timed()`` right after
    them (to bracket counters). The requests are aborted afterwards."""
    sched = engine.scheduler
    for p in random_prompts(bs, prompt_len, vocab, seed=seed):
        sched.add_request(engine.make_request(p, {"temperature": 0.0, "ignore_eos": True,
                                                  "max_new_tokens": steps + 150}))
    while len(sched.running) < bs or sched.prefilling or sched.waiting:
        sched.step()
    for _ in range(5):
        sched.step()
    if on_steady is not None:
        on_steady()
    sync()
    t0 = time.perf_counter()
    for _ in range(steps):
        sched.step()
    sync()
    step_s = (time.perf_counter() - t0) / steps
    if after_timed is not None:
        after_timed()
    graph = engine.runner.graph_runner.graphs[engine.runner.graph_runner.bucket(bs)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    replay_s = start.elapsed_time(end) / 1e3 / steps
    for req in list(sched.running):
        sched.abort(req.rid)
    while sched.has_work():
        sched.step()
    return {"step_ms": step_s * 1e3, "replay_ms": replay_s * 1e3, "step_over_replay": step_s / replay_s, "bs": bs}


def overlap_step_vs_replay(shape_dir: str, bs: int, vocab: int) -> dict[str, Any]:
    """Steady decode at ``bs``: the scheduler's step time against the CUDA graph replay alone."""
    engine = make_engine(shape_dir, max_running_requests=bs, cuda_graph_max_bs=bs)
    result = steady_decode_timing(engine, bs, vocab)
    release(engine)
    return result
