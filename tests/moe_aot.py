"""Compile the small-batch MoE down kernel ahead of time for an H100/H200 (sm_90) without a GPU, as the GPU
launches it with PDL and its L2 prefetch, and print what it issues before the grid-dependency wait, as one
JSON line per case. Run as a script with TRITON_INTERPRET unset (tests/test_moe_small_batch.py does);
arguments: JSON [weight dtype, top_k, block_h, block_k, prefetch row bytes] cases."""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from plait.layers.moe.small_batch import _small_down_sum_kernel

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


if __name__ == "__main__":
    for case in json.loads(sys.argv[1]):
        print(json.dumps({"case": case, **compile_down_sm90(*case)}))
