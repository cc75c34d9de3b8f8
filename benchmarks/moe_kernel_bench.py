"""Micro-benchmark of the fused MoE layer's expert computation against its byte or FLOP ceiling (CUDA only).

For each shape (qwen3-30b-a3b: 128 experts, top 8, hidden 2048, intermediate 768; gpt-oss-20b: 32
experts, top 4, hidden 2880, intermediate 2880, swiglu_oai with biases) and batch size, bf16 random
weights, random top-k routings:

- time: ``fused_experts_triton`` (tuned config, alignment and top-k sum included) as CUDA graph
  replays rotating over 8 routings, median per call;
- byte floor: the distinct experts each routing reads (counted from the routing) times one expert's
  weight bytes (w13, w2 and biases), plus the hidden states in and out, over HBM bandwidth measured
  in the same run (a 4 GiB device copy, read + write bytes);
- FLOP floor: 2 * T * K * (H * 2I + I * H) over the bf16 matmul rate measured in the same run
  (8192^3 torch.matmul); the ceiling is the larger time, the result the fraction ceiling / time;
- peer: the reference loop over experts (``fused_experts_reference``, eager; it syncs with the host).

Also reported per shape: the same config with the activation fused / separate, and the alignment
step alone.

``--fp8``: block-FP8 experts (float8_e4m3fn, 128 x 128 block scales; their own tuned tables). The
byte floor counts one byte per weight plus the fp32 block scales; the FLOP floor uses the FP8
``torch._scaled_mm`` 8192^3 rate measured in the same run (the aligned pipeline multiplies e4m3 x
e4m3); the relative error is against the reference loop on the dequantized weights with the
activations quantized as the pipeline quantizes them; the per-launch stage times are not taken.

  python benchmarks/moe_kernel_bench.py [--out-dir benchmarks/results] [--batch-sizes 1,32,256,4096] [--fp8]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys

import torch
from triton.runtime.errors import OutOfResources

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tune_fused_moe import (  # noqa: E402
    MOE_KERNEL_SHAPES,
    MoeShape,
    graph_time_us,
    make_inputs,
    make_weights,
    rel_error_vs_reference,
)

from plait.bench.results import write_result  # noqa: E402
from plait.layers.moe.align import moe_align_block_size  # noqa: E402
from plait.layers.moe.fused_moe_triton import (  # noqa: E402
    fused_experts_triton,
    fused_experts_with_config,
    invoke_fused_moe_kernel,
    moe_activation,
    moe_sum,
)
from plait.layers.moe.kernel_config import MoeKernelConfig, get_config, load_configs  # noqa: E402
from plait.layers.moe.reference import fused_experts_reference  # noqa: E402

ROTATIONS = 8
HEADLINE_BATCH = 256


def copy_bandwidth() -> float:
    """Bytes per second of a 4 GiB device-to-device copy, counting bytes read plus written."""
    n = 4 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = []
    for i in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        if i >= 2:
            times.append(start.elapsed_time(end) / 1000)
    del src, dst
    return 2 * n / statistics.median(times)


def matmul_rate() -> float:
    """bf16 FLOP/s of an 8192^3 torch.matmul on random data."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    times = []
    for i in range(13):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.matmul(a, b)
        end.record()
        end.synchronize()
        if i >= 3:
            times.append(start.elapsed_time(end) / 1000)
    return 2 * 8192**3 / statistics.median(times)


def expert_bytes(shape: MoeShape) -> int:
    """One expert's bytes as stored: bf16 weights and biases, or FP8 weights, their fp32 block
    scales and bf16 biases."""
    h, i = shape.hidden, shape.inter
    weights = 2 * i * h + h * i
    biases = ((2 * i + h) if shape.bias else 0) * 2
    if not shape.fp8:
        return weights * 2 + biases
    blocks = -(-2 * i // 128) * -(-h // 128) + -(-h // 128) * -(-i // 128)
    return weights + 4 * blocks + biases


def stage_times_us(shape: MoeShape, experts: tuple, inputs: list, cfg: MoeKernelConfig) -> dict[str, float]:
    """Each launch of the pipeline timed alone (graph replays over the rotating routings), on
    alignments and buffers prepared outside the timed region."""
    w13, w2, b13, b2, _ = experts  # bf16 experts only
    prepared = []
    for x, w, ids in inputs:
        align = moe_align_block_size(ids, cfg.block_m, shape.num_experts)
        pairs = ids.numel()
        gate_up = torch.empty(pairs, 2 * shape.inter, dtype=x.dtype, device=x.device)
        act = torch.empty(pairs, shape.inter, dtype=x.dtype, device=x.device)
        pair_out = torch.empty(pairs, shape.hidden, dtype=x.dtype, device=x.device)
        prepared.append((x, w.reshape(-1).float().contiguous(), ids, align, gate_up, act, pair_out))
    out = torch.empty(inputs[0][0].shape, dtype=inputs[0][0].dtype, device="cuda")
    gemm1 = [lambda p=p: invoke_fused_moe_kernel(
        p[0], w13, p[5] if cfg.fuse_activation else p[4], b13, None, *p[3], a_row_div=shape.top_k,
        activation=shape.activation if cfg.fuse_activation else None, config=cfg) for p in prepared]
    times = {"gate_up_gemm" + ("_with_activation" if cfg.fuse_activation else ""): graph_time_us(gemm1, replays=10)}
    if not cfg.fuse_activation:
        times["activation"] = graph_time_us([lambda p=p: moe_activation(p[4], p[5], p[2], shape.num_experts,
                                                                        shape.activation) for p in prepared], 10)
    times["down_gemm"] = graph_time_us([lambda p=p: invoke_fused_moe_kernel(
        p[5], w2, p[6], b2, p[1], *p[3], a_row_div=1, activation=None, config=cfg) for p in prepared], replays=10)
    times["topk_sum"] = graph_time_us([lambda p=p: moe_sum(p[6], p[2], out, shape.num_experts)
                                       for p in prepared], replays=10)
    return times


def bench_shape(name: str, batch_sizes: list[int], bandwidth: float, peak: float, out_dir: str) -> list[dict]:
    shape = MOE_KERNEL_SHAPES[name]
    experts = make_weights(shape)
    w13, w2, b13, b2, scales = experts
    device = torch.cuda.get_device_name()
    tuned = load_configs(shape.num_experts, shape.inter, device, shape.dtype_key) is not None
    x, weights, ids = make_inputs(shape, HEADLINE_BATCH, seed=99)
    rel_err = rel_error_vs_reference(shape, experts, x, weights, ids,
                                     get_config(HEADLINE_BATCH, shape.num_experts, shape.inter, shape.top_k,
                                                device, shape.dtype_key))
    rows = []
    for m in batch_sizes:
        inputs = [make_inputs(shape, m, seed=s) for s in range(ROTATIONS)]
        fns = [lambda x=x, w=w, i=i: fused_experts_triton(x, w13, w2, w, i, shape.activation, b13, b2, **scales)
               for x, w, i in inputs]
        us = graph_time_us(fns, replays=10)
        distinct = statistics.mean(int(torch.unique(i).numel()) for _, _, i in inputs)
        nbytes = distinct * expert_bytes(shape) + 2 * m * shape.hidden * 2
        flops = 2 * m * shape.top_k * (shape.hidden * 2 * shape.inter + shape.inter * shape.hidden)
        byte_us, flop_us = nbytes / bandwidth * 1e6, flops / peak * 1e6
        ceiling_us = max(byte_us, flop_us)
        cfg = get_config(m, shape.num_experts, shape.inter, shape.top_k, device, shape.dtype_key)
        flipped = dataclasses.replace(cfg, fuse_activation=not cfg.fuse_activation)
        try:
            flipped_us: float | None = graph_time_us([lambda x=x, w=w, i=i, c=flipped: fused_experts_with_config(
                x, w13, w2, w, i, shape.activation, b13, b2, c, **scales) for x, w, i in inputs], replays=10)
        except OutOfResources:  # the tile does not fit with the activation flipped (two accumulators)
            flipped_us = None
        align_us = graph_time_us([lambda i=i, bm=cfg.block_m: moe_align_block_size(i, bm, shape.num_experts)
                                  for _, _, i in inputs], replays=10)
        stages = {} if shape.fp8 else stage_times_us(shape, experts, inputs, cfg)
        ref_scales = (scales.get("w13_scale"), scales.get("w2_scale"))
        x, w, i = inputs[0]
        fused_experts_reference(x, w13, w2, w, i, shape.activation, b13, b2, *ref_scales)  # warm up
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for x, w, i in inputs:
            fused_experts_reference(x, w13, w2, w, i, shape.activation, b13, b2, *ref_scales)
        end.record()
        end.synchronize()
        ref_us = start.elapsed_time(end) * 1000 / len(inputs)
        row = {
            "batch_size": m, "us": us, "ceiling_us": ceiling_us, "fraction_of_ceiling": ceiling_us / us,
            "binding": "bytes" if byte_us >= flop_us else "flops", "byte_floor_us": byte_us, "flop_floor_us": flop_us,
            "distinct_experts": distinct, "bytes": nbytes, "flops": flops,
            "achieved_TB_per_s": nbytes / us / 1e6, "achieved_TFLOP_per_s": flops / us / 1e6,
            "kernel_config": cfg.to_json(), "flipped_fuse_activation_us": flipped_us, "align_us": align_us,
            "reference_loop_us": ref_us, "stage_us": stages,
        }
        rows.append(row)
        print(f"{name} bs={m}: {us:.1f} us, ceiling {ceiling_us:.1f} us ({row['binding']}), "
              f"{100 * ceiling_us / us:.0f}% | fuse={cfg.fuse_activation} other {flipped_us} us | "
              f"align {align_us:.1f} us | reference loop {ref_us:.0f} us | "
              + " ".join(f"{k} {v:.1f}" for k, v in stages.items()), flush=True)
    # One result per shape: the headline batch (256 where measured) in the record's fields, every
    # batch size under "rows".
    head = next((r for r in rows if r["batch_size"] == HEADLINE_BATCH), rows[-1])
    write_result(out_dir, "moe-kernel", name, "calls_per_s", 1e6 / head["us"], "fused_experts_reference",
                 1e6 / head["reference_loop_us"], 1e6 / head["ceiling_us"], dataclasses.asdict(shape),
                 tag="fp8" if shape.fp8 else None,
                 headline_batch_size=head["batch_size"], tuned_config_file=tuned,
                 rel_error_vs_fp32_reference=rel_err, hbm_bytes_per_s=bandwidth,
                 **{"fp8_flops_per_s" if shape.fp8 else "bf16_flops_per_s": peak}, rows=rows)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", action="append", choices=sorted(MOE_KERNEL_SHAPES))
    ap.add_argument("--batch-sizes", default="1,32,256,4096")
    ap.add_argument("--out-dir", default="benchmarks/results")
    ap.add_argument("--fp8", action="store_true", help="block-FP8 experts (module doc)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("moe_kernel_bench.py needs a CUDA GPU")
    if args.fp8:
        from plait.bench.hardware import fp8_matmul_rate

        for n, s in list(MOE_KERNEL_SHAPES.items()):
            MOE_KERNEL_SHAPES[n] = dataclasses.replace(s, fp8=True)
    bandwidth, peak = copy_bandwidth(), (fp8_matmul_rate() if args.fp8 else matmul_rate())
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, {'fp8 _scaled_mm' if args.fp8 else 'bf16 matmul'} "
          f"{peak / 1e12:.0f} TFLOP/s", flush=True)
    summary = {"hbm_bytes_per_s": bandwidth, "bf16_flops_per_s": peak, "shapes": {}}
    for name in args.shape or sorted(MOE_KERNEL_SHAPES):
        summary["shapes"][name] = bench_shape(name, [int(b) for b in args.batch_sizes.split(",")], bandwidth, peak,
                                              args.out_dir)
    print(json.dumps({n: [(r["batch_size"], round(r["us"], 1), round(r["fraction_of_ceiling"], 3))
                          for r in rows] for n, rows in summary["shapes"].items()}))


if __name__ == "__main__":
    main()
