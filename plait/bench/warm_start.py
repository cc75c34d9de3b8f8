"""``plait bench warm-start``: what the first requests after an engine start cost (docs/benchmarks.md).

Each measurement is one fresh process (Triton keeps compiled kernels in memory, so a second engine in
the same process would start warm) with its own ``TRITON_CACHE_DIR``:

- ``cold``: an empty cache directory, so every kernel compiles in this process;
- ``disk``: a second process over the directory the cold one filled (compiles load from disk).

Each runs with the start-up warm-up off and on (``EngineConfig.warmup``), and measures:

- ``ready_s``: building the engine (weights, KV pool, CUDA graphs, the warm-up when on);
- TTFT shape: the first ``prompt_len``-token prompt's time to its first token, then a second, fresh
  prompt of the same length (``ttft_first_over_second``; the issue's bar is 1.5x, stretch 1.1x);
- offline shape: the first offline run (``num_requests`` x ``input_len`` / ``output_len``) against a
  second with fresh prompts (``offline_first_over_second``, output tok/s; bar 0.97).

One JSON per shape (workload ``warm-start``): the headline is the warm-up-on ratio of the cold start,
and the same ratio with the warm-up off is the peer.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter
from typing import Any

RESULT_MARK = "WARM_START_RESULT "
STARTS = ("cold", "disk")
WARMUP_MODES = ("off", "on")


class TritonCompiles:
    """Kernel variants Triton compiled (or loaded from its disk cache) in this process while the
    block ran: ``names`` counts them by kernel, ``variants`` lists each one's description (name, launch
    options and argument types with their specialisations, such as 16-divisibility). Through
    ``triton.knobs.runtime.jit_post_compile_hook``, which Triton calls after each variant it adds to its
    in-memory cache (none under the interpreter)."""

    def __init__(self) -> None:
        self.names: Counter[str] = Counter()
        self.variants: list[str] = []
        self._previous: Any = None

    def __enter__(self) -> TritonCompiles:
        from triton import knobs

        self._previous = knobs.runtime.jit_post_compile_hook

        def hook(*, fn: Any, compile: dict[str, Any], **_: Any) -> bool:
            self.names[fn.name] += 1
            self.variants.append(describe_variant(fn.name, compile["signature"], compile["constants"],
                                                  compile["configs"][0]))
            return False

        knobs.runtime.jit_post_compile_hook = hook
        return self

    def __exit__(self, *exc: object) -> None:
        from triton import knobs

        knobs.runtime.jit_post_compile_hook = self._previous

    @property
    def total(self) -> int:
        return sum(self.names.values())


def describe_variant(name: str, signature: dict[str, Any], constants: dict[tuple[int, ...], Any],
                     attrs: dict[tuple[int, ...], Any]) -> str:
    """One compiled variant as ``name(arg: type, ...)``: a parameter Triton fixed at compile time (a
    constexpr, or an int specialised to 1) shows as ``arg=value``, one it assumed 16-divisible (an int, or
    a pointer's alignment) carries ``%16``. Triton's own description of a variant does not list these in
    3.6. ``signature`` maps parameter names to types in order; ``constants`` and ``attrs`` are keyed by
    parameter paths (index tuples), as Triton hands them to its compile hooks."""
    parts = []
    for i, (arg, ty) in enumerate(signature.items()):
        if (i,) in constants:
            parts.append(f"{arg}={constants[(i,)]}")
        else:
            divisible = any(attr[0] == "tt.divisibility" for attr in attrs.get((i,), ()))
            parts.append(f"{arg}: {ty}{' %16' if divisible else ''}")
    return f"{name}({', '.join(parts)})"


def _compiles(stage: str, compiles: TritonCompiles, out: dict[str, Any]) -> None:
    out.setdefault("triton_compiles", {})[stage] = {"total": compiles.total, "by_kernel": dict(compiles.names),
                                                    "variants": compiles.variants}


def measure(shape_dir: str, vocab: int, warmup: str, ttft_prompt_len: int | None, num_requests: int,
            input_len: int, output_len: int, **options: Any) -> dict[str, Any]:
    """One start of an engine and its first workload, in this process. ``ttft_prompt_len`` None:
    no TTFT prompts; ``num_requests`` 0: no offline runs."""
    from plait.bench.workloads import make_engine, random_prompts, release, timed

    t0 = time.perf_counter()
    with TritonCompiles() as at_start:
        engine = make_engine(shape_dir, warmup=warmup, **options)
    out: dict[str, Any] = {"ready_s": time.perf_counter() - t0, "warmup": warmup,
                           "triton_cache_dir": os.environ.get("TRITON_CACHE_DIR")}
    _compiles("start", at_start, out)
    report = engine.core.warmup
    if report is not None:
        out["warmup_s"] = report.seconds
        out["warmup_requests"] = report.requests
        out["warmup_phases"] = report.phases
    greedy = {"temperature": 0.0, "ignore_eos": True}
    if ttft_prompt_len:
        one_token = {**greedy, "max_new_tokens": 1}
        for stage, prompt in zip(("ttft_first", "ttft_second"), random_prompts(2, ttft_prompt_len, vocab, seed=11),
                                 strict=True):
            with TritonCompiles() as compiles:
                _, out[stage + "_s"] = timed(lambda prompt=prompt: engine.generate(prompt, one_token))
            _compiles(stage, compiles, out)
        out["ttft_first_over_second"] = out["ttft_first_s"] / out["ttft_second_s"]
    if num_requests:
        params = {**greedy, "max_new_tokens": output_len}
        rates = []
        # Fresh prompts each run: the second is not served from the radix cache.
        for stage, seed in (("offline_first", 21), ("offline_second", 22)):
            prompts = random_prompts(num_requests, input_len, vocab, seed=seed)
            with TritonCompiles() as compiles:
                outs, seconds = timed(lambda prompts=prompts: engine.generate(prompts, params))
            _compiles(stage, compiles, out)
            rates.append(sum(len(o.token_ids) for o in outs) / seconds)
        out["offline_first_tok_s"], out["offline_second_tok_s"] = rates
        out["offline_first_over_second"] = rates[0] / rates[1]
    release(engine)
    return out


def measure_in_subprocess(spec: dict[str, Any], triton_cache_dir: str, timeout_s: float) -> dict[str, Any]:
    """``measure(**spec)`` in a fresh Python process over ``triton_cache_dir``; its wall time from
    spawn to result is ``process_s``."""
    env = {**os.environ, "TRITON_CACHE_DIR": triton_cache_dir}
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "plait.bench.warm_start", json.dumps(spec)], env=env,
                          capture_output=True, text=True, timeout=timeout_s)
    for line in proc.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return {**json.loads(line[len(RESULT_MARK):]), "process_s": time.perf_counter() - t0}
    raise RuntimeError(f"warm-start measurement failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")


def warm_start_runs(spec: dict[str, Any], starts: tuple[str, ...] = STARTS, timeout_s: float = 600.0
                    ) -> dict[str, dict[str, Any]]:
    """``"<start>-warmup-<off|on>"`` -> that process's measurement. Each warm-up mode gets its own
    cache directory: the ``disk`` start reuses what its ``cold`` start compiled."""
    runs: dict[str, dict[str, Any]] = {}
    for mode in WARMUP_MODES:
        cache = tempfile.mkdtemp(prefix=f"plait-triton-cache-{mode}-")
        for start in starts:
            key = f"{start}-warmup-{mode}"
            runs[key] = measure_in_subprocess({**spec, "warmup": mode}, cache, timeout_s)
            brief = {k: v for k, v in runs[key].items() if k not in ("warmup_phases", "triton_compiles")}
            brief["triton_compiles"] = {stage: c["total"] for stage, c in runs[key].get("triton_compiles", {}).items()}
            print(f"warm-start {key}: " + json.dumps(brief))
    return runs


def cmd_warm_start(args: argparse.Namespace) -> int:
    from plait.bench.results import write_result
    from plait.bench.shapes import SHAPES, write_shape_dir

    root = tempfile.mkdtemp(prefix="plait-shapes-")
    starts = ("cold",) if args.no_disk_start else STARTS
    jobs = [(shape, "ttft") for shape in args.ttft_shape] + [(shape, "offline") for shape in args.offline_shape]
    for shape, kind in jobs:
        shape_dir = str(write_shape_dir(root, shape))
        options: dict[str, Any] = {"context_length": args.context_length}
        if kind == "ttft":
            spec = {"ttft_prompt_len": args.prompt_len, "num_requests": 0}
        else:
            spec = {"ttft_prompt_len": None, "num_requests": args.num_requests}
            options["max_running_requests"] = args.num_requests
        spec.update(shape_dir=shape_dir, vocab=SHAPES[shape]["vocab_size"], input_len=args.input_len,
                    output_len=args.output_len, **options)
        runs = warm_start_runs(spec, starts, args.timeout)
        metric = "ttft_first_over_second" if kind == "ttft" else "offline_first_over_second"
        on, off = runs["cold-warmup-on"], runs["cold-warmup-off"]
        write_result(
            args.out, "warm-start", shape, metric, on[metric], "plait, warm-up off", off[metric], None,
            {"load_format": "dummy", "starts": list(starts), **options,
             **({"prompt_len": args.prompt_len} if kind == "ttft" else
                {"requests": args.num_requests, "input_len": args.input_len, "output_len": args.output_len})},
            tag=kind, runs=runs,
            ready_s={key: r["ready_s"] for key, r in runs.items()},
            ready_cost_of_warmup_s={s: runs[f"{s}-warmup-on"]["ready_s"] - runs[f"{s}-warmup-off"]["ready_s"]
                                    for s in starts},
            definition=("cold start, warm-up on: first TTFT / second TTFT (fresh prompt, same length); the peer "
                        "is the same with the warm-up off" if kind == "ttft" else
                        "cold start, warm-up on: first offline run's output tok/s / a second run's with fresh "
                        "prompts; the peer is the same with the warm-up off"))
    return 0


def add_warm_start_parser(bench_sub: Any) -> None:
    from plait.bench.shapes import SHAPES

    p = bench_sub.add_parser("warm-start", help="warm-start: first requests after a cold / disk-warm start, "
                             "warm-up off and on")
    p.add_argument("--ttft-shape", nargs="*", default=["llama-3.1-8b"], choices=sorted(SHAPES),
                   help="shapes measured by the first long prompt's TTFT (each: its own processes)")
    p.add_argument("--offline-shape", nargs="*", default=["llama-3.2-1b"], choices=sorted(SHAPES),
                   help="shapes measured by the first offline run (each: its own processes)")
    p.add_argument("--prompt-len", type=int, default=8192, help="TTFT prompt tokens")
    p.add_argument("--num-requests", type=int, default=256, help="offline requests per run")
    p.add_argument("--input-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--context-length", type=int, default=16384)
    p.add_argument("--no-disk-start", action="store_true", help="only the cold starts (no second start over "
                   "the filled Triton cache)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds one measurement process may take")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=cmd_warm_start)


if __name__ == "__main__":
    result = measure(**json.loads(sys.argv[1]))
    print(RESULT_MARK + json.dumps(result), flush=True)
