"""Compile the small-batch MoE kernels ahead of time for an H100/H200 (sm_90) without a GPU, as the GPU
launches them with PDL: the down kernel with its L2 prefetch (what it issues before the grid-dependency
wait) and the gate/up kernel with its weights' L2 eviction policy, as one JSON line per case. Run as a
script with TRITON_INTERPRET unset (tests/test_moe_small_batch.py does); arguments: JSON cases,
["down", weight dtype, top_k, block_h, block_k, prefetch row bytes] or ["gate_up", weight eviction]."""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from plait.layers.moe.small_batch import _small_down_sum_kernel, _small_gate_up_kernel

POINTERS = ("Act", "W2", "B2", "S2", "topk_ids", "topk_weights", "Out")
INTS = ("H", "INTER", "num_experts", "stride_am", "stride_we", "stride_wh", "stride_be", "stride_om",
        "stride_se", "stride_sh")


def compile_down_sm90(weight: str, top_k: int, block_h: int, block_k: int, prefetch: int) -> dict[str, int]:
    types = {"Act": "*bf16", "W2": f"*{weight}", "B2": "*bf16", "S2": "*fp32", "topk_ids": "*i32",
             "topk_weights": "*fp32", "Out": "*bf16"}
    sig = {**{name: types[name] for name in POINTERS}, **dict.fromkeys(INTS, "i32")}
    consts = dict(TOP_K=top_k, TOP_K_PAD=triton.next_power_of_2(top_k), HAS_BIAS=False, BLOCK_H=block_h,
                  BLOCK_K=block_k, EVEN_K=True, USE_FP8=weight == "fp8e4nv", SCALE_BLOCK=128, USE_PDL=True,
                  PREFETCH_ROW_BYTES=prefetch)
    sig.update(dict.fromkeys(consts, "constexpr"))
    kernel = triton.compile(ASTSource(_small_down_sum_kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 8, "num_stages": 3})
    ptx = kernel.asm["ptx"]
    before = ptx[: ptx.find("griddepcontrol.wait")]
    return {"prefetches_before_wait": before.count("prefetch.global.L2"),
            "l2_loads_before_wait": len(re.findall(r"\bld\.global\.cg\b", before)),
            "other_loads_before_wait": len(re.findall(r"\b(?:ld\.global(?!\.cg)|cp\.async)", before))}


def compile_gate_up_sm90(eviction: str) -> dict[str, int]:
    sig = {"X": "*bf16", "W13": "*bf16", "B13": "*bf16", "S13": "*fp32", "topk_ids": "*i32", "Act": "*bf16",
           **dict.fromkeys(("H", "INTER", "num_experts", "stride_xm", "stride_we", "stride_wn", "stride_be",
                            "stride_am", "stride_se", "stride_sn"), "i32")}
    consts = dict(TOP_K=8, HAS_BIAS=False, ACTIVATION=0, ALPHA=1.702, LIMIT=7.0, BLOCK_N=16, BLOCK_K=256, EVEN_K=True,
                  USE_FP8=False, SCALE_BLOCK=128, USE_PDL=True, WEIGHT_EVICTION=eviction)
    sig.update(dict.fromkeys(consts, "constexpr"))
    kernel = triton.compile(ASTSource(_small_gate_up_kernel, sig, consts, {}), target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 8, "num_stages": 3})
    return {"l2_evict_first_policies": kernel.asm["ptx"].count("createpolicy.fractional.L2::evict_first")}


if __name__ == "__main__":
    for kind, *case in json.loads(sys.argv[1]):
        result = compile_down_sm90(*case) if kind == "down" else compile_gate_up_sm90(*case)
        print(json.dumps({"case": [kind, *case], **result}))
