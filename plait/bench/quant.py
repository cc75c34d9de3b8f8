"""FP8 workloads (``plait bench quant``; docs/quantization.md, docs/benchmarks.md).

decode-bs1          llama-3.1-8b, FP8 weights (online, per-channel) against plait bf16 in the same run
                    (the peer: ``ratio_vs_peer`` is FP8 over bf16); floor: copy bandwidth over the
                    bytes one step reads as stored (FP8 layers, their scales, the bf16 LM head, the KV
                    cache at the mean context)
offline-throughput  llama-3.1-8b, FP8 weights + FP8 KV cache against bf16 in the same run; each
                    engine's KV capacity is reported; floors from the FP8 _scaled_mm ceiling
gemm                the FP8 matmul paths at the llama-3.1-8b shapes for M in {1, 16, 64, 256, 4096}:
                    achieved TB/s (weights read) and TFLOP/s against ceilings measured in the same
                    run (copy and read bandwidth, bf16 matmul and FP8 _scaled_mm 8192^3)
"""

from __future__ import annotations

import argparse
import tempfile
from typing import Any

import torch

from plait import envs
from plait.bench.hardware import graph_time
from plait.bench.results import write_result
from plait.bench.shapes import SHAPES, linear_shapes, moe_counts, param_counts, write_shape_dir
from plait.bench.workloads import (
    Limits,
    decode_step_bytes,
    plait_decode_bs1,
    plait_throughput,
    random_prompts,
    throughput_floor_seconds,
)

SHAPE = "llama-3.1-8b"
GEMM_TOKENS = (1, 16, 64, 256, 4096)


def fp8_weight_bytes(shape: str, block: bool = False) -> float:
    """Bytes of a decode step's weights stored as plait runs FP8: the layers' matmuls one byte per
    parameter plus their fp32 scales (per output row, or per 128 x 128 block), the LM head bf16."""
    c = SHAPES[shape]
    p = param_counts(shape)
    scales = 0
    for n, k in linear_shapes(shape).values():
        scales += 4 * (-(-n // 128) * -(-k // 128) if block else n)
    return p["layers"] + scales * c["num_hidden_layers"] + 2 * (p["lm_head"] + c["hidden_size"])


def moe_fp8_weight_bytes(shape: str, distinct_experts: float) -> float:
    """Bytes of a MoE decode step's weights as ``--quantization fp8`` stores them: the dense layers
    (attention, dense MLP layers) one byte per parameter plus an fp32 scale per output row; per
    sparse layer the ``distinct_experts`` the step routes to, one byte per parameter plus their fp32
    128 x 128 block scales; the router and the LM head bf16."""
    c = SHAPES[shape]
    p = param_counts(shape)
    m = moe_counts(shape)
    h, inter = c["hidden_size"], c.get("moe_intermediate_size") or c["intermediate_size"]
    dense_linear = p["dense_matmul"] - m["sparse_layers"] * m["router"] - p["lm_head"] - h
    rows = sum(n for name, (n, _) in linear_shapes(shape).items() if name in ("qkv_proj", "o_proj"))
    dense_rows = rows * c["num_hidden_layers"] + (2 * c["intermediate_size"] + h) * (
        c["num_hidden_layers"] - m["sparse_layers"])
    blocks = -(-2 * inter // 128) * -(-h // 128) + -(-h // 128) * -(-inter // 128)
    expert = m["per_expert"] + 4 * blocks
    return (dense_linear + 4 * dense_rows + m["sparse_layers"] * (distinct_experts * expert + 2 * m["router"])
            + 2 * (p["lm_head"] + h))


def _limits() -> tuple[Limits, float]:
    """The run's ceilings: copy and read bandwidth, bf16 matmul and FP8 _scaled_mm 8192^3 rates."""
    from plait.bench.hardware import bf16_matmul_rate, fp8_matmul_rate, hbm_bandwidth

    bw = hbm_bandwidth()
    lim = Limits(copy_bw=bw["copy_bytes_per_s"], read_bw=bw["read_bytes_per_s"], matmul_rate=bf16_matmul_rate())
    rate = fp8_matmul_rate()
    print(f"measured: copy {lim.copy_bw / 1e12:.2f} TB/s, read {lim.read_bw / 1e12:.2f} TB/s, bf16 matmul "
          f"{lim.matmul_rate / 1e12:.0f} TFLOP/s, fp8 _scaled_mm {rate / 1e12:.0f} TFLOP/s")
    return lim, rate


def _ceilings(lim: Limits, fp8_rate: float) -> dict[str, float]:
    return {"copy_bandwidth_tb_s": lim.copy_bw / 1e12, "read_bandwidth_tb_s": lim.read_bw / 1e12,
            "bf16_matmul_tflop_s": lim.matmul_rate / 1e12, "fp8_scaled_mm_tflop_s": fp8_rate / 1e12}


# --- decode-bs1 ---------------------------------------------------------------------------------
def cmd_decode(args: argparse.Namespace, lim: Limits, fp8_rate: float, shape_dir: str) -> None:
    vocab = SHAPES[SHAPE]["vocab_size"]
    prompt = random_prompts(1, 128, vocab, seed=0)[0]
    new = args.output_len
    kv = args.kv_cache_dtype
    bf16 = plait_decode_bs1(SHAPE, shape_dir, prompt, new)
    fp8 = plait_decode_bs1(SHAPE, shape_dir, prompt, new, quantization="fp8", kv_cache_dtype=kv)
    contexts = [128 + new // 2]
    kv_bytes = 1 if kv != "auto" else 2
    step_bytes = decode_step_bytes(SHAPE, contexts, weight_bytes=fp8_weight_bytes(SHAPE), kv_dtype_bytes=kv_bytes)
    write_result(
        args.out, "decode-bs1", SHAPE, "decode_tok_s", fp8["tok_s"], "plait bf16", bf16["tok_s"],
        lim.copy_bw / step_bytes,
        {"dtype": "bfloat16", "load_format": "dummy", "quantization": "fp8", "kv_cache_dtype": kv,
         "input_len": 128, "output_len": new, "cuda_graph": fp8["cuda_graph"]},
        tag="fp8" if kv == "auto" else f"fp8-kv-{kv}", fp8=fp8, bf16=bf16, bytes_per_step=step_bytes,
        floor_definition="copy HBM bandwidth / (FP8 layer weights + their fp32 scales + bf16 LM head + KV "
                         "cache at the mean context) per step",
        floor_read_bandwidth_tok_s=lim.read_bw / step_bytes,
        bf16_fraction_of_its_floor=bf16["tok_s"] / (lim.copy_bw / decode_step_bytes(SHAPE, contexts)),
        **_ceilings(lim, fp8_rate))


# --- offline-throughput ----------------------------------------------------------------------------
def cmd_offline(args: argparse.Namespace, lim: Limits, fp8_rate: float, shape_dir: str) -> None:
    vocab = SHAPES[SHAPE]["vocab_size"]
    n = args.num_requests
    prompts = random_prompts(n, 512, vocab, seed=0)
    out_lens = [128] * n
    params = [{"temperature": 0.0, "ignore_eos": True, "max_new_tokens": 128}] * n
    kv = args.kv_cache_dtype if args.kv_cache_dtype != "auto" else "fp8_e4m3"
    bf16 = plait_throughput(shape_dir, prompts, params, max_running_requests=n)
    fp8 = plait_throughput(shape_dir, prompts, params, max_running_requests=n, quantization="fp8",
                           kv_cache_dtype=kv)
    lens = [len(p) for p in prompts]
    fp8_lim = Limits(lim.copy_bw, lim.read_bw, fp8_rate)
    floor_s = throughput_floor_seconds(SHAPE, lens, out_lens, fp8_lim, fp8_weight_bytes(SHAPE), 1)
    write_result(
        args.out, "offline-throughput", SHAPE, "output_tok_s", fp8["output_tok_s"], "plait bf16",
        bf16["output_tok_s"], sum(out_lens) / floor_s,
        {"dtype": "bfloat16", "load_format": "dummy", "quantization": "fp8", "kv_cache_dtype": kv,
         "requests": n, "max_running_requests": n},
        tag=f"fp8-kv-{kv}", detail=fp8, peer_detail=bf16, floor_seconds=floor_s,
        kv_capacity_tokens={"fp8": fp8["kv_capacity_tokens"], "bf16": bf16["kv_capacity_tokens"]},
        floor_definition="sum over steps of max(FLOPs / FP8 _scaled_mm rate, bytes / copy bandwidth) with FP8 "
                         "weights (bf16 LM head) and an FP8 KV cache",
        **_ceilings(lim, fp8_rate))


# --- gemm ----------------------------------------------------------------------------------------
def _gemm_row(name: str, m: int, w: torch.Tensor, qs: list[torch.Tensor], s: torch.Tensor, bscale: torch.Tensor,
              lim: Limits, fp8_rate: float, sweep: bool) -> dict[str, Any]:
    """One (layer, M) row: every path's time, TB/s and TFLOP/s (``qs``: copies of one FP8 weight). At
    M <= 16 the GEMV is reported alone too (``gemv_channel``, ``gemv_block``, and ``bf16_gemv`` beside
    cuBLAS's ``bf16_matmul``), with the configs it reads (a tuned table or the default)."""
    from plait.layers.quantization.fp8_kernels import (
        fp8_linear,
        quantize_rows,
        scaled_mm_rowwise,
        w8a8_block_matmul,
    )
    from plait.layers.quantization.gemv import gemv
    from plait.layers.quantization.gemv_config import GEMV_MAX_TOKENS

    n, k = w.shape
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    wbf = [w.clone() for _ in range(max(1, len(qs) // 2))]
    flops = 2 * m * n * k
    row: dict[str, Any] = {"layer": name, "N": n, "K": k, "M": m}

    def record(label: str, seconds: float, weight_bytes: float, rate: float) -> None:
        row[label] = {"us": seconds * 1e6, "tb_s": weight_bytes / seconds / 1e12, "tflop_s": flops / seconds / 1e12,
                      "fraction_of_ceiling": max(weight_bytes / seconds / lim.read_bw, flops / seconds / rate)}

    def smm(q: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x)
        return scaled_mm_rowwise(xq, xs, q, s, torch.bfloat16)

    def blk(q: torch.Tensor) -> torch.Tensor:
        xq, xs = quantize_rows(x, 128)
        return w8a8_block_matmul(xq, xs, q, bscale, (128, 128), torch.bfloat16)

    record("bf16_matmul", graph_time([lambda w_=w_: x @ w_.t() for w_ in wbf]), 2 * n * k, lim.matmul_rate)
    if m <= GEMV_MAX_TOKENS:
        record("bf16_gemv", graph_time([lambda w_=w_: gemv(x, w_) for w_ in wbf]), 2 * n * k, lim.matmul_rate)
    record("fp8_channel", graph_time([lambda q=q: fp8_linear(x, q, s, None, None, None) for q in qs]),
           n * k + 4 * n, fp8_rate)
    record("fp8_block", graph_time([lambda q=q: fp8_linear(x, q, bscale, (128, 128), None, None) for q in qs]),
           n * k + 4 * bscale.numel(), fp8_rate)
    if m <= GEMV_MAX_TOKENS:
        record("gemv_channel", graph_time([lambda q=q: gemv(x, q, s, None) for q in qs]), n * k + 4 * n, fp8_rate)
        record("gemv_block", graph_time([lambda q=q: gemv(x, q, bscale, (128, 128)) for q in qs]),
               n * k + 4 * bscale.numel(), fp8_rate)
    if m >= 16:
        record("scaled_mm_rowwise", graph_time([lambda q=q: smm(q) for q in qs]), n * k, fp8_rate)
        record("block_gemm", graph_time([lambda q=q: blk(q) for q in qs]), n * k, fp8_rate)
    if sweep and m <= GEMV_MAX_TOKENS:
        from plait.bench.gemv_tune import Case, tune_case
        from plait.layers.quantization.gemv import device_info

        best = tune_case(Case("fp8_channel", n, k, m, [f"{SHAPE}/{name}"]), qs, s, None, device_info(x)[1])
        row["gemv_sweep_best"] = {"us": best["best_us"], "tb_s": best["best_tb_s"], "config": best["best"]}
    return row


def gemm_rows(lim: Limits, fp8_rate: float, sweep: bool) -> list[dict[str, Any]]:
    from plait.layers.quantization.fp8_kernels import quantize_weight_per_channel

    rows: list[dict[str, Any]] = []
    for name, (n, k) in linear_shapes(SHAPE).items():
        copies = max(1, (512 << 20) // (n * k))  # rotate >= 512 MB of FP8 weights: none stays in L2
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        q, s = quantize_weight_per_channel(w)
        qs = [q.clone() for _ in range(copies)]
        bscale = torch.rand(-(-n // 128), -(-k // 128), device="cuda") * 1e-3 + 1e-4
        for m in GEMM_TOKENS:
            row = _gemm_row(name, m, w, qs, s, bscale, lim, fp8_rate, sweep)
            print(row)
            rows.append(row)
        del qs
        torch.cuda.empty_cache()
    return rows


def cmd_gemm(args: argparse.Namespace, lim: Limits, fp8_rate: float) -> None:
    rows = gemm_rows(lim, fp8_rate, args.sweep)
    best_m1 = min(r["fp8_channel"]["fraction_of_ceiling"] for r in rows if r["M"] == 1)
    write_result(
        args.out, "gemm-fp8", SHAPE, "min_fraction_of_read_bandwidth_at_m1", best_m1, None, None, None,
        {"dtype": "bfloat16", "quantization": "fp8", "kv_cache_dtype": "auto", "tokens": list(GEMM_TOKENS)},
        rows=rows, gemv_config_dir=envs.GEMV_CONFIG_DIR.get(),
        definition="per layer and M: microseconds per call (CUDA graph replay, weights rotated past "
                              "L2), TB/s of weight bytes read and TFLOP/s; fraction_of_ceiling is the larger of "
                              "TB/s over the measured read bandwidth and TFLOP/s over the measured FP8 "
                              "_scaled_mm (bf16 matmul for bf16) rate", **_ceilings(lim, fp8_rate))


def cmd_quant(args: argparse.Namespace) -> int:
    lim, fp8_rate = _limits()
    shape_dir = str(write_shape_dir(tempfile.mkdtemp(prefix="plait-shapes-"), SHAPE))
    for workload in args.workload:
        if workload == "gemm":
            cmd_gemm(args, lim, fp8_rate)
        elif workload == "decode-bs1":
            cmd_decode(args, lim, fp8_rate, shape_dir)
        else:
            cmd_offline(args, lim, fp8_rate, shape_dir)
    return 0


def add_quant_parser(bench_sub: Any) -> None:
    from plait.config import KV_CACHE_DTYPES

    p = bench_sub.add_parser("quant", help="FP8 weights / KV cache: decode-bs1, offline-throughput, GEMM kernels")
    p.add_argument("--workload", nargs="+", choices=["gemm", "decode-bs1", "offline-throughput"],
                   default=["gemm", "decode-bs1", "offline-throughput"])
    p.add_argument("--output-len", type=int, default=256)
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="decode-bs1: the FP8 engine's KV cache; offline-throughput: auto means fp8_e4m3")
    p.add_argument("--sweep", action="store_true",
                   help="gemm: also sweep the FP8 GEMV's launch configs at M 1 / 16 (benchmarks/tune_gemv.py's "
                        "candidates)")
    p.add_argument("--out", default="benchmarks/results")
    p.set_defaults(func=cmd_quant)
