"""Command line: ``plait generate | serve | bench | node``.

Engine flags mirror EngineConfig fields (``--max-total-tokens`` -> ``max_total_tokens``); sampling
flags mirror SamplingParams fields. Without ``--model`` the built-in demo model is used.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import types
import typing
from collections.abc import Sequence
from typing import Any

from plait.cli_aliases import (
    ALIASED_FIELDS,
    PlaitArgumentParser,
    add_engine_alias_flags,
    add_unused_flags,
    unused_flag_warnings,
    vllm_speculative_options,
)
from plait.config import (
    ATTENTION_BACKENDS,
    DEVICES,
    KV_CACHE_DTYPES,
    MOE_A2A_BACKENDS,
    QUANTIZATIONS,
    SAMPLING_DEFAULTS,
    SCHEDULE_POLICIES,
    WARMUP_MODES,
    EngineConfig,
)
from plait.sampling import SamplingParams

logger = logging.getLogger("plait")


def _flag_type(tp: Any) -> Any:
    """argparse type for a dataclass field annotation (``int | None`` -> int, ``bool`` -> flag)."""
    if isinstance(tp, str):
        tp = eval(tp, {"typing": typing, "Literal": typing.Literal})  # annotations are strings (PEP 563)
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _flag_type(args[0])
    if origin is typing.Literal:
        return str
    if origin is tuple:
        return "list"
    return tp


# Flags with a closed set of values: argparse lists them in --help and rejects others before start-up.
FLAG_CHOICES: dict[str, tuple[str, ...]] = {name: ATTENTION_BACKENDS for name in (
    "attention_backend", "prefill_attention_backend", "decode_attention_backend",
    "speculative_draft_attention_backend")} | {"quantization": QUANTIZATIONS, "kv_cache_dtype": KV_CACHE_DTYPES}
FLAG_CHOICES["sampling_defaults"] = SAMPLING_DEFAULTS
FLAG_CHOICES["warmup"] = WARMUP_MODES
FLAG_CHOICES["moe_a2a_backend"] = MOE_A2A_BACKENDS
FLAG_CHOICES["schedule_policy"] = SCHEDULE_POLICIES
FLAG_CHOICES["device"] = DEVICES


def add_dataclass_flags(parser: argparse.ArgumentParser, cls: type, skip: Sequence[str] = ()) -> None:
    group = parser.add_argument_group(cls.__name__)
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        flag = "--" + f.name.replace("_", "-")
        tp = _flag_type(f.type)
        if tp is bool:
            group.add_argument(flag, action="store_true", default=None, help=f"{cls.__name__}.{f.name}")
        elif tp == "list":
            group.add_argument(flag, nargs="+", default=None, help=f"{cls.__name__}.{f.name}")
        else:
            group.add_argument(flag, type=tp, default=None, choices=FLAG_CHOICES.get(f.name),
                               help=f"{cls.__name__}.{f.name}")


def collect(args: argparse.Namespace, cls: type, skip: Sequence[str] = ()) -> dict[str, Any]:
    """The dataclass fields the user set on the command line."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.name in skip:
            continue
        value = getattr(args, f.name, None)
        if value is not None:
            out[f.name] = value
    return out


def _engine_parser(parser: argparse.ArgumentParser) -> None:
    # --model and the fields with SGLang / vLLM spellings (plait.cli_aliases); the rest come from the
    # dataclass. EngineConfig.seed is --random-seed: --seed is the per-request sampling seed.
    add_engine_alias_flags(parser)
    add_unused_flags(parser)
    add_dataclass_flags(parser, EngineConfig, skip=ENGINE_SKIP + ALIASED_FIELDS)
    parser.add_argument("--random-seed", type=int, default=None, help="EngineConfig.seed (dummy weights, "
                        "seeds of unseeded requests)")


ENGINE_SKIP = ("model", "seed")


def engine_options(args: argparse.Namespace) -> dict[str, Any]:
    options = collect(args, EngineConfig, skip=ENGINE_SKIP)
    if args.random_seed is not None:
        options["seed"] = args.random_seed
    if args.enable_expert_parallel and "ep_size" not in options:
        options["ep_size"] = options.get("tp_size", 1)
    if args.speculative_config is not None:
        vllm = vllm_speculative_options(args.speculative_config)
        both = sorted(k for k in vllm if k in options)
        if both:
            raise ValueError(f"--speculative-config and --{both[0].replace('_', '-')} both set it: give one")
        options |= vllm
    return options


def cmd_generate(args: argparse.Namespace) -> int:
    from plait.engine import Engine

    options = engine_options(args)
    params = collect(args, SamplingParams)
    model = args.model
    if model is None:
        from plait.models.demo import demo_model

        demo = demo_model()
        model = str(demo.path)
        print(f"plait: no --model given; using the built-in demo model, {demo.description}", file=sys.stderr)
    with Engine(model=model, **options) as engine:
        if args.stream:
            for chunk in engine.generate_stream(args.prompt, params):
                print(chunk.delta_text, end="", flush=True)
            print()
            return 0
        out = engine.generate(args.prompt, params)
        if args.json:
            print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                              "meta_info": out.meta_info}))
        else:
            print(out.text)
            print(f"[{out.finish_reason}; {out.meta_info['prompt_tokens']} prompt tokens, "
                  f"{out.meta_info['completion_tokens']} generated]", file=sys.stderr)
    return 0


def cmd_node(args: argparse.Namespace) -> int:
    """Ranks of a node other than node 0 (spawned here), or one rank under torchrun, whose rank 0 runs
    ``plait generate`` with the same flags."""
    from plait.parallel.launch import launched_by_torchrun, run_node_ranks, run_torchrun_rank

    config = EngineConfig.from_kwargs(model=args.model, **engine_options(args))
    if not launched_by_torchrun():
        return run_node_ranks(config)
    if int(os.environ["RANK"]) == 0:
        return cmd_generate(args)
    run_torchrun_rank(config)
    return 0


def cmd_scheduler_process(args: argparse.Namespace) -> int:
    from plait.engine.scheduler_process import run

    config = EngineConfig.from_kwargs(**json.loads(args.config_json))
    return run(config, args.requests_addr, args.outputs_addr, args.max_queued_requests)  # one address per HTTP process


def _generate_flags(parser: argparse.ArgumentParser, prompt_required: bool) -> None:
    _engine_parser(parser)
    parser.add_argument("--prompt", required=prompt_required, default="")
    parser.add_argument("--stream", action="store_true", help="print text as it is generated")
    parser.add_argument("--json", action="store_true", help="print the whole output as JSON")
    add_dataclass_flags(parser, SamplingParams)


def build_parser() -> argparse.ArgumentParser:
    parser = PlaitArgumentParser(prog="plait", description="plait: a compact LLM serving engine")
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="generate text for one prompt")
    _generate_flags(gen, prompt_required=True)
    gen.set_defaults(func=cmd_generate)
    node = sub.add_parser("node", help="the tensor-parallel ranks of a node other than node 0 (--nnodes, "
                          "--node-rank, --dist-init-addr), or one rank under torchrun (rank 0 runs generate)")
    _generate_flags(node, prompt_required=False)
    node.set_defaults(func=cmd_node)
    # Started by `plait serve` (plait.server.scheduler_client), not by hand.
    sched = sub.add_parser("scheduler-process")
    sched.add_argument("--config-json", required=True, help="EngineConfig fields as a JSON object")
    sched.add_argument("--requests-addr", required=True, nargs="+")
    sched.add_argument("--outputs-addr", required=True, nargs="+")
    sched.add_argument("--max-queued-requests", type=int, default=None)
    sched.set_defaults(func=cmd_scheduler_process)
    bench = sub.add_parser("bench", help="benchmarks (the named workloads of docs/benchmarks.md)")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from plait.bench.cli import add_bench_parsers

    add_bench_parsers(bench_sub)

    # `plait serve` and `plait bench serve` live in plait.server; their flags come from a module
    # that imports only argparse, so `plait generate` does not need the server extra.
    from plait.server.flags import add_bench_serve_flags, add_server_flags

    def run_serve(args: argparse.Namespace) -> int:
        from plait.server.launch import cmd_serve

        return cmd_serve(args, engine_options(args))

    def run_bench_serve(args: argparse.Namespace) -> int:
        from plait.server.bench import cmd_bench_serve

        return cmd_bench_serve(args, engine_options(args))

    serve = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_parser(serve)
    add_server_flags(serve)
    # A server logs its startup, readiness and shutdown (and the demo-model notice) by default.
    serve.set_defaults(func=run_serve, log_level="info")
    bserve = bench_sub.add_parser(
        "serve", help="serving: load-test an OpenAI-compatible server (Poisson arrivals or fixed concurrency); "
        "without --base-url it starts `plait serve` with the engine flags given here")
    _engine_parser(bserve)
    add_bench_serve_flags(bserve)
    bserve.set_defaults(func=run_bench_serve)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    level = getattr(args, "log_level", None) or "warning"
    logging.basicConfig(level=level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    for warning in unused_flag_warnings(args):
        logger.warning(warning)
    try:
        return int(args.func(args))
    except ValueError as e:
        print(f"plait: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
