"""Speculative-decoding workloads (``plait bench spec``; docs/benchmarks.md).

spec-ngram-repeat  64 prompts decoded once (fills the n-gram cache), then again with NGRAM (4 draft
                   tokens) at bs=1 and bs=16: accept length and speedup over non-speculative decoding
                   (the repeats are timed after one untimed repeat, for plain and NGRAM alike), per
                   decode / verify step (the headline) and end to end
spec-ngram-miss    fresh prompts with no n-gram matches (sampled outputs): NGRAM's cost over plain decoding
spec-overhead      one TARGET_VERIFY forward of 4 tokens per request (graph-replayed: uniform width 4 is
                   captured) against one graph-replayed decode step at bs 1 / 16 / 64, the acceptance
                   bookkeeping on the host separately, and one EAGLE3 draft step (the first, through
                   ``fc``, and a later one; topk 1 and 4) against its byte floor

Each function takes a checkpoint directory (a shape written by ``plait.bench.shapes`` on the GPU, or
a tiny model in the CPU smoke test) and returns plain numbers; ``cmd_spec`` writes the JSON.
The EAGLE3 topk-4 later step is measured as a chain step over bs * 4 rows (one row per branch over
the same prefix), which is what a tree step reads; trees for EAGLE3 are not in the engine yet.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import tempfile
import time
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import Any, TypeVar

import torch

from plait.bench.host_cpu import cpu_use, read_counters
from plait.bench.workloads import make_engine, release, timed
from plait.executor.graph_utils import capture_batch_sizes
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.radix_cache import common_prefix_len
from plait.sampling import SamplingParams
from plait.speculative.tree import DraftTree

K = TypeVar("K")

NGRAM = {"speculative_algorithm": "NGRAM", "speculative_num_steps": 3, "speculative_eagle_topk": 1,
         "speculative_num_draft_tokens": 4}


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """Uniform ids away from both ends of the vocabulary (special tokens, padding rows)."""
    rng = random.Random(seed)
    lo, hi = min(1000, vocab // 8), vocab - min(1000, vocab // 8)
    return [[rng.randrange(lo, hi) for _ in range(length)] for _ in range(n)]


def _params(output_len: int) -> dict[str, Any]:
    return {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": output_len}


@dataclass(frozen=True)
class _Pass:
    """One timed ``generate``: tokens generated, seconds, verify request-steps by accepted drafts (empty
    for a plain engine), the outputs, and the forwards it ran (every kind) and of them the verifies."""

    tokens: int
    seconds: float
    hist: dict[int, int]
    outs: list[Any]
    forwards: int
    verifies: int
    # Request-steps of every kind: verified requests (each verify row's request, drafting or riding
    # along) and requests decoded by plain forwards.
    request_steps: int
    plain_steps: dict[str, int]  # the speculative worker's steps that verified nothing, by cause


def _timed_pass(engine: Any, prompts: list[list[int]], output_len: int) -> _Pass:
    worker, stats = engine.scheduler.spec_worker, engine.scheduler.stats

    def counters() -> tuple[dict[int, int], int, int, int, dict[str, int]]:
        if worker is None:
            return {}, stats.forward_steps, 0, stats.decode_rows, {}
        return (dict(worker.stats.accept_histogram), stats.forward_steps, worker.stats.verify_steps,
                stats.decode_rows + worker.stats.verified_requests, dict(worker.stats.plain_steps))

    hist, forwards, verifies, rows, plain = counters()
    outs, seconds = timed(lambda: engine.generate(prompts, _params(output_len)))
    hist_after, forwards_after, verifies_after, rows_after, plain_after = counters()
    return _Pass(sum(len(o.token_ids) for o in outs), seconds, _minus(hist_after, hist), outs,
                 forwards_after - forwards, verifies_after - verifies, rows_after - rows, _minus(plain_after, plain))


def _minus(after: dict[K, int], before: dict[K, int]) -> dict[K, int]:
    """Counts of ``after`` less those of ``before`` (a counter read at two times)."""
    return {k: c - before.get(k, 0) for k, c in after.items()}


def _prefix_agreement(first: list[list[int]], later: list[list[int]]) -> float:
    """Mean over requests of the share of ``later``'s tokens before it first differs from ``first``."""
    shares = [common_prefix_len(a, b) / max(len(b), 1) for a, b in zip(first, later, strict=True)]
    return sum(shares) / max(len(shares), 1)


def _mean_gain(hist: dict[int, int]) -> float:
    """Tokens gained per verify request-step (accepted drafts + the bonus token) of a histogram."""
    steps = sum(hist.values())
    return sum((k + 1) * c for k, c in hist.items()) / steps if steps > 0 else 1.0


def _step_and_end_to_end(engine: Any, prompts: list[list[int]], output_len: int) -> dict[str, Any]:
    """The same prompts decoded to ``output_len // 2`` and to ``output_len`` tokens, greedy (the first
    half is a prefix of the whole). End to end: the whole pass's tokens per second, prefills and first
    tokens included. Per step: the second half's extra tokens over its extra seconds, so the prefills,
    the first tokens and the requests' admission drop out -- what a step costs, the quantity
    ``speedup_over_accept_length`` is defined on. Its accept length is the second half's tokens per
    request-step of every kind: a speculative run's plain decode steps (an n-gram miss) count with the
    one token each gave, as their time counts in the tokens per second it is divided into; at bs 1
    the ratio is then plain step time over the speculative run's step time. ``verify_accept_length``
    is the verifies' alone (the histogram difference of the two passes)."""
    half = max(1, output_len // 2)
    cpu_before = read_counters([os.getpid()])
    first, whole = _timed_pass(engine, prompts, half), _timed_pass(engine, prompts, output_len)
    cpu_after = read_counters([os.getpid()])
    second = _minus(whole.hist, first.hist)
    tokens, request_steps = whole.tokens - first.tokens, whole.request_steps - first.request_steps
    forwards = whole.forwards - first.forwards
    return {"tok_s": whole.tokens / whole.seconds,
            "step_tok_s": tokens / max(whole.seconds - first.seconds, 1e-9),
            "step_accept_length": tokens / request_steps if request_steps > 0 else 1.0,
            "verify_accept_length": _mean_gain(second) if sum(second.values()) > 0 else _mean_gain(whole.hist),
            # Requests per forward over the second half: below the batch size where requests run out
            # at different steps (a straggler's steps carry fewer rows).
            "step_occupancy": request_steps / forwards if forwards > 0 else 0.0,
            # The second half's forwards: verifies, and the rest (plain decode steps; a miss back-off's
            # steps in a speculative run), so a per-step ratio can be read per kind of step.
            "step_forwards": {"verify": whole.verifies - first.verifies,
                              "other": (whole.forwards - first.forwards) - (whole.verifies - first.verifies)},
            # A speculative run's steps without a verify over the second half, by cause (SpecStats.plain_steps).
            "step_plain_steps": _minus(whole.plain_steps, first.plain_steps),
            # The machine's CPUs over both passes (stolen ones too): host-bound steps move with them.
            "host_cpu": cpu_use(cpu_before, cpu_after, {"engine": [os.getpid()]}),
            "outs": whole.outs}


def spec_ngram_repeat(shape_dir: str, vocab: int, num_prompts: int = 64, input_len: int = 128,
                      output_len: int = 128, batch_sizes: tuple[int, ...] = (1, 16), **options: Any
                      ) -> dict[str, Any]:
    """Per batch size: plain and NGRAM decoding of the same prompts a third time (the first pass fills
    the n-gram and prefix caches, the second compiles what only repeats use). ``speedup_over_accept_length``
    is plain step time over speculative step time per accepted length (``_step_and_end_to_end``'s
    per-step rates); ``speedup`` and ``speedup_over_accept_length_end_to_end`` are the same from whole
    passes, prefills and first tokens included."""
    prompts = random_prompts(num_prompts, input_len, vocab, seed=7)
    result: dict[str, Any] = {}
    for bs in batch_sizes:
        row: dict[str, Any] = {}
        plain_tokens: list[list[int]] = []
        for name, extra in (("plain", {}), ("ngram", NGRAM)):
            engine = make_engine(shape_dir, max_running_requests=bs, **options, **extra)
            # The first pass: fills the n-gram and prefix caches.
            first_pass = [o.token_ids for o in engine.generate(prompts, _params(output_len))]
            # A second, untimed repeat pass compiles what only repeats use (kernel variants of the
            # verify widths met, prefix-hit prefills); the timed passes decode exactly as it does.
            engine.generate(prompts, _params(output_len))
            timing = _step_and_end_to_end(engine, prompts, output_len)
            row[f"{name}_tok_s"] = timing["tok_s"]
            row[f"{name}_step_tok_s"] = timing["step_tok_s"]
            row[f"{name}_step_forwards"] = timing["step_forwards"]
            row[f"{name}_step_occupancy"] = timing["step_occupancy"]
            row[f"{name}_step_plain_steps"] = timing["step_plain_steps"]
            row[f"{name}_host_cpu"] = timing["host_cpu"]
            tokens = [o.token_ids for o in timing["outs"]]
            # How far the timed pass repeats the first pass's text (the n-gram cache's): 1.0 when every
            # token is the same; on random weights, near-tied tokens whose rows ran through other kernels
            # than in the first pass drift, and the drafts after the drift miss.
            row[f"{name}_repeat_agreement"] = _prefix_agreement(first_pass, tokens)
            if name == "plain":
                plain_tokens = tokens
            if name == "ngram":
                # Greedy speculation should give plain decoding's tokens; in bf16 a verify's wider
                # matmuls may round a near tie the other way, so this is recorded, not asserted.
                same = sum(a == b for a, b in zip(tokens, plain_tokens, strict=True))
                row["outputs_equal_plain"] = same / len(tokens)
                outs = timing["outs"]
                lengths = [o.meta_info["spec_accept_length"] for o in outs if o.meta_info["spec_verify_ct"]]
                row["accept_length"] = sum(lengths) / len(lengths) if lengths else 1.0
                row["step_accept_length"] = timing["step_accept_length"]
                row["verify_accept_length"] = timing["verify_accept_length"]
                stats = engine.scheduler.spec_worker.stats
                row["accept_histogram"] = dict(stats.accept_histogram)
                # Of every verify the engine ran (its warm passes included): launched ahead of the one before.
                row["verify_steps"], row["launched_ahead"] = stats.verify_steps, stats.launched_ahead
                row["ahead_declined"] = dict(stats.ahead_declined)
                row["staged"] = dict(stats.staged)
            release(engine)
        row["speedup"] = row["ngram_tok_s"] / row["plain_tok_s"]
        row["speedup_over_accept_length_end_to_end"] = row["speedup"] / row["accept_length"]
        row["step_speedup"] = row["ngram_step_tok_s"] / row["plain_step_tok_s"]
        row["speedup_over_accept_length"] = row["step_speedup"] / row["step_accept_length"]
        # The same over the verifies' accept length alone (this figure before plain steps counted):
        # a speculative run's plain steps then weigh as if each had cost a verify's tokens.
        row["speedup_over_verify_accept_length"] = row["step_speedup"] / row["verify_accept_length"]
        result[f"bs{bs}"] = row
    return result


def spec_ngram_miss(shape_dir: str, vocab: int, num_prompts: int = 16, input_len: int = 128, output_len: int = 128,
                    **options: Any) -> dict[str, Any]:
    """Outputs are sampled (temperature 1, seeded): greedy decoding of a random-weight model loops on
    a few tokens, which the drafter then matches (a repeat, not a miss); sampled tokens from a
    near-uniform distribution over the vocabulary leave it nothing to match. Plain and NGRAM sample
    with the same seeds. ``verify_steps`` and the histogram show how often it still guessed."""
    params = {**_params(output_len), "temperature": 1.0, "seed": 1234}
    row: dict[str, Any] = {}
    for name, extra in (("plain", {}), ("ngram", NGRAM)):
        engine = make_engine(shape_dir, max_running_requests=num_prompts, disable_radix_cache=True, **options,
                             **extra)
        # Two untimed passes over other fresh prompts: kernel variants first met on a miss path (Triton
        # compiles per specialisation, ~0.1-1 s each) land there, not in the timed pass.
        for seed in (11, 12):
            engine.generate(random_prompts(num_prompts, input_len, vocab, seed=seed), params)
        stats = engine.scheduler.spec_worker.stats if name == "ngram" else None
        before = stats.verify_steps if stats is not None else 0
        hist_before = dict(stats.accept_histogram) if stats is not None else {}
        fresh = random_prompts(num_prompts, input_len, vocab, seed=13)
        outs, seconds = timed(partial(engine.generate, fresh, params))
        row[f"{name}_tok_s"] = sum(len(o.token_ids) for o in outs) / seconds
        if stats is not None:
            row["verify_steps"] = stats.verify_steps - before
            row["accept_histogram"] = {k: c - hist_before.get(k, 0) for k, c in stats.accept_histogram.items()
                                       if c > hist_before.get(k, 0)}
        release(engine)
    row["cost_over_plain"] = row["plain_tok_s"] / row["ngram_tok_s"]
    return row


def _time(fn: Any, iters: int) -> float:
    fn()
    _, seconds = timed(lambda: [fn() for _ in range(iters)])
    return seconds / iters


def _overhead_at(runner: Any, worker: Any, rows: list[int], slots: torch.Tensor, context: int, width: int,
                 iters: int) -> dict[str, float]:
    bs, device, stride = len(rows), runner.device, context + width
    dec_slots = torch.stack([slots[i * stride + context] for i in range(bs)])
    rows_t = torch.tensor(rows, dtype=torch.int64, device=device)

    def decode() -> None:
        fb = ForwardBatch(ForwardMode.DECODE, bs, torch.ones(bs, dtype=torch.int64, device=device), rows_t,
                          torch.full((bs,), context + 1, device=device), dec_slots,
                          torch.full((bs,), context, device=device), seq_lens_cpu=[context + 1] * bs,
                          seq_lens_sum=(context + 1) * bs)
        runner.forward(fb)

    greedy = SamplingParams(temperature=0.0)
    reqs = [SimpleNamespace(kv_len=context, req_pool_idx=r, sampling_params=greedy) for r in rows]
    trees = [DraftTree.chain(1, [2] * (width - 1)) for _ in rows]
    ver_slots = torch.cat([slots[i * stride + context : (i + 1) * stride] for i in range(bs)])
    logits_box: list[torch.Tensor] = []

    def verify() -> None:
        logits_box[:] = [runner.forward(worker.build_verify_batch(reqs, trees, ver_slots)).next_token_logits]

    graphs = runner.verify_graph_runner
    replayed = graphs is not None and graphs.can_run(worker.build_verify_batch(reqs, trees, ver_slots))
    t_dec, t_ver = _time(decode, iters), _time(verify, iters)
    t0 = time.perf_counter()
    for _ in range(iters):
        worker.accept(reqs, trees, logits_box[0])
    t_acc = (time.perf_counter() - t0) / iters
    out = {"decode_ms": t_dec * 1e3, "verify_ms": t_ver * 1e3, "verify_over_decode": t_ver / t_dec,
           "verify_graph_replayed": replayed, "accept_bookkeeping_ms": t_acc * 1e3}
    if device == "cuda" and bs == 1:  # where the verify step's extra time goes, kernel by kernel
        out["kernels_decode"], out["kernels_verify"] = kernel_table(decode), kernel_table(verify)
    return out


def kernel_table(fn: Any, calls: int = 10, top: int = 20) -> list[dict[str, Any]]:
    """GPU kernels of ``calls`` calls of ``fn`` (graph replays included), per call, longest first."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    events = sorted((e for e in prof.key_averages() if e.device_time_total > 0), key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:100], "calls_per_call": e.count / calls, "us_per_call": e.device_time_total / calls}
            for e in events[:top]]


def spec_overhead(shape_dir: str, batch_sizes: tuple[int, ...] = (1, 16, 64), context: int = 512, width: int = 4,
                  iters: int = 20, **options: Any) -> dict[str, Any]:
    """Forward costs on synthetic rows (KV values are whatever the pool holds: cost, not output)."""
    max_bs = max(batch_sizes)
    engine = make_engine(shape_dir, max_running_requests=max_bs, cuda_graph_max_bs=max_bs, **options, **NGRAM)
    runner, worker = engine.runner, engine.scheduler.spec_worker
    rows = [runner.req_to_token_pool.alloc() for _ in range(max_bs)]
    slots = runner.allocator.alloc(max_bs * (context + width))
    assert slots is not None and all(r is not None for r in rows)
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, slots[i * (context + width) : i * (context + width) + context])
    result: dict[str, Any] = {"context": context, "width": width,
                              "verify_graph": runner.verify_graph_runner is not None,
                              "decode_graph": runner.graph_runner is not None}
    for bs in batch_sizes:
        result[f"bs{bs}"] = _overhead_at(runner, worker, rows[:bs], slots, context, width, iters)
    release(engine)
    return result


def _head_bytes(head: torch.nn.Module, with_fc: bool) -> int:
    """Weight bytes one draft step reads: every head parameter except the embedding table (rows
    only) and, after the first step, ``fc`` (later steps feed the head's own hidden)."""
    total = 0
    for name, p in head.named_parameters():
        if name.startswith("embed_tokens") or (name.startswith("fc.") and not with_fc):
            continue
        total += p.numel() * p.element_size()
    return total


def eagle3_draft_step(shape_dir: str, context: int = 512, bs: int = 1, topks: tuple[int, ...] = (1, 4),
                      iters: int = 50, read_bytes_per_s: float | None = None, graph_factory: Any = None,
                      **options: Any) -> dict[str, Any]:
    """Graph-replayed EAGLE3 draft steps over synthetic rows: the first (k = 1 graph, through fc) and a
    later one (k = 2 graph minus k = 1), at ``bs * topk`` rows, each over its byte floor (head
    weights + the head's KV read) at the measured read bandwidth. The CPU smoke test passes a
    bandwidth and an EagerGraph factory."""
    from plait.bench.hardware import hbm_bandwidth
    from plait.models.eagle_heads import make_eagle_head

    vocab = json.loads((pathlib.Path(shape_dir) / "config.json").read_text())["vocab_size"]
    head_dir = make_eagle_head(tempfile.mkdtemp(prefix="plait-eagle3-"), shape_dir, "EAGLE3",
                               draft_vocab_size=min(32000, vocab // 2))
    rows_max = bs * max(topks)
    engine = make_engine(shape_dir, max_running_requests=rows_max, cuda_graph_max_bs=rows_max, **options,
                         speculative_algorithm="EAGLE3", speculative_draft_model_path=str(head_dir),
                         speculative_num_steps=2, speculative_eagle_topk=1, speculative_num_draft_tokens=3)
    runner, worker = engine.runner, engine.scheduler.spec_worker
    graphs = (worker.draft_graphs if graph_factory is None
              else worker.build_draft_graphs(capture_batch_sizes(rows_max), graph_factory))
    assert graphs is not None, "draft-loop graphs need a GPU with graphs enabled"
    device = runner.device
    rows = [runner.req_to_token_pool.alloc() for _ in range(rows_max)]
    slots = runner.allocator.alloc(rows_max * (context + 2))
    assert slots is not None and all(r is not None for r in rows)
    stride = context + 2
    for i, row in enumerate(rows):
        runner.req_to_token_pool.write(row, 0, slots[i * stride : i * stride + context + 1])
    read_bw = read_bytes_per_s or hbm_bandwidth()["read_bytes_per_s"]
    kv = worker.kv_pool
    kv_bytes_per_token = kv.num_layers * kv.num_kv_heads * kv.head_dim * 2 * kv.k_buffer[0].element_size()
    result: dict[str, Any] = {"context": context, "bs": bs, "read_bytes_per_s": read_bw}
    for topk in topks:
        n = bs * topk
        rows_t = torch.tensor(rows[:n], dtype=torch.int64, device=device)
        prefix = [context] * n
        pre_t = torch.full((n,), context, dtype=torch.int64, device=device)
        step_slots = torch.stack([slots[torch.arange(n, device=device) * stride + context - 1 + s] for s in range(2)])
        roots = torch.ones(n, dtype=torch.int64, device=device)
        hidden = torch.randn(n, worker.hidden_in_dim, dtype=runner.model_config.dtype, device=device)
        t1, t2 = (_time(partial(graphs.replay, roots, rows_t, prefix, pre_t, step_slots[:k], hidden), iters)
                  for k in (1, 2))
        first_floor = (_head_bytes(worker.head, True) + n * context * kv_bytes_per_token) / read_bw
        later_floor = (_head_bytes(worker.head, False) + n * (context + 1) * kv_bytes_per_token) / read_bw
        result[f"topk{topk}"] = {
            "rows": n, "first_step_ms": t1 * 1e3, "later_step_ms": (t2 - t1) * 1e3,
            "first_step_floor_ms": first_floor * 1e3, "later_step_floor_ms": later_floor * 1e3,
            "first_step_over_floor": t1 / first_floor, "later_step_over_floor": (t2 - t1) / later_floor}
        if device == "cuda" and topk == 1:
            # The first step's time includes the replay's input staging (copies into the static
            # buffers, the split plan): its kernels, so the step and the staging can be told apart.
            result[f"topk{topk}"]["kernels_first_step"] = kernel_table(
                partial(graphs.replay, roots, rows_t, prefix, pre_t, step_slots[:1], hidden), top=30)
    release(engine)
    return result


def cmd_spec(args: argparse.Namespace) -> int:
    from plait.bench.results import write_result
    from plait.bench.shapes import SHAPES, write_shape_dir

    shape = args.shape
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(prefix="plait-shapes-"), shape))
    vocab = SHAPES[shape]["vocab_size"]
    config = {"dtype": "bfloat16", "load_format": "dummy", **NGRAM}
    if args.workload == "spec-ngram-repeat":
        r = spec_ngram_repeat(shape_dir, vocab, num_prompts=args.num_prompts, output_len=args.output_len)
        write_result(args.out, args.workload, shape, "speedup_over_accept_length_bs1",
                     r["bs1"]["speedup_over_accept_length"], None, None, 1.0, config, detail=r,
                     targets={"bs1": ">= 0.85", "bs16": ">= 0.65"})
    elif args.workload == "spec-ngram-miss":
        r = spec_ngram_miss(shape_dir, vocab, num_prompts=min(args.num_prompts, 16), output_len=args.output_len)
        write_result(args.out, args.workload, shape, "cost_over_plain", r["cost_over_plain"], None, None, 1.0,
                     config, detail=r, target="<= 1.1")
    else:
        r = spec_overhead(shape_dir)
        if not args.skip_eagle3:
            r["eagle3_draft"] = eagle3_draft_step(shape_dir)
        write_result(args.out, args.workload, shape, "verify_over_decode_bs1", r["bs1"]["verify_over_decode"],
                     None, None, 1.0, config, detail=r,
                     target="<= 1.10 (graph-replayed verify); EAGLE3 draft step <= 1.5x its byte floor")
    print(r)
    return 0


def add_spec_parser(bench_sub: Any) -> None:
    from plait.bench.shapes import SHAPES

    p = bench_sub.add_parser("spec", help="speculative decoding: spec-overhead / spec-ngram-repeat / spec-ngram-miss")
    p.add_argument("--workload", choices=["spec-overhead", "spec-ngram-repeat", "spec-ngram-miss"],
                   default="spec-ngram-repeat")
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama-3.1-8b")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--num-prompts", type=int, default=64, help="spec-ngram-repeat prompts (miss: at most 16)")
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--skip-eagle3", action="store_true", help="spec-overhead without the EAGLE3 draft step")
    p.set_defaults(func=cmd_spec)
