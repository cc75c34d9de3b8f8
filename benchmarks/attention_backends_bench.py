"""Extend attention per backend and kernel path (CUDA only): torch_flash's paths against triton.

Workload ``attn-backends-extend`` (llama-3.1-8b attention: 32 q / 8 kv heads, head dim 128, bf16, page
size 1, KV slots scattered at random), shapes 8 x 2048 new tokens over a cached prefix of 0 and of 2048
tokens, and 8 x 2048 with a 512-token sliding window (no prefix). Each variant runs one layer's forward
through the backend contract (planned once outside the timing: planning is once per batch, not per
layer), so torch_flash's prefix gather from the paged cache is inside the time:
  triton               the Triton extend kernel (paged prefix read in the kernel)
  triton:prefill_flash the Triton backend with no-prefix prompts on batched SDPA (prefix 0 only)
  torch_flash:auto     no-prefix requests batched into SDPA(is_causal, enable_gqa); the rest varlen_attn
  torch_flash:sdpa     SDPA only (prefix-cached requests: one masked call each)
  torch_flash:varlen   varlen_attn for every request
  raw:sdpa_batched     SDPA(is_causal, enable_gqa) on dense [8, H, 2048, D] tensors (prefix 0 only)
  raw:varlen_dense     varlen_attn on dense, already-gathered K/V (no paged gather)
Floor: causal attention FLOPs / bf16 matmul rate (8192^3), measured in the same run.

  PYTHONPATH=$PWD python benchmarks/attention_backends_bench.py [--out-dir $OUT]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import sys
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from kernels_bench import Timer, _commit, _versions, measure_device, write_result  # noqa: E402

from plait.attention.torch_flash import KERNEL_PATHS, TorchFlashAttnBackend, detect_varlen_kernel  # noqa: E402
from plait.attention.triton_backend import TritonAttnBackend  # noqa: E402
from tests.attn_cases import extend_batch, layer, make_pools  # noqa: E402

HQ, HKV, D = 32, 8, 128
BS, EXT = 8, 2048
SHAPES = [("8x2048-prefix0", 0, None), ("8x2048-prefix2048", 2048, None), ("8x2048-window512", 0, 512)]


def set_shape(heads: str | None, batch: str | None) -> None:
    """``--heads HQ,HKV,D`` and ``--batch BSxEXT`` replace the 8b heads and the 8 x 2048 batch (with
    --batch only its no-prefix shape runs: the prefill chunks of an offline run)."""
    global HQ, HKV, D, BS, EXT, SHAPES
    if heads:
        HQ, HKV, D = (int(x) for x in heads.split(","))
    if batch:
        BS, EXT = (int(x) for x in batch.split("x"))
        SHAPES = [(f"{BS}x{EXT}-prefix0", 0, None)]


def causal_flops(prefix: int, window: int | None) -> int:
    """QK^T and PV at 2 FLOPs per MAC over the keys each new token sees."""
    visible = sum(min(prefix + i + 1, window or prefix + i + 1) for i in range(EXT))
    return 4 * HQ * D * BS * visible


def variants(prefix: int, window: int | None) -> dict[str, Callable[..., Any]]:
    slots = BS * (prefix + EXT) + 1
    pool, kv, g = make_pools(HKV, D, seed=prefix + (window or 0), dtype=torch.bfloat16, device="cuda",
                             max_context=prefix + EXT, slots=slots, max_reqs=BS + 3)
    fb = extend_batch(pool, g, [prefix] * BS, [EXT] * BS, num_slots=slots)
    q, k, v = (torch.randn(BS * EXT, h * D, dtype=torch.bfloat16, device="cuda") for h in (HQ, HKV, HKV))
    lay = layer(HQ, HKV, D, window)
    out: dict[str, Callable[..., Any]] = {}

    def through(backend) -> Callable[[], Any]:
        backend.init_forward_metadata(fb)
        return lambda: backend.forward(q, k, v, lay, fb, save_kv_cache=False)

    for name, on in (("triton", False), ("triton:prefill_flash", True)):
        if on and (prefix or window):
            continue  # the fused-kernel path takes no-prefix prompts only
        backend = TritonAttnBackend(pool, kv, HQ, sliding_window=window)
        backend.prefill_via_flash = on
        out[name] = through(backend)
    for path in KERNEL_PATHS:
        try:
            out[f"torch_flash:{path}"] = through(TorchFlashAttnBackend(pool, kv, path, sliding_window=window))
        except ValueError as e:  # varlen_attn missing in this torch
            print(f"# torch_flash:{path} skipped: {e}")
    qd = q.view(BS, EXT, HQ, D).transpose(1, 2)
    kd = k.view(BS, EXT, HKV, D).transpose(1, 2)
    vd = v.view(BS, EXT, HKV, D).transpose(1, 2)
    if prefix == 0 and window is None:
        out["raw:sdpa_batched"] = lambda: F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, enable_gqa=True,
                                                                         scale=D**-0.5)
    varlen = detect_varlen_kernel()
    if varlen is not None:
        kk = torch.randn(BS * (prefix + EXT), HKV, D, dtype=torch.bfloat16, device="cuda")
        vv = torch.randn_like(kk)
        q3 = q.view(-1, HQ, D)
        cu_q = torch.arange(0, BS * EXT + 1, EXT, dtype=torch.int32, device="cuda")
        cu_k = torch.arange(0, BS * (prefix + EXT) + 1, prefix + EXT, dtype=torch.int32, device="cuda")
        if window is None or varlen.has_window:
            out["raw:varlen_dense"] = lambda: varlen(q3, kk, vv, cu_q, cu_k, EXT, prefix + EXT, D**-0.5, window)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out-dir", default=os.environ.get("OUT"), help="write one JSON per shape here")
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--heads", default=None, metavar="HQ,HKV,D")
    parser.add_argument("--batch", default=None, metavar="BSxEXT")
    args = parser.parse_args()
    set_shape(args.heads, args.batch)
    if not torch.cuda.is_available():
        raise SystemExit("attention_backends_bench.py needs a CUDA GPU")
    timer = Timer(args.iters, args.warmup)
    dev = measure_device(timer)
    rate = dev["bf16_matmul_TFLOPs"]
    varlen = detect_varlen_kernel()
    base = {"device": torch.cuda.get_device_name(0), "commit": _commit(), "date": dt.date.today().isoformat(),
            "versions": _versions(), "measured": dev,
            "varlen_attn": None if varlen is None else {"window_size": varlen.has_window, "enable_gqa": varlen.has_gqa}}
    for shape, prefix, window in SHAPES:
        flops = causal_flops(prefix, window)
        results: dict[str, Any] = {}
        for name, fn in variants(prefix, window).items():
            try:
                ms = timer(fn)
            except Exception as e:  # one failing path must not lose the others' figures
                results[name] = {"error": f"{type(e).__name__}: {e}"}
                continue
            results[name] = {"ms": ms, "TFLOPs": flops / ms / 1e9, "fraction_of_floor": flops / ms / 1e9 / rate}
            torch.cuda.empty_cache()
        timed = {n: r["ms"] for n, r in results.items() if "ms" in r}
        default_ms, triton_ms = timed.get("torch_flash:auto"), timed.get("triton")
        flash = {n: ms for n, ms in timed.items() if n.startswith("torch_flash")}
        floor_ms = flops / rate / 1e9
        write_result(args.out_dir, {
            **base, "workload": "attn-backends-extend", "shape": f"hq{HQ}-hkv{HKV}-d{D}-attn-{shape}", "metric": "ms",
            "plait": default_ms, "plait_name": "torch_flash:auto (the default kernel path)",
            "best_torch_flash_path": min(flash, key=flash.get) if flash else None,
            "peer_name": "triton extend", "peer": triton_ms,
            "ratio_vs_peer": (triton_ms / default_ms) if triton_ms and default_ms else None,
            "ratio_definition": "triton ms / torch_flash:auto ms (> 1: torch_flash faster)",
            "floor": floor_ms, "fraction_of_floor": (floor_ms / default_ms) if default_ms else None,
            "floor_definition": "causal attention FLOPs / measured bf16 matmul rate (ms)",
            "config": {"bs": BS, "ext": EXT, "prefix": prefix, "sliding_window": window, "hq": HQ, "hkv": HKV,
                       "head_dim": D, "dtype": "bfloat16", "kv_layout": "paged, page size 1, random slots"},
            "flops": flops, "variants": results})
        print(f"# {shape}: " + json.dumps({n: round(ms, 3) for n, ms in timed.items()}))


if __name__ == "__main__":
    main()
