"""Measured device limits (the floors are computed from these, in the same run)."""

from __future__ import annotations

import torch


def _time_cuda(fn, iters: int) -> float:
    """Seconds per call, by CUDA events after a warm-up."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def hbm_bandwidth(num_bytes: int = 4 << 30) -> dict[str, float]:
    """Copy bandwidth (bytes read + written per second) and read-only bandwidth (a reduction)."""
    x = torch.empty(num_bytes // 2, dtype=torch.bfloat16, device="cuda").uniform_()
    y = torch.empty_like(x)
    copy_s = _time_cuda(lambda: y.copy_(x), 20)
    read_s = _time_cuda(lambda: torch.sum(x, dtype=torch.float32), 20)
    return {"copy_bytes_per_s": 2 * num_bytes / copy_s, "read_bytes_per_s": num_bytes / read_s}


def bf16_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n^3 bf16 matmul."""
    a = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(n, n, dtype=torch.bfloat16, device="cuda")
    seconds = _time_cuda(lambda: a @ b, 20)
    return 2 * n**3 / seconds


def fp8_matmul_rate(n: int = 8192) -> float:
    """FLOP/s of an n^3 FP8 (e4m3) ``torch._scaled_mm`` with per-tensor scales, bf16 out."""
    a = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(n, n, device="cuda").to(torch.float8_e4m3fn).t()  # column-major, as cuBLAS wants
    one = torch.ones((), device="cuda")
    seconds = _time_cuda(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16), 20)
    return 2 * n**3 / seconds
