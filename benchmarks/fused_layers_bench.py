"""Triton vs torch.compile for the fused GPU layers (issue: "Triton or torch.compile, whichever
measures faster"), and the greedy argmax over the vocabulary (CUDA only).

Ops, on the llama-3.2-1b and llama-3.1-8b shapes, bf16, at 1, 256 and 8192 tokens:
  add_rmsnorm   norm(x + residual) and x + residual (plait.layers.triton_ops.rmsnorm)
  silu_and_mul  silu(x[:, :I]) * x[:, I:] (triton_ops.silu_and_mul)
  rotary        q, k rotated in place at positions (triton_ops.rotary_)
  argmax        fp32 logits [bs, vocab] -> ids (torch.argmax vs plait.layers.triton_ops.argmax)
Each variant: the Triton kernel, the torch reference (norm.py / activation.py / rotary.py) compiled by
``torch.compile(dynamic=False)`` (inductor fuses it into one or two kernels), and the eager reference.
Timing: 50 calls captured into one CUDA graph (launch cost excluded: the engine replays graphs at
decode), replayed 5 times, median per call.

    PYTHONPATH=$PWD python benchmarks/fused_layers_bench.py OUT_DIR
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable

import torch

from plait.layers import triton_ops
from plait.layers.activation import SiluAndMul
from plait.layers.norm import RMSNorm
from plait.layers.rotary import RotaryEmbedding

SHAPES = {  # hidden, intermediate, q heads, kv heads, head dim, vocab
    "llama-3.2-1b": (2048, 8192, 32, 8, 64, 128256),
    "llama-3.1-8b": (4096, 14336, 32, 8, 128, 128256),
}
TOKENS = (1, 256, 8192)
CALLS = 50


def graph_time_us(fn: Callable[[], object]) -> float:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / CALLS)
    return statistics.median(times)


def variants(triton_fn: Callable[[], object], ref_fn: Callable[[], object]) -> dict[str, float]:
    compiled = torch.compile(ref_fn, dynamic=False)
    return {"triton_us": graph_time_us(triton_fn), "torch_compile_us": graph_time_us(compiled),
            "eager_us": graph_time_us(ref_fn)}


def bench_shape(name: str) -> list[dict[str, object]]:
    hidden, inter, hq, hkv, d, vocab = SHAPES[name]
    dev, dt = "cuda", torch.bfloat16
    rows: list[dict[str, object]] = []
    norm = RMSNorm(hidden, dtype=dt).to(dev)
    act = SiluAndMul()
    rope = RotaryEmbedding(d, 8192, 500000.0).to(dev)
    for t in TOKENS:
        x = torch.randn(t, hidden, device=dev, dtype=dt)
        r = torch.randn(t, hidden, device=dev, dtype=dt)
        rows.append({"op": "add_rmsnorm", "shape": name, "tokens": t, **variants(
            lambda x=x, r=r: triton_ops.rmsnorm(x, norm.weight, norm.eps, r),
            lambda x=x, r=r: norm.forward_native(x, r))})
        gu = torch.randn(t, 2 * inter, device=dev, dtype=dt)
        rows.append({"op": "silu_and_mul", "shape": name, "tokens": t, **variants(
            lambda gu=gu: triton_ops.silu_and_mul(gu), lambda gu=gu: act.forward_native(gu))})
        q = torch.randn(t, hq * d, device=dev, dtype=dt)
        k = torch.randn(t, hkv * d, device=dev, dtype=dt)
        pos = torch.randint(0, 4096, (t,), device=dev)
        rows.append({"op": "rotary", "shape": name, "tokens": t, **variants(
            lambda q=q, k=k, pos=pos: triton_ops.rotary_(pos, q, k, rope.cos_sin_cache, d),
            lambda q=q, k=k, pos=pos: rope.forward_native(pos, q, k))})
    for bs in (1, 256):
        logits = torch.randn(bs, vocab, device=dev, dtype=torch.float32)
        ref = torch.argmax(logits, dim=-1)
        assert torch.equal(triton_ops.argmax(logits), ref), "triton argmax disagrees with torch.argmax"
        rows.append({"op": "argmax", "shape": name, "tokens": bs, **variants(
            lambda logits=logits: triton_ops.argmax(logits), lambda logits=logits: torch.argmax(logits, dim=-1))})
    return rows


def main() -> None:
    out: dict[str, object] = {"device": torch.cuda.get_device_name(), "versions": {
        "torch": torch.__version__, "triton": __import__("triton").__version__}}
    rows = []
    for name in SHAPES:
        rows.extend(bench_shape(name))
    for row in rows:
        best = min(("triton_us", "torch_compile_us", "eager_us"), key=lambda k: row[k])  # type: ignore[arg-type]
        row["fastest"] = best.removesuffix("_us")
        print({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()})
    out["rows"] = rows
    with open(f"{sys.argv[1]}/fused-layers-triton-vs-compile.json", "w") as f:
        json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
