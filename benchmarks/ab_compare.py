"""A/B of two plait source trees in one GPU run: the same workload, each tree's engine warmed once,
then measured in alternation (A, B, A, B, ...), so drift of the machine hits both alike.

    python benchmarks/ab_compare.py OUT_DIR TREE_A TREE_B [--rounds 5] [--workloads decode-bs1-1b ...]

Each tree runs in a worker process of its own (``PYTHONPATH=TREE``) that keeps its engine between
rounds; the driver tells the workers in turn to run one measurement and reads one JSON line back.
Both engines live on the GPU at once, so their KV pools are sized explicitly and equally.
Writes ``OUT_DIR/ab-<workload>.json`` with every round and the medians, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import random
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

WORKLOADS: dict[str, dict[str, Any]] = {
    # decode-bs1 (docs/benchmarks.md): one request, 128 in / 256 out, greedy; decode tokens/s, prefill excluded.
    "decode-bs1-1b": {"shape": "llama-3.2-1b", "kind": "decode", "max_total_tokens": 16384},
    "decode-bs1-8b": {"shape": "llama-3.1-8b", "kind": "decode", "max_total_tokens": 16384},
    # offline-throughput: 256 requests, 512 in / 128 out, ignore_eos; output tokens/s, fresh prompts
    # every round (the same prompts for A and B in a round).
    "offline-throughput-1b": {"shape": "llama-3.2-1b", "kind": "offline", "max_total_tokens": 400_000},
    # nano-vllm: 256 requests, in and out uniform in [100, 1024], temperature 0.6, ignore_eos; output
    # tokens/s, fresh prompts and lengths every round (the same for A and B in a round).
    "nano-vllm-0.6b": {"shape": "qwen3-0.6b", "kind": "nano", "max_total_tokens": 300_000},
}
DECODE_IN, DECODE_OUT = 128, 256
OFFLINE_N, OFFLINE_IN, OFFLINE_OUT = 256, 512, 128


def _sync() -> None:
    import torch

    torch.cuda.synchronize()


def _timed(fn: Any) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def nano_requests(seed: int) -> tuple[list[list[int]], list[dict[str, Any]]]:
    """``plait.bench.workloads.nano_vllm_requests(OFFLINE_N, seed)``, spelled out here: a worker runs
    against older trees, which may not have it (the same draws in the same order)."""
    rng = random.Random(seed)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(OFFLINE_N)]
    params = [{"temperature": 0.6, "ignore_eos": True, "max_new_tokens": rng.randint(100, 1024), "seed": i}
              for i in range(OFFLINE_N)]
    return prompts, params


def worker(shape_dir: str, workload: str, vocab: int) -> None:
    """One tree's engine: build, warm once, then one measurement per line read from stdin."""
    from plait.bench.workloads import random_prompts
    from plait.engine import Engine

    spec = WORKLOADS[workload]
    options: dict[str, Any] = {"load_format": "dummy", "dtype": "bfloat16", "context_length": 4096,
                               "max_total_tokens": spec["max_total_tokens"]}
    if spec["kind"] == "decode":
        engine = Engine(model=shape_dir, disable_radix_cache=True, max_running_requests=8, **options)
        prompt = random_prompts(1, DECODE_IN, vocab, seed=0)[0]
        greedy = {"temperature": 0.0, "ignore_eos": True}
        engine.generate(prompt, {**greedy, "max_new_tokens": 32})

        def measure(_round: int) -> float:
            t_one = min(_timed(lambda: engine.generate(prompt, {**greedy, "max_new_tokens": 1})) for _ in range(3))
            t_all = _timed(lambda: engine.generate(prompt, {**greedy, "max_new_tokens": DECODE_OUT}))
            return (DECODE_OUT - 1) / (t_all - t_one)
    elif spec["kind"] == "offline":
        engine = Engine(model=shape_dir, max_running_requests=OFFLINE_N, **options)
        params = {"temperature": 0.0, "ignore_eos": True, "max_new_tokens": OFFLINE_OUT}
        engine.generate(random_prompts(OFFLINE_N, OFFLINE_IN, vocab, seed=1000), params)

        def measure(round_: int) -> float:
            prompts = random_prompts(OFFLINE_N, OFFLINE_IN, vocab, seed=round_)
            outs: list[Any] = []
            seconds = _timed(lambda: outs.extend(engine.generate(prompts, params)))
            return sum(len(o.token_ids) for o in outs) / seconds
    else:
        engine = Engine(model=shape_dir, max_running_requests=OFFLINE_N, **options)
        warm_prompts, warm_params = nano_requests(1000)
        engine.generate(warm_prompts, warm_params)

        def measure(round_: int) -> float:
            prompts, params = nano_requests(round_)
            outs: list[Any] = []
            seconds = _timed(lambda: outs.extend(engine.generate(prompts, params)))
            return sum(len(o.token_ids) for o in outs) / seconds

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps({"value": measure(int(line))}), flush=True)
    engine.shutdown()


class Worker:
    def __init__(self, tree: str, shape_dir: str, workload: str, vocab: int) -> None:
        env = {**os.environ, "PYTHONPATH": tree}
        self.proc = subprocess.Popen(
            [sys.executable, __file__, "--worker", shape_dir, workload, str(vocab)], env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=tree)
        self._read()

    def _read(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                return json.loads(line)
        raise RuntimeError(f"worker exited with {self.proc.wait()}")

    def run(self, round_: int) -> float:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{round_}\n")
        self.proc.stdin.flush()
        return float(self._read()["value"])

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=120)


def main() -> int:
    if sys.argv[1:2] == ["--worker"]:
        worker(sys.argv[2], sys.argv[3], int(sys.argv[4]))
        return 0
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("tree_a")
    parser.add_argument("tree_b")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS))
    args = parser.parse_args()
    from plait.bench.shapes import SHAPES, write_shape_dir

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    root = tempfile.mkdtemp(prefix="plait-ab-")
    rows = []
    for workload in args.workloads:
        shape = WORKLOADS[workload]["shape"]
        shape_dir = str(write_shape_dir(root, shape))
        vocab = SHAPES[shape]["vocab_size"]
        a = Worker(os.path.abspath(args.tree_a), shape_dir, workload, vocab)
        b = Worker(os.path.abspath(args.tree_b), shape_dir, workload, vocab)
        values: dict[str, list[float]] = {"a": [], "b": []}
        for r in range(args.rounds):
            values["a"].append(a.run(r))
            values["b"].append(b.run(r))
            print(f"{workload} round {r}: A {values['a'][-1]:.1f}  B {values['b'][-1]:.1f}", flush=True)
        a.close()
        b.close()
        med_a, med_b = statistics.median(values["a"]), statistics.median(values["b"])
        result = {"workload": workload, "shape": shape, "metric": "tok_s", "tree_a": args.tree_a,
                  "tree_b": args.tree_b, "rounds": values, "median_a": med_a, "median_b": med_b,
                  "b_over_a": med_b / med_a}
        (out / f"ab-{workload}.json").write_text(json.dumps(result, indent=2))
        rows.append(result)
    print(f"{'workload':24} {'A median':>10} {'B median':>10} {'B/A':>7}")
    for r in rows:
        print(f"{r['workload']:24} {r['median_a']:10.1f} {r['median_b']:10.1f} {r['b_over_a']:7.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
