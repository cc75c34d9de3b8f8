"""``plait bench structured``: the ``structured-overhead`` workload (docs/benchmarks.md).

Decode tokens/s of the same requests with a JSON-schema constraint and without, at bs 1 and bs 64,
on the llama-3.1-8b shape (dummy weights) with ``vocab_size`` 49152 and the real model's tokenizer
(SmolLM2's, 49152 tokens): the mask cost depends on a real vocabulary, so the shape's own
(a tiny test tokenizer) would not do. Also the compile time of the 30 schemas of
``plait.testing.grammars`` (median and max, cache misses, same tokenizer).

Both runs sample at temperature 1 with per-request seeds and ignore_eos, so random weights walk
through the grammar's states; the timed window is steady decode (every request running). The schema
is an array of at least 1000 records, so no request completes it during the window (the JSON reports
how many did: past its end a row is unconstrained).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random
import shutil
import statistics
import tempfile
import time
from typing import Any

from plait.bench.results import write_result
from plait.bench.shapes import SHAPES
from plait.bench.workloads import make_engine, release, timed

SHAPE = "llama-3.1-8b"
VOCAB = 49152
BATCH_SIZES = (1, 64)
PROMPT_LEN = 128
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt")
# At least 1000 records: no request can complete the array in the timed window, so every row stays
# constrained. Bounded strings keep random weights moving through keys, strings, numbers, booleans.
BENCH_SCHEMA: dict[str, Any] = {
    "type": "array", "minItems": 1000,
    "items": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 12}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "tags": {"type": "array", "maxItems": 3, "items": {"type": "string", "maxLength": 8}},
        "active": {"type": "boolean"}, "score": {"type": "number", "minimum": 0, "maximum": 100}},
        "required": ["name", "age", "active"], "additionalProperties": False},
}


# Where the tests cache SmolLM2-135M-Instruct (plait.testing.real_model); a copy of its tokenizer
# files anywhere else works as well (--tokenizer).
DEFAULT_TOKENIZER_DIR = "~/.cache/plait/smollm2-135m-instruct-hf"


def write_structured_shape_dir(root: str | pathlib.Path, tokenizer_dir: str | pathlib.Path,
                               shape: str = SHAPE, vocab_size: int = VOCAB) -> pathlib.Path:
    """``shape``'s config with ``vocab_size`` replaced, and the tokenizer files of ``tokenizer_dir``."""
    tok = pathlib.Path(tokenizer_dir).expanduser()
    if not (tok / "tokenizer.json").exists() and not (tok / "tokenizer_config.json").exists():
        raise ValueError(f"--tokenizer {tok}: no tokenizer files there (tokenizer.json / tokenizer_config.json); "
                         "pass the directory of SmolLM2-135M-Instruct's tokenizer")
    path = pathlib.Path(root) / f"{shape}-vocab{vocab_size}"
    path.mkdir(parents=True, exist_ok=True)
    config = {**SHAPES[shape], "vocab_size": vocab_size}
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(tok)
    config["bos_token_id"], config["eos_token_id"] = t.bos_token_id, t.eos_token_id
    (path / "config.json").write_text(json.dumps(config, indent=1))
    for name in TOKENIZER_FILES:
        if (tok / name).exists():
            shutil.copy(tok / name, path / name)
    return path


def decode_tok_s(engine: Any, bs: int, params: dict[str, Any], steps: int, seed: int = 7) -> dict[str, Any]:
    """Steady decode of ``bs`` requests: tokens/s over ``steps`` scheduler steps once all run."""
    sched = engine.scheduler
    rng = random.Random(seed)
    known = min(engine.model_config.vocab_size, len(engine.tokenizer))  # prompt ids the tokenizer has
    prompts = [[rng.randrange(known // 8, known) for _ in range(PROMPT_LEN)] for _ in range(bs)]
    reqs = [engine.make_request(p, {**params, "seed": seed + i, "max_new_tokens": steps + 64})
            for i, p in enumerate(prompts)]
    for r in reqs:
        sched.add_request(r)
    while len(sched.running) < bs or sched.prefilling or sched.waiting:
        sched.step()
    for _ in range(5):
        sched.step()
    # num_generated counts tokens still on the device too (overlap keeps one step in flight).
    before = sum(r.num_generated for r in reqs)
    _, seconds = timed(lambda: [sched.step() for _ in range(steps)])
    generated = sum(r.num_generated for r in reqs) - before
    sched.flush()
    completed = sum(1 for r in reqs if r.grammar is not None and r.grammar.is_terminated())
    for r in reqs:
        sched.abort(r.rid)
    while sched.has_work():
        sched.step()
    return {"tok_s": generated / seconds, "ms_per_step": 1e3 * seconds / steps, "steps": steps,
            "generated_tokens": generated, "grammar_completed_requests": completed}


def compile_times(tokenizer_dir: str | pathlib.Path, vocab_size: int = VOCAB) -> dict[str, Any]:
    """Seconds to compile each of the 30 corpus schemas (fresh backend: every compile a miss)."""
    from transformers import AutoTokenizer

    from plait.bench.grammars import JSON_SCHEMAS
    from plait.sampling.grammar import GrammarBackend

    tok = AutoTokenizer.from_pretrained(pathlib.Path(tokenizer_dir).expanduser())
    backend = GrammarBackend(tok, vocab_size, [tok.eos_token_id])
    backend.compile(("regex", "x"))  # builds the tokenizer info (not a schema's cost)
    times = {}
    for name, schema in JSON_SCHEMAS:
        t0 = time.perf_counter()
        backend.compile(("json_schema", json.dumps(schema)))
        times[name] = time.perf_counter() - t0
    backend.close()
    values = sorted(times.values())
    return {"median_s": statistics.median(values), "max_s": values[-1], "max_schema": max(times, key=times.__getitem__),
            "per_schema_s": times}


def structured_overhead(shape_dir: str, batch_sizes: tuple[int, ...] = BATCH_SIZES, steps: int = 100,
                        **options: Any) -> dict[str, Any]:
    """Constrained and unconstrained decode tok/s per batch size, in one engine (graphs shared)."""
    bs_max = max(batch_sizes)
    engine = make_engine(shape_dir, max_running_requests=bs_max, disable_radix_cache=True, **options)
    base = {"temperature": 1.0, "ignore_eos": True}
    constrained = {**base, "json_schema": BENCH_SCHEMA}
    out: dict[str, Any] = {"cuda_graph": engine.runner.graph_runner is not None,
                           "attention_backend": engine.runner.attn_backend.name}
    warm = min(8, steps)
    decode_tok_s(engine, bs_max, base, warm)  # warm-up: kernels, graphs, the grammar compile
    decode_tok_s(engine, bs_max, constrained, warm)
    for bs in batch_sizes:
        plain = decode_tok_s(engine, bs, base, steps)
        masked = decode_tok_s(engine, bs, constrained, steps)
        out[f"bs{bs}"] = {"unconstrained": plain, "json_schema": masked,
                          "cost_ratio": plain["tok_s"] / masked["tok_s"]}
    release(engine)
    return out


def cmd_structured(args: argparse.Namespace) -> int:
    root = tempfile.mkdtemp(prefix="plait-structured-")
    shape_dir = write_structured_shape_dir(root, args.tokenizer, args.shape, VOCAB)
    compiles = compile_times(args.tokenizer)
    result = structured_overhead(str(shape_dir), tuple(args.batch_sizes), args.steps)
    largest = f"bs{max(args.batch_sizes)}"
    write_result(
        args.out, "structured-overhead", args.shape, "decode_cost_ratio_bs64", result[largest]["cost_ratio"],
        None, None, None,
        {"dtype": "bfloat16", "load_format": "dummy", "vocab_size": VOCAB, "batch_sizes": list(args.batch_sizes),
         "steps": args.steps, "temperature": 1.0, "ignore_eos": True},
        tokenizer="SmolLM2-135M-Instruct (49152 tokens): the real model's vocabulary, so the mask cost is that "
                  "of a real tokenizer; weights are dummy",
        schema=BENCH_SCHEMA, targets={"bs64_cost_ratio_at_most": 1.10, "bs1_cost_ratio_at_most": 1.05},
        metric_definition="unconstrained decode tok/s / JSON-schema-constrained decode tok/s (1.0 = free)",
        grammar_compile=compiles, **result)
    return 0


def add_structured_parser(bench_sub: Any) -> None:
    p = bench_sub.add_parser("structured", help="structured-overhead: JSON-schema constrained vs unconstrained decode")
    p.add_argument("--shape", choices=sorted(SHAPES), default=SHAPE)
    p.add_argument("--tokenizer", default=DEFAULT_TOKENIZER_DIR,
                   help="directory with SmolLM2-135M-Instruct's tokenizer files (default: the test cache)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=list(BATCH_SIZES))
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=cmd_structured)
