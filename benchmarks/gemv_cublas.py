"""The small-M GEMV against cuBLAS (bf16 weights, CUDA): per llama-3.1-8b projection and its lm_head and
per token count, the GEMV on the config in force (this device's table, else the default) against
``F.linear`` (``plait.bench.gemv_tune.compare_cublas``). Writes ``OUT_DIR/gemv-cublas.json``.

    PYTHONPATH=$PWD python benchmarks/gemv_cublas.py OUT_DIR [--shapes llama-3.1-8b] [--m 1,2,4,8,16]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from plait.bench.gemv_tune import compare_cublas
from plait.bench.shapes import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shapes", default="llama-3.1-8b")
    ap.add_argument("--m", default="1,2,4,8,16")
    args = ap.parse_args()
    shapes = tuple(s for s in args.shapes.split(",") if s)
    extra = {f"{s}/lm_head": (SHAPES[s]["vocab_size"], SHAPES[s]["hidden_size"]) for s in shapes}
    rows = compare_cublas(shapes, tuple(int(m) for m in args.m.split(",")), extra)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv-cublas.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                     indent=1) + "\n")


if __name__ == "__main__":
    main()
