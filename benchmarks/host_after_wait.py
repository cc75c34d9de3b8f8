"""Whether host work runs slower right after the host waited for the GPU (a chained verify's host path
starts right after it read the previous verify's result): the host time of one piece of work (the
bs-1 4-token chain's ``build_verify_batch``, its small copy and views) timed

- ``hot``: back to back, no wait between;
- ``after_sync``: each right after a blocking wait (``Event.synchronize``) for about ``--wait-ms`` of queued
  GPU work (``torch.cuda._sleep``), as a chain waits for its verify;
- ``after_spin``: the same wait by polling the event (the thread kept running);
- ``after_sleep``: each after ``time.sleep`` of the same length (the thread idle, no GPU involved).

If ``after_sync`` is several times ``hot`` and ``after_spin`` is not, the blocking wait slows the work
after it; if ``after_sleep`` is slow too, the host (an idled core) rather than the CUDA wait sets it.

    PYTHONPATH=$PWD python benchmarks/host_after_wait.py [--wait-ms 6] [--reps 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from types import SimpleNamespace

import torch

from plait.speculative.tree import DraftTree
from plait.speculative.verify_batch import build_verify_batch

SPIN_CYCLES_PER_MS = 1_900_000  # torch.cuda._sleep cycles per millisecond, at about 1.9 GHz


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--wait-ms", type=float, default=6.0)
    ap.add_argument("--reps", type=int, default=300)
    args = ap.parse_args()
    dev = torch.device("cuda")
    slots = torch.arange(10, 14, device=dev)
    rows = [SimpleNamespace(kv_len=100, req_pool_idx=1)]
    tree = DraftTree.chain(5, [6, 7, 8])

    def work() -> None:
        build_verify_batch(rows, [tree], slots, dev, causal_chains=True)

    def gpu_wait(spin: bool) -> None:
        torch.cuda._sleep(int(args.wait_ms * SPIN_CYCLES_PER_MS))
        event = torch.cuda.Event()
        event.record()
        if spin:
            while not event.query():
                pass
        else:
            event.synchronize()

    def timed(before: Callable[[], None] | None) -> float:
        samples = []
        for _ in range(args.reps):
            if before is not None:
                before()
            t0 = time.perf_counter()
            work()
            samples.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        return statistics.median(samples) * 1e6

    for _ in range(100):
        work()
    torch.cuda.synchronize()
    result = {
        "work": "build_verify_batch, one 4-token chain", "wait_ms": args.wait_ms,
        "hot_us": timed(None),
        "after_sync_us": timed(lambda: gpu_wait(False)),
        "after_spin_us": timed(lambda: gpu_wait(True)),
        "after_sleep_us": timed(lambda: time.sleep(args.wait_ms / 1e3)),
    }
    result["hot_again_us"] = timed(None)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
