"""Host time of a small host-to-device copy while the stream is busy (GPU only): the way the scheduler and
the speculative worker send a step's integers while the previous forward still runs.

For each method, N copies of an int64 array of `--numel` elements, each issued while a queued matmul
keeps the stream busy for several milliseconds; reports the host microseconds per copy (median, p90)
and whether the host waited for the stream (a copy's host time near the queued work's time).

- ``pin_memory``: ``torch.from_numpy(a).pin_memory().to(dev, non_blocking=True)`` (plait.transfer today);
- ``pageable``: ``torch.from_numpy(a).to(dev, non_blocking=True)`` (the driver stages it);
- ``staged``: a copy into a slice of a persistent pinned buffer, then ``non_blocking`` to the device.

    PYTHONPATH=$PWD python benchmarks/h2d_copy.py [--numel 600] [--copies 200]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--numel", type=int, default=600)
    ap.add_argument("--copies", type=int, default=200)
    args = ap.parse_args()
    dev = torch.device("cuda")
    a = np.arange(args.numel, dtype=np.int64)
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    staging = torch.empty(1 << 20, dtype=torch.int64, pin_memory=True)
    offset = [0]

    def staged(arr: np.ndarray) -> torch.Tensor:
        n = arr.size
        if offset[0] + n > staging.numel():
            offset[0] = 0
        view = staging[offset[0]: offset[0] + n]
        offset[0] += n
        view.numpy()[:] = arr
        return view.to(dev, non_blocking=True)

    methods = {
        "pin_memory": lambda arr: torch.from_numpy(arr).pin_memory().to(dev, non_blocking=True),
        "pageable": lambda arr: torch.from_numpy(arr).to(dev, non_blocking=True),
        "staged": staged,
    }
    busy = []
    for _ in range(3):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(20):
            x @ x
        torch.cuda.synchronize()
        busy.append((time.perf_counter() - t0) * 1e6)
    result: dict[str, object] = {"numel": args.numel, "queued_work_us": statistics.median(busy)}
    for name, fn in methods.items():
        for _ in range(20):
            fn(a)
        times = []
        for _ in range(args.copies):
            torch.cuda.synchronize()
            for _ in range(20):
                x @ x  # the stream is busy for the queued work's time
            t0 = time.perf_counter()
            out = fn(a)
            times.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), torch.from_numpy(a))
        times.sort()
        result[name] = {"median_us": statistics.median(times), "p90_us": times[int(0.9 * len(times))],
                        "max_us": times[-1]}
    print(json.dumps(result))


if __name__ == "__main__":
    main()
