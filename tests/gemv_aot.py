"""Compile the GEMV kernel ahead of time for an H100/H200 (sm_90) without a GPU, with the Triton wheel's
own ptxas, as the GPU launches it (with PDL), and print each launch's register and shared-memory use,
its pipelined loads, its e4m3 warpgroup MMAs, its e4m3 -> wider conversions and the loads it issues
before the grid-dependency wait, as JSON lines. Run as a script with TRITON_INTERPRET unset
(tests/test_gemv.py does); arguments: JSON [kind, m, n, k, config] cases."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from plait.layers.quantization.gemv import _gemv_kernel, plan_launch
from plait.layers.quantization.gemv_config import GemvConfig

WEIGHT = {"fp8_channel": "fp8e4nv", "fp8_block": "fp8e4nv", "fp8_channel_mma": "fp8e4nv", "fp8_block_mma": "fp8e4nv",
          "bf16": "bf16", "fp16": "fp16"}
# The runtime specialises these (16-byte aligned pointers, sizes and strides divisible by 16).
ALIGNED = ("X", "W", "S", "Out", "Bias", "Partials", "Counters", "N", "K", "stride_xm", "stride_wn", "stride_om",
           "k_per_split")


def compile_sm90(kind: str, m: int, n: int, k: int, cfg: GemvConfig) -> dict[str, int]:
    block = (128, 128) if kind.startswith("fp8_block") else None
    w8a8 = kind.endswith("_mma")
    plan = plan_launch(m, n, k, block, cfg, w8a8)
    sig = {"X": "*bf16", "W": f"*{WEIGHT[kind]}", "S": "*fp32", "Out": "*bf16", "Bias": "*bf16", "Partials": "*fp32",
           "Counters": "*i32", **{a: "i32" for a in ("M", "N", "K", "stride_xm", "stride_wn", "stride_sn",
                                                        "stride_om", "k_per_split", "split_k")}}
    consts = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, BLOCK_K=plan.block_k,
                  SCALE=2 if block else (1 if kind.startswith("fp8") else 0), BN_SCALE=block[0] if block else 1,
                  BK_SCALE=block[1] if block else 1, EVEN_K=plan.even_k, SPLIT=plan.split_k > 1,
                  NUM_STAGES=plan.num_stages, INPUT_PRECISION=None, GPU_FENCE=True, UPCAST_DOT=False,
                  W8A8=w8a8, ONE_ROW=plan.one_row, SWAP_AB=plan.swap_ab, HAS_BIAS=False, FP8_MAX_V=448.0, MIN_S=1e-12,
                  USE_PDL=True)
    sig.update(dict.fromkeys(consts, "constexpr"))
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name in ALIGNED}
    kernel = triton.compile(ASTSource(_gemv_kernel, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": plan.num_warps, "num_stages": plan.num_stages})
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(kernel.asm["cubin"])
        f.flush()
        tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
        usage = subprocess.run([tool, "-res-usage", f.name], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+).*?STACK:(\d+)", usage, re.S)
    ptx = kernel.asm["ptx"]
    assert found, usage
    assert "griddepcontrol.wait" in ptx, "the PDL prologue's wait is missing"
    return {"regs": int(found.group(1)), "stack": int(found.group(2)), "shared": kernel.metadata.shared,
            "pipelined_loads": kernel.asm["ttgir"].count("async_copy_global_to_local"),
            "wgmma_e4m3": len(re.findall(r"wgmma\.mma_async\.\S*\.e4m3\.e4m3", ptx)),
            "wgmma": len(re.findall(r"wgmma\.mma_async", ptx)),
            "e4m3_widened": len(re.findall(r"cvt\.\S*\.(?:f16x2|bf16x2|f32)\.e4m3x2", ptx)),
            "loads_before_wait": len(re.findall(r"\b(?:ld\.global|cp\.async)", ptx[: ptx.find("griddepcontrol.wait")]))}


def compile_defaults_in_subprocess(kinds: tuple[str, ...], shapes: tuple[tuple[int, int], ...],
                                   ms: tuple[int, ...] = (1, 16)) -> list[dict[str, int]]:
    """Each kind's default config at each (N, K) and M compiled by this script in a process without
    TRITON_INTERPRET (tests run in the interpreter); its JSON lines. Skips without the wheel's ptxas."""
    from plait.layers.quantization.gemv_config import default_config

    work = [(kind, m, n, k, default_config(kind, m, n, k, 132).to_json())
            for kind in kinds for m in ms for n, k in shapes]
    return run_aot_script(__file__, work)


def run_aot_script(script: str, work: list) -> list[dict]:
    """Run an ahead-of-time compile ``script`` (this one, tests/layer_ops_aot.py) on the JSON ``work`` list
    in a process without TRITON_INTERPRET; one JSON line back per case. Skips without the wheel's ptxas."""
    import pathlib

    import pytest

    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").is_file():
        pytest.skip("this triton wheel has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(pathlib.Path(__file__).parent.parent)
    done = subprocess.run([sys.executable, script, json.dumps(work)], env=env, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == len(work)
    return results


if __name__ == "__main__":
    for kind, m, n, k, raw in json.loads(sys.argv[1]):
        print(json.dumps({"kind": kind, "m": m, **compile_sm90(kind, m, n, k, GemvConfig.from_json(raw))}))
