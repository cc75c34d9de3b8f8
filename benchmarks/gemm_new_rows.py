"""What a bf16 GEMM's first call at a row count it has not met costs (CUDA): per projection of a
shape's decoder layer, the host wall time of ``F.linear`` at row counts met for the first time against the
same call again, each timed with a device synchronize on both sides. A serving burst's prefill and
mixed steps meet a new row count (prompt tokens + decode rows) at almost every step; an offline run
that repeats a workload meets none. Then the same with cuBLASLt as torch's preferred BLAS library.
Writes ``OUT_DIR/gemm-new-rows.json``.

    PYTHONPATH=$PWD python benchmarks/gemm_new_rows.py OUT_DIR [--shape llama-3.2-1b]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import time

import torch
import torch.nn.functional as F

from plait.bench.shapes import SHAPES

# Row counts of a 1b burst's steps: full 8192-token chunks plus a growing number of decode rows, a
# lone prompt, and odd counts; each list is met once per library, in order (fresh for the first).
FRESH_ROWS = {"cublas": (8209, 8225, 8241, 513, 1031, 4099, 8257, 8273),
              "cublaslt": (8211, 8227, 8243, 515, 1033, 4101, 8259, 8275)}


def projections(shape: dict[str, int]) -> dict[str, tuple[int, int]]:
    """name -> (out_features, in_features) of one dense decoder layer's projections (the lm_head takes one
    row per sequence, not per token: its row counts are the decode batch sizes the warm-up meets)."""
    h, d = shape["hidden_size"], shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]
    qkv = (shape["num_attention_heads"] + 2 * shape["num_key_value_heads"]) * d
    return {"qkv": (qkv, h), "o": (h, shape["num_attention_heads"] * d),
            "gate_up": (2 * shape["intermediate_size"], h), "down": (h, shape["intermediate_size"])}


def _call_ms(x: torch.Tensor, w: torch.Tensor) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    F.linear(x, w)
    torch.cuda.synchronize()
    return 1e3 * (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shape", default="llama-3.2-1b")
    args = ap.parse_args()
    torch.manual_seed(0)
    weights = {name: torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k ** 0.5
               for name, (n, k) in projections(SHAPES[args.shape]).items()}
    max_rows = max(max(rows) for rows in FRESH_ROWS.values())
    widths = {w.shape[1] for w in weights.values()}
    xs = {k: torch.randn(max_rows, k, device="cuda", dtype=torch.bfloat16) for k in widths}
    for w in weights.values():  # every kernel family loaded once, at a row count not in FRESH_ROWS
        F.linear(xs[w.shape[1]][:8192], w)
    result: dict[str, object] = {"device": torch.cuda.get_device_name(), "shape": args.shape, "libraries": {}}
    for lib, rows in FRESH_ROWS.items():
        torch.backends.cuda.preferred_blas_library(lib)
        per: dict[str, list[dict[str, float]]] = {}
        for name, w in weights.items():
            x = xs[w.shape[1]]
            F.linear(x[:8192], w)  # this library's first call at all
            per[name] = [{"rows": m, "first_ms": _call_ms(x[:m], w), "again_ms": _call_ms(x[:m], w)} for m in rows]
        extra = [r["first_ms"] - r["again_ms"] for rs in per.values() for r in rs]
        result["libraries"][lib] = {"per_projection": per, "median_extra_ms": statistics.median(extra),
                                    "extra_ms_per_new_row_count": sum(extra) / len(rows)}
        print(lib, {n: [round(r["first_ms"] - r["again_ms"], 2) for r in rs] for n, rs in per.items()})
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemm-new-rows.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
