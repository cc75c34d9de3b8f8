"""The small-M GEMV's two forms at a speculative verify's 2-4 tokens (bf16 weights, CUDA): the tensor-core
form on its table config against the elementwise-rows form on the one-token config (and that config
with twice its step), one token and cuBLAS beside them, per llama-3.1-8b projection and its lm_head
(``plait.bench.gemv_tune.compare_rows``). Writes ``OUT_DIR/gemv-rows.json``.

    PYTHONPATH=$PWD python benchmarks/gemv_rows.py OUT_DIR [--shapes llama-3.1-8b] [--m 1,2,3,4]
"""

from __future__ import annotations

import argparse
import json
import pathlib

import torch

from plait.bench.gemv_tune import compare_rows
from plait.bench.shapes import SHAPES


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out")
    ap.add_argument("--shapes", default="llama-3.1-8b")
    ap.add_argument("--m", default="1,2,3,4")
    args = ap.parse_args()
    shapes = tuple(s for s in args.shapes.split(",") if s)
    extra = {f"{s}/lm_head": (SHAPES[s]["vocab_size"], SHAPES[s]["hidden_size"]) for s in shapes}
    rows = compare_rows(shapes, tuple(int(m) for m in args.m.split(",")), extra)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gemv-rows.json").write_text(json.dumps({"device": torch.cuda.get_device_name(), "rows": rows},
                                                   indent=1) + "\n")


if __name__ == "__main__":
    main()
