"""Tune the small-M GEMV's launch configs on this GPU (CUDA only) and write them as data.

For the llama-3.1-8b and llama-3.2-1b projections (qkv, o, gate_up, down), weight kinds fp8_channel,
bf16 and fp8_block, and M in 1, 2, 4, 8, 16, every candidate config is timed under CUDA-graph replay
with the weights rotated past the L2 (plait.bench.gemv_tune). The fastest per case goes into
``gemv_<device>.json`` in ``--out`` (merged into a file already there), the file
``plait.layers.quantization.gemv_config`` reads: from ``plait/layers/quantization/configs/`` (the
default ``--out``), or from any directory named by ``PLAIT_GEMV_CONFIG_DIR``, so a fresh tune can
serve a run in the same session:

  python benchmarks/tune_gemv.py --out $OUT/gemv-configs && \\
      PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python -m plait bench quant --workload gemm decode-bs1 --out $OUT

``--budget-s`` bounds the sweep (compiles included; cases not reached keep the default config).
The per-case timings (best and default config, TB/s) go to ``--report`` (default: beside the table).

The FP8 W8A8 kinds (``fp8_channel_mma``, ``fp8_block_mma``: activations quantized in the kernel,
e4m3 x e4m3 tensor-core dots) are tuned when ``--kinds`` names them. ``--compare`` then times both FP8
forms, weight-only and W8A8, per shape and M on the tables in force (run it with
``PLAIT_GEMV_CONFIG_DIR`` naming ``--out`` so the fresh entries are read) into
``compare_fp8_forms.json`` beside the table, and marks the weight-only entries of the cases where W8A8
was at least 5% faster with ``prefer_w8a8`` (unmarks the others): what calls take by default.

  PLAIT_GEMV_CONFIG_DIR=$OUT/gemv-configs python benchmarks/tune_gemv.py --out $OUT/gemv-configs \\
      --shapes llama-3.1-8b --kinds fp8_channel_mma,fp8_block_mma --m 1,16 --compare
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from plait.bench.gemv_tune import (  # noqa: E402
    MMA_KINDS,
    TUNED_KINDS,
    TUNED_SHAPES,
    compare_forms,
    tune,
    w8a8_preferences,
)
from plait.layers.quantization import gemv_config  # noqa: E402
from plait.layers.quantization.gemv_config import CONFIG_DIR, M_BUCKETS, config_file_name  # noqa: E402


def _csv(raw: str) -> tuple[str, ...]:
    return tuple(v for v in raw.split(",") if v)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(CONFIG_DIR), help="directory of the config table")
    ap.add_argument("--shapes", default=",".join(TUNED_SHAPES))
    ap.add_argument("--kinds", default=",".join(TUNED_KINDS),
                    help=f"of fp8_channel, fp8_block, bf16, fp16, {', '.join(MMA_KINDS)} (the FP8 W8A8 form)")
    ap.add_argument("--m", default=",".join(map(str, M_BUCKETS)), help="token buckets")
    ap.add_argument("--budget-s", type=float, default=55.0, help="stop starting cases after this long")
    ap.add_argument("--jobs", type=int, default=max(1, min(12, (os.cpu_count() or 2) - 2)),
                    help="processes that precompile the candidates (1: compile in the timing loop)")
    ap.add_argument("--report", help="per-case timings (JSON); default: tune_gemv_report.json in --out")
    ap.add_argument("--wide", action="store_true",
                    help="at 2..16 tokens also try WIDE_DOT_TILES (plait.bench.gemv_tune): a longer search")
    ap.add_argument("--compare", action="store_true",
                    help="after tuning: FP8 weight-only vs W8A8 per shape and --m on the tables in force")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("tune_gemv.py needs a CUDA GPU")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name()
    path = out / config_file_name(device)
    report = pathlib.Path(args.report) if args.report else out / "tune_gemv_report.json"
    existing = json.loads(path.read_text()) if path.is_file() else {}

    def save(table: dict, rows: list) -> None:
        merged = json.loads(json.dumps(existing))
        for kind, shapes in table.items():
            for shape, buckets in shapes.items():
                merged.setdefault(kind, {}).setdefault(shape, {}).update(buckets)
        path.write_text(json.dumps(merged, indent=1, sort_keys=True) + "\n")
        report.write_text(json.dumps({"device": device, "rows": rows}, indent=1) + "\n")

    table, rows = tune(_csv(args.shapes), _csv(args.kinds), tuple(int(m) for m in _csv(args.m)), args.budget_s,
                       args.jobs, save, wide=args.wide)
    save(table, rows)
    print(f"wrote {path} ({sum(len(b) for s in table.values() for b in s.values())} entries) and {report}")
    if args.compare:
        gemv_config.clear_cache()  # the table just written
        compared_rows = compare_forms(_csv(args.shapes), tuple(int(m) for m in _csv(args.m)))
        compared = out / "compare_fp8_forms.json"
        compared.write_text(json.dumps({"device": device, "gemv_config_dirs": [str(d) for d in
                                        gemv_config.config_dirs()], "rows": compared_rows}, indent=1) + "\n")
        num_sms = torch.cuda.get_device_properties(0).multi_processor_count
        preferred = w8a8_preferences(compared_rows, lambda kind, m, n, k: gemv_config.get_config(
            kind, m, n, k, device, num_sms))
        for kind, shapes in preferred.items():
            for shape, buckets in shapes.items():
                table.setdefault(kind, {}).setdefault(shape, {}).update(buckets)
        save(table, rows)
        chosen = [f"{r['kind']} N{r['N']} K{r['K']} M{r['M']}" for r in compared_rows if
                  preferred[r["kind"]][gemv_config.shape_key(r["N"], r["K"])][str(r["M"])].get("prefer_w8a8")]
        print(f"compare: wrote {compared}; W8A8 preferred (>= 5% faster) at: {', '.join(chosen) or 'none'}")


if __name__ == "__main__":
    main()
