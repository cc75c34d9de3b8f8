"""Measured device limits (the floors are computed from these, in the same run). On a machine
without CUDA (the CPU smoke runs of tiny shapes) the same measurements run on the CPU, smaller."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch


def bench_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def sync() -> None:
    """Wait for the device's queued work (nothing to wait for on the CPU)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def seconds_per_call(fn: Callable[[], Any], iters: int) -> float:
    """Seconds per call after a warm-up: by CUDA events on the GPU, else by the wall clock."""
    for _ in range(3):
        fn()
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        return (time.perf_counter() - t0) / iters
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def hbm_bandwidth(num_bytes: int | None = None) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and read-only bandwidth (a reduction)."""
    num_bytes = num_bytes or (4 << 30 if torch.cuda.is_available() else 16 << 20)
    x = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device=bench_device()).uniform_()
    y = torch.empty_like(x)
    copy_s = seconds_per_call(lambda: y.copy_(x), 20)
    read_s = seconds_per_call(lambda: torch.sum(x, dtype=torch.float32), 20)
    return {"copy_bytes_per_s": 2 * num_bytes / copy_s, "read_bytes_per_s": num_bytes / read_s}


def bf16_matmul_rate(n: int | None = None) -> float:
    """FLOP/s of an n^3 bf16 matmul."""
    n = n or (8192 if torch.cuda.is_available() else 256)
    a = torch.randn(n, n, dtype=torch.bfloat16, device=bench_device())
    b = torch.randn(n, n, dtype=torch.bfloat16, device=bench_device())
    seconds = seconds_per_call(lambda: a @ b, 20 if torch.cuda.is_available() else 3)
    return 2 * n**3 / seconds


def bench_dtype() -> str:
    """bf16 on the GPU (the benchmarks' dtype); fp32 for CPU smoke runs, where bf16 matmuls crawl."""
    return "bfloat16" if torch.cuda.is_available() else "float32"


def fp8_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n^3 FP8 (e4m3) ``torch._scaled_mm`` with per-tensor scales, bf16 out."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
    one = torch.ones((), device="cuda")
    seconds = seconds_per_call(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
    return 2 * n**3 / seconds


def graph_time(fns: list[Callable[[], Any]], reps: int = 10) -> float:
    """Seconds per call of a CUDA graph holding ``fns`` (called in turn ``reps`` times), replayed: no
    launch overhead, and weights rotated past the L2."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(reps):
            for f in fns:
                f()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(5):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / (5 * reps * len(fns))
