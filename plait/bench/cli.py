"""``plait bench latency | offline``: run a named workload on plait and its peer, write the JSON."""

from __future__ import annotations

import argparse
import tempfile
import traceback
from typing import Any

from plait.bench import peer_hf
from plait.bench.hardware import bench_dtype, bf16_matmul_rate, hbm_bandwidth
from plait.bench.results import write_result
from plait.bench.shapes import SHAPES, expected_distinct_experts, is_moe, param_counts, write_shape_dir
from plait.bench.workloads import (
    TIMED_REPEATS,
    Limits,
    decode_step_bytes,
    nano_vllm_requests,
    overlap_step_vs_replay,
    plait_decode_bs1,
    plait_prefill,
    plait_throughput,
    prefill_flops,
    random_prompts,
    throughput_floor_seconds,
)
from plait.config import ATTENTION_BACKENDS


def fp8_step_weight_bytes(shape: str, distinct_experts: float | None) -> float:
    """The weights a ``--quantization fp8`` decode step reads (plait.bench.quant)."""
    from plait.bench.quant import fp8_weight_bytes, moe_fp8_weight_bytes

    if not is_moe(shape):
        return fp8_weight_bytes(shape)
    return moe_fp8_weight_bytes(shape, distinct_experts if distinct_experts is not None
                                else expected_distinct_experts(shape, 1))


def measure_limits() -> Limits:
    bw = hbm_bandwidth()
    lim = Limits(copy_bw=bw["copy_bytes_per_s"], read_bw=bw["read_bytes_per_s"], matmul_rate=bf16_matmul_rate())
    print(f"measured: copy {lim.copy_bw / 1e12:.2f} TB/s, read {lim.read_bw / 1e12:.2f} TB/s, "
          f"bf16 matmul {lim.matmul_rate / 1e12:.0f} TFLOP/s")
    return lim


def _limits_detail(lim: Limits) -> dict[str, float]:
    return {"copy_bandwidth_tb_s": lim.copy_bw / 1e12, "read_bandwidth_tb_s": lim.read_bw / 1e12,
            "bf16_matmul_tflop_s": lim.matmul_rate / 1e12}


def _peer(fn: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
    try:
        return fn(*args, **kwargs)
    except Exception as e:  # the peer failing must not lose plait's figures
        traceback.print_exc()
        return {"error": f"{type(e).__name__}: {e}"}


BACKEND_FLAGS = ("attention_backend", "prefill_attention_backend", "decode_attention_backend")
PIECEWISE_FLAGS = ("enable_piecewise_cuda_graph", "piecewise_cuda_graph_max_tokens")


def add_backend_flags(parser: argparse.ArgumentParser) -> None:
    """The engine's three attention-backend flags and the piecewise-graph flags, passed through to
    every plait engine of the run."""
    for name in BACKEND_FLAGS:
        parser.add_argument("--" + name.replace("_", "-"), choices=ATTENTION_BACKENDS, default=None,
                            help=f"EngineConfig.{name} for the plait engines of this run")
    parser.add_argument("--enable-piecewise-cuda-graph", action="store_true",
                        help="EngineConfig.enable_piecewise_cuda_graph for the plait engines of this run")
    parser.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=None,
                        help="EngineConfig.piecewise_cuda_graph_max_tokens (with --enable-piecewise-cuda-graph)")


def backend_options(args: argparse.Namespace) -> dict[str, Any]:
    """The backend flags that were set, plus ``disable_cuda_graph`` when the decode half is torch_flash
    (its decode is not graph-safe: plait.attention.torch_flash)."""
    options = {name: getattr(args, name) for name in BACKEND_FLAGS if getattr(args, name, None)}
    for name in PIECEWISE_FLAGS:
        if getattr(args, name, None):
            options[name] = getattr(args, name)
    decode = options.get("decode_attention_backend") or options.get("attention_backend")
    if decode == "torch_flash":
        options["disable_cuda_graph"] = True
    return options


def backend_tag(options: dict[str, Any]) -> str | None:
    """File-name tag of a run with explicit backends: ``attn-<prefill>-<decode>`` (one name when equal)."""
    piecewise = "piecewise" if options.get("enable_piecewise_cuda_graph") else None
    if not any(name in options for name in BACKEND_FLAGS):
        return piecewise
    base = options.get("attention_backend") or "auto"
    prefill = options.get("prefill_attention_backend") or base
    decode = options.get("decode_attention_backend") or base
    attn = "attn-" + (prefill if prefill == decode else f"{prefill}-{decode}")
    return f"{attn}-{piecewise}" if piecewise else attn


def cmd_latency(args: argparse.Namespace) -> int:
    lim = measure_limits()
    root = tempfile.mkdtemp(prefix="plait-shapes-")
    backends = backend_options(args)
    tag = backend_tag(backends)
    for shape in args.shape:
        shape_dir = str(write_shape_dir(root, shape))
        vocab = SHAPES[shape]["vocab_size"]
        prompt = random_prompts(1, 128, vocab, seed=0)[0]
        new = args.output_len
        if args.prefill_only:
            if args.prefill and shape == "llama-3.1-8b":
                _prefill_mfu(args, shape, shape_dir, vocab, lim, backends, tag)
            continue
        peers: dict[str, Any] = {}
        if not args.no_peer:
            peers["generate"] = _peer(peer_hf.decode_bs1, shape, prompt, new, compiled=False)
            if not args.no_compile_peer:
                peers["static_compile"] = _peer(peer_hf.decode_bs1, shape, prompt, new, compiled=True)
        # The headline (graph) run without the expert counter; the eager run of the same prompt counts.
        options = {**backends, **({"quantization": args.quantization} if args.quantization else {})}
        graph = plait_decode_bs1(shape, shape_dir, prompt, new, count_experts=False, **options)
        eager = plait_decode_bs1(shape, shape_dir, prompt, args.eager_output_len or new,
                                 **{**options, "disable_cuda_graph": True})
        contexts = [128 + new // 2]  # mean context over the decode
        # MoE: the distinct experts the decode steps routed to, counted in the run (the eager engine's).
        distinct = eager.get("distinct_experts_per_layer_step")
        bytes_step = decode_step_bytes(shape, contexts, distinct, weight_bytes=fp8_step_weight_bytes(
            shape, distinct) if args.quantization else None)
        moe_detail = {"distinct_experts_per_layer_step": distinct} if is_moe(shape) else {}
        floor = lim.copy_bw / bytes_step
        fastest = max((p.get("tok_s", 0.0) for p in peers.values()), default=0.0) or None
        peer_name = "transformers " + ("static cache + torch.compile(reduce-overhead)" if fastest and fastest ==
                                       peers.get("static_compile", {}).get("tok_s") else "generate")
        write_result(
            args.out, "decode-bs1", shape, "decode_tok_s", graph["tok_s"], peer_name if fastest else None, fastest,
            floor, {"dtype": bench_dtype(), "load_format": "dummy", "input_len": 128, "output_len": new,
                    "cuda_graph": graph["cuda_graph"], "overlap_schedule": True, **options},
            tag="-".join(t for t in (tag, args.quantization) if t) or None,
            ms_per_step=graph["ms_per_step"], eager=eager, graph=graph,
            graph_speedup_over_eager=graph["tok_s"] / eager["tok_s"], peers=peers,
            floor_definition="copy HBM bandwidth / (" + ("FP8 weights as stored (1 byte per parameter + fp32 "
                             "scales: per row for dense layers, per 128x128 block for experts; router and LM "
                             "head bf16)" if args.quantization else "bf16 matmul weights") + " + KV cache read at "
                             "the mean context) per step" + ("; MoE: dense weights + the distinct experts each "
                             "step routed to (counted in the run, per layer)" if moe_detail else ""), **moe_detail,
            floor_read_bandwidth_tok_s=lim.read_bw / bytes_step, bytes_per_step=bytes_step,
            kv_capacity_tokens=graph["kv_capacity_tokens"], **_limits_detail(lim))
        if args.prefill and shape == "llama-3.1-8b":
            _prefill_mfu(args, shape, shape_dir, vocab, lim, backends, tag)
    return 0


def _prefill_mfu(args: argparse.Namespace, shape: str, shape_dir: str, vocab: int, lim: Limits,
                 backends: dict[str, Any], tag: str | None) -> None:
    pre = plait_prefill(shape, shape_dir, 8, 2048, vocab, **backends)
    flops = prefill_flops(shape, [2048] * 8)
    mfu = flops / pre["seconds"] / lim.matmul_rate
    write_result(args.out, "prefill-8x2048", shape, "prefill_tok_s", pre["tokens_per_s"], None, None,
                 pre["tokens_per_s"] / mfu if mfu else None,
                 {"dtype": "bfloat16", "prompts": 8, "prompt_len": 2048, "chunked_prefill_size": 16384, **backends},
                 tag=tag, mfu=mfu, flops=flops, seconds=pre["seconds"], attention_backend=pre["attention_backend"],
                 floor_definition="FLOPs / measured bf16 matmul rate (MFU = fraction_of_floor)",
                 **_limits_detail(lim))


# transformers' generate_batch on a MoE shape at the real size runs for minutes over the whole
# offline workload, so by default its peer runs the first this many requests (``--peer-requests``).
MOE_PEER_REQUESTS = 16


def peer_request_count(requested: int | None, num_requests: int, shape: str) -> int:
    """How many of the workload's requests (its first) the transformers peer runs: ``requested``, or
    all of them, or ``MOE_PEER_REQUESTS`` for a MoE shape."""
    if requested is None:
        return min(num_requests, MOE_PEER_REQUESTS) if is_moe(shape) else num_requests
    if not 1 <= requested <= num_requests:
        raise ValueError(f"--peer-requests must be in [1, --num-requests={num_requests}], got {requested}")
    return requested


def cmd_offline(args: argparse.Namespace) -> int:
    if args.num_requests < 1:
        raise ValueError(f"--num-requests must be >= 1, got {args.num_requests}")
    if args.repeats < 1:
        raise ValueError(f"--repeats must be >= 1 timed pass, got {args.repeats}")
    shape = args.shape or ("llama-3.2-1b" if args.workload == "offline-throughput" else "qwen3-0.6b")
    peer_requests = peer_request_count(args.peer_requests, args.num_requests, shape)  # refused before any work
    lim = measure_limits()
    root = tempfile.mkdtemp(prefix="plait-shapes-")
    if args.workload == "offline-throughput":
        vocab = SHAPES[shape]["vocab_size"]
        prompts = random_prompts(args.num_requests, args.input_len, vocab, seed=0)
        out_lens = [args.output_len] * args.num_requests
        params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": args.output_len}] * args.num_requests
    else:
        vocab = SHAPES[shape]["vocab_size"]
        prompts, params = nano_vllm_requests(args.num_requests)
        out_lens = [p["max_new_tokens"] for p in params]
    shape_dir = str(write_shape_dir(root, shape))
    peer: dict[str, Any] = {}
    peer_name = "transformers generate_batch"
    options = {"max_running_requests": args.num_requests, **backend_options(args)}
    subset: dict[str, Any] = {}
    if args.peer:
        # The first N requests at their own lengths: the same per-request work, fewer requests.
        peer_lens = out_lens[:peer_requests]
        peer = _peer(peer_hf.generate_batch_throughput, shape, prompts[:peer_requests],
                     peer_lens[0] if len(set(peer_lens)) == 1 else peer_lens)
        subset = {"peer_requests": peer_requests, "peer_subset": peer_requests < args.num_requests}
        if peer_requests < args.num_requests:
            peer_name += f" (first {peer_requests} of {args.num_requests} requests)"
            subset["peer_note"] = (
                f"the peer ran the first {peer_requests} of the {args.num_requests} requests at the same per-request "
                "lengths; its output_tok_s is over those requests (fewer in flight than plait had), while plait's "
                "figure and the floor are over the whole workload")
    elif args.tbo_peer:  # what the split costs: the same engine with two-batch overlap off is the peer
        peer = plait_throughput(shape_dir, prompts, params, repeats=args.repeats, **options)
        peer_name = "plait, two-batch overlap off"
        options["enable_two_batch_overlap"] = True
    result = plait_throughput(shape_dir, prompts, params, count_experts=is_moe(shape), repeats=args.repeats,
                              **options)
    distinct = result.get("distinct_experts_by_tokens")
    floor_s = throughput_floor_seconds(shape, [len(p) for p in prompts], out_lens, lim, distinct_by_tokens=distinct)
    floor = sum(out_lens) / floor_s
    details: dict[str, Any] = {}
    if args.workload == "offline-throughput" and args.overlap_check:
        details["overlap"] = overlap_step_vs_replay(shape_dir, 256, vocab)
    flops = prefill_flops(shape, [len(p) for p in prompts])
    write_result(
        args.out, args.workload, shape, "output_tok_s", result["output_tok_s"],
        peer_name if peer.get("output_tok_s") else None, peer.get("output_tok_s"), floor,
        {"dtype": bench_dtype(), "load_format": "dummy", **options, "requests": args.num_requests,
         "input_len": args.input_len, "output_len": args.output_len},
        tag="tbo" if args.tbo_peer else backend_tag(options), detail=result, peer_detail=peer, floor_seconds=floor_s,
        floor_definition="sum over steps of max(FLOPs / bf16 matmul rate, bytes / copy bandwidth): prefill "
                         "compute-bound, then one decode step per position over the running requests"
                         + ("; MoE: decode bytes from the distinct experts the run's steps routed to (counted, "
                            "per layer call size), prefill FLOPs from the active parameters" if distinct else ""),
        mfu_prefill_flops_only=flops / result["seconds"] / lim.matmul_rate,
        matmul_params=param_counts(shape)["matmul"], **subset, **details, **_limits_detail(lim))
    return 0


def add_bench_parsers(bench_sub: Any) -> None:
    lat = bench_sub.add_parser("latency", help="decode-bs1 (and prefill MFU) against transformers")
    lat.add_argument("--shape", nargs="+", default=["llama-3.2-1b", "llama-3.1-8b"], choices=sorted(SHAPES))
    lat.add_argument("--output-len", type=int, default=256)
    lat.add_argument("--no-peer", action="store_true")
    lat.add_argument("--no-compile-peer", action="store_true")
    lat.add_argument("--eager-output-len", type=int, default=None,
                     help="tokens of the eager run (it counts the routed experts and gives graph_speedup_over_eager); "
                          "default --output-len")
    lat.add_argument("--prefill", action="store_true", help="also 8 x 2048 prefill MFU on llama-3.1-8b")
    lat.add_argument("--prefill-only", action="store_true", help="with --prefill: only the prefill MFU run")
    lat.add_argument("--out", default="benchmarks/results")
    lat.add_argument("--quantization", choices=["fp8"], default=None,
                     help="FP8 weights at load (MoE experts in 128x128 blocks); the floor counts FP8 bytes")
    add_backend_flags(lat)
    lat.set_defaults(func=cmd_latency)
    off = bench_sub.add_parser("offline", help="offline-throughput / nano-vllm against transformers")
    off.add_argument("--workload", choices=["offline-throughput", "nano-vllm"], default="offline-throughput")
    off.add_argument("--shape", choices=sorted(SHAPES), default=None)
    off.add_argument("--num-requests", type=int, default=256)
    off.add_argument("--input-len", type=int, default=512, help="offline-throughput: prompt tokens per request")
    off.add_argument("--output-len", type=int, default=128, help="offline-throughput: new tokens per request")
    off.add_argument("--peer", action="store_true", help="run transformers generate_batch in the same run")
    off.add_argument("--peer-requests", type=int, default=None,
                     help="the peer runs the first N requests of the workload (same per-request lengths; "
                          f"default all of them, {MOE_PEER_REQUESTS} for a MoE shape); the JSON says so")
    off.add_argument("--tbo-peer", action="store_true",
                     help="two-batch overlap on, against the same engine with it off as the peer")
    off.add_argument("--overlap-check", action="store_true", help="bs=256 step time vs graph replay")
    off.add_argument("--repeats", type=int, default=TIMED_REPEATS,
                     help="timed passes after the warm-up pass; the result is the median pass")
    off.add_argument("--out", default="benchmarks/results")
    add_backend_flags(off)
    off.set_defaults(func=cmd_offline)
    from plait.bench.spec import add_spec_parser

    add_spec_parser(bench_sub)  # spec-overhead / spec-ngram-repeat / spec-ngram-miss
    from plait.bench.quant import add_quant_parser

    add_quant_parser(bench_sub)  # FP8: decode-bs1, offline-throughput, gemm
    from plait.bench.structured import add_structured_parser

    add_structured_parser(bench_sub)  # structured-overhead
    from plait.bench.warm_start import add_warm_start_parser

    add_warm_start_parser(bench_sub)  # warm-start: the first requests after an engine start
    from plait.bench.agreement import add_agreement_parser

    add_agreement_parser(bench_sub)  # bf16-agreement: bf16 against an fp32 reference, beside transformers'
    from plait.bench.piecewise import add_prefill_ttft_parser

    add_prefill_ttft_parser(bench_sub)  # prefill-ttft: short prompts' TTFT, piecewise graphs off and on
