"""Compile the RMSNorm, rotary, decode-attention and MoE down kernels ahead of time for an H200 (sm_90)
without a GPU, as the GPU launches them (with PDL, aligned pointers and sizes), and print per case the
global loads before and after the grid-dependency wait, as JSON lines. Run as a script with
TRITON_INTERPRET unset (tests/test_triton_ops.py does); argument: JSON [kernel, preload] cases (preload:
the PRELOAD constexpr of the PLAIT_PDL_PRELOAD kernels; the MoE down kernel has none and takes False)."""

from __future__ import annotations

import json
import re
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from plait.attention.triton.decode import _decode_stage1_kernel
from plait.layers.moe.small_batch import _small_down_sum_kernel
from plait.layers.triton_ops import _rmsnorm_kernel, _rotary_kernel

RMSNORM = {"X": "*bf16", "R": "*bf16", "W": "*bf16", "Y": "*bf16", "RES_OUT": "*bf16", "stride_x": "i32",
           "stride_r": "i32", "stride_y": "i32", "n_cols": "i32", "eps": "fp32"}
ROTARY = {"Q": "*bf16", "K": "*bf16", "COS_SIN": "*fp32", "POS": "*i64", "stride_q": "i32", "stride_k": "i32",
          "stride_cs": "i32", "n_q_heads": "i32", "n_k_heads": "i32", "V": "*bf16", "K_CACHE": "*bf16",
          "V_CACHE": "*bf16", "LOC": "*i64", "stride_v": "i32", "stride_kc": "i32", "stride_vc": "i32",
          "WQ": "*bf16", "WK": "*bf16", "eps": "fp32", "n_q_blocks": "i32", "n_blocks": "i32"}
DECODE_POINTERS = {"Q": "*bf16", "K_Buffer": "*bf16", "V_Buffer": "*bf16", "Kv_Indptr": "*i32",
                   "Kv_Indices": "*i32", "Num_Kv_Splits": "*i32", "Att_Out": "*fp32", "Att_Lse": "*fp32",
                   "Out": "*bf16", "Split_Counters": "*i32", "Sinks": "*fp32"}
DECODE_CONSTS = dict(GROUP=8, BLOCK_H=16, D=128, DV=128, BLOCK_N=128, MIN_BLOCK_KV=64, MAX_KV_SPLITS=16,
                     USE_LOGIT_CAP=False, INPUT_PRECISION=None, FUSED_REDUCE=True, GPU_FENCE=True, HAS_SINKS=False,
                     USE_PDL=True, KV_PACK=1)
DOWN_POINTERS = {"Act": "*bf16", "W2": "*bf16", "B2": "*bf16", "S2": "*bf16", "topk_ids": "*i32",
                 "topk_weights": "*fp32", "Out": "*bf16"}
# qwen3-30b-a3b at one token: the tuned bs-1 tiles (8 rows of H, 256 of the 768 a step, 8 warps).
DOWN_CONSTS = dict(TOP_K=8, TOP_K_PAD=8, HAS_BIAS=False, BLOCK_H=8, BLOCK_K=256, EVEN_K=True, USE_FP8=False,
                   SCALE_BLOCK=128, USE_PDL=True)
# What the runtime specialises (16-byte aligned pointers, sizes and strides divisible by 16).
UNALIGNED = ("eps", "n_q_heads", "n_k_heads", "n_q_blocks", "n_blocks")


def compile_sm90(kernel: str, preload: bool, overrides: dict | None = None) -> dict[str, int]:
    """``overrides``: constexprs to set besides the case's defaults below."""
    more = overrides or {}
    if kernel == "rmsnorm":
        fn, sig = _rmsnorm_kernel, dict(RMSNORM)
        consts = dict(dict(HAS_RESIDUAL=True, BLOCK=2048, USE_PDL=True, PRELOAD=preload), **more)
    elif kernel == "rotary":  # Qwen3's rotary: q/k norm and the KV store, 4 heads a program
        fn, sig = _rotary_kernel, dict(ROTARY)
        consts = dict(dict(HALF=64, BLOCK_H=4, STORE=True, QK_NORM=True, USE_PDL=True, PRELOAD=preload), **more)
    elif kernel == "decode":  # stage 1 at qwen3-30b-a3b's bs-1 layout (groups of 8, head dim 128), fused merge
        fn, consts = _decode_stage1_kernel, dict(dict(DECODE_CONSTS, PRELOAD=preload), **more)
        names = [n for n in fn.arg_names if n not in consts]
        sig = {n: DECODE_POINTERS.get(n, "fp32" if n in ("sm_scale", "v_scale", "logit_cap") else "i32")
               for n in names}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in DECODE_POINTERS
                 or n.startswith("stride")}
    elif kernel == "moe_down":
        if preload:
            raise ValueError("the MoE down kernel loads nothing before the PDL wait: it has no preload variant")
        fn, consts = _small_down_sum_kernel, dict(DOWN_CONSTS, **more)
        sig = {n: DOWN_POINTERS.get(n, "i32") for n in fn.arg_names if n not in consts}
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in DOWN_POINTERS
                 or n.startswith("stride") or n in ("H", "INTER")}
    if kernel in ("rmsnorm", "rotary"):
        attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(sig) if name not in UNALIGNED}
    sig.update(dict.fromkeys(consts, "constexpr"))
    ptx = triton.compile(ASTSource(fn, sig, consts, attrs), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": 8 if kernel == "moe_down" else 4, "num_stages": 2}).asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    assert wait >= 0, "no grid-dependency wait"
    return {"loads_before_wait": len(re.findall(r"\b(?:ld\.global|cp\.async)", ptx[:wait])),
            "loads_after_wait": len(re.findall(r"\b(?:ld\.global|cp\.async)", ptx[wait:]))}


def compile_in_subprocess(cases: list[tuple]) -> list[dict[str, int]]:
    """Each case compiled by this script in a process without TRITON_INTERPRET; skips without ptxas."""
    from tests.gemv_aot import run_aot_script

    return run_aot_script(__file__, [list(c) for c in cases])


if __name__ == "__main__":
    for kernel, preload, *overrides in json.loads(sys.argv[1]):  # [kernel, preload(, constexpr overrides)]
        print(json.dumps({"kernel": kernel, "preload": preload, **compile_sm90(kernel, preload, *overrides)}))
