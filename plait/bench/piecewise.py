"""``plait bench prefill-ttft``: time to first token of short prompts, piecewise graphs off and on.

A short prefill is launch- and host-bound: every layer's norms, projections, rotary, MLP and
residual adds are separate launches, which the piecewise graphs replace by one replay per segment
(docs/architecture.md, "Piecewise graphs"). Each prompt length runs ``--reps`` times, one request
at a time, with fresh prompts and the radix cache off (every token is prefilled), in two engines of
one process: ``enable_piecewise_cuda_graph`` off (the peer) and on. The headline is prompts per
second at the geometric mean of the per-length median TTFTs; ``ratio_vs_peer`` is the speedup.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
from typing import Any

from plait.bench.results import write_result
from plait.bench.shapes import SHAPES, write_shape_dir
from plait.bench.workloads import make_engine, piecewise_stats, random_prompts, release, timed

DEFAULT_LENGTHS = (16, 64, 256, 1024, 2048)


def median_ttft_ms(shape_dir: str, lengths: list[int], reps: int, vocab: int, **options: Any
                   ) -> tuple[dict[int, float], dict[int, int]]:
    """Median time (ms) of ``engine.generate`` of one prompt and one new token, per prompt length; and
    the piecewise replays per bucket over the whole run (empty: no piecewise graphs ran)."""
    engine = make_engine(shape_dir, disable_radix_cache=True, max_running_requests=4, **options)
    params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 1}
    out: dict[int, float] = {}
    try:
        for length in lengths:
            for p in random_prompts(2, length, vocab, seed=length):  # warm-up: compiles, first replays
                engine.generate([p], params)
            times = [timed(lambda p=p: engine.generate([p], params))[1]
                     for p in random_prompts(reps, length, vocab, seed=10_000 + length)]
            out[length] = 1e3 * statistics.median(times)
        replays = piecewise_stats(engine).get("piecewise_replays", {})
    finally:
        release(engine)
    return out, replays


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values))


def cmd_prefill_ttft(args: argparse.Namespace) -> int:
    lengths = sorted(set(args.lengths))
    if not lengths or lengths[0] < 1:
        raise ValueError(f"--lengths must be >= 1 token each, got {args.lengths}")
    if args.reps < 1:
        raise ValueError(f"--reps must be >= 1, got {args.reps}")
    max_tokens = args.piecewise_cuda_graph_max_tokens or max(lengths)
    root = tempfile.mkdtemp(prefix="plait-shapes-")
    # Both engines take the same chunk size, so a prompt is one extend step in either.
    common = {"chunked_prefill_size": max(max(lengths), max_tokens)}
    for shape in args.shape:
        shape_dir = str(write_shape_dir(root, shape))
        vocab = SHAPES[shape]["vocab_size"]
        off, _ = median_ttft_ms(shape_dir, lengths, args.reps, vocab, **common)
        on, replays = median_ttft_ms(shape_dir, lengths, args.reps, vocab, enable_piecewise_cuda_graph=True,
                                     piecewise_cuda_graph_max_tokens=max_tokens, **common)
        on_rate = 1e3 / _geomean(list(on.values()))
        off_rate = 1e3 / _geomean(list(off.values()))
        write_result(
            args.out, "prefill-ttft", shape, "prompts_per_s_at_geomean_ttft", on_rate, "plait, piecewise graphs off",
            off_rate, None, {"load_format": "dummy", "lengths": lengths, "reps": args.reps,
                             "piecewise_cuda_graph_max_tokens": max_tokens, **common},
            ttft_ms_piecewise=on, ttft_ms_eager=off, piecewise_replays_by_bucket=replays,
            speedup_by_length={n: off[n] / on[n] for n in lengths})
    return 0


def add_prefill_ttft_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("prefill-ttft", help="short prompts' TTFT with piecewise graphs off and on")
    p.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=["llama-3.2-1b"])
    p.add_argument("--lengths", type=int, nargs="+", default=list(DEFAULT_LENGTHS))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                   help="default: the longest of --lengths")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=cmd_prefill_ttft)
