#!/usr/bin/env bash
# One device call for the feature measurements, in priority order under one deadline: the GPU tests
# of structured outputs / FP8 / GGUF / the native API / fused MoE, then structured-overhead, the FP8
# benchmarks (GEMM sweep, decode-bs1, offline-throughput), the MoE end-to-end runs against
# transformers, and two-batch overlap's cost on one GPU. Needs .whl (xgrammar, gguf, ...) carried and
# installed, and bench-tokenizer/ (SmolLM2's tokenizer files) carried. Results under $OUT/r.
export PYTHONPATH=$PWD:${PYTHONPATH:-} PYTHONUNBUFFERED=1
R=$OUT/r; mkdir -p "$R"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
source benchmarks/deadline.sh
stage 150 python -m pytest -q -m gpu tests/gpu/test_structured_gpu.py tests/gpu/test_fp8_gpu.py \
  tests/gpu/test_gguf_gpu.py tests/gpu/test_sglang_api_gpu.py tests/gpu/test_fused_moe_gpu.py \
  -p no:cacheprovider -o addopts="" 2>&1 | tee "$R/gpu-tests.log" | tail -15
stage 70 python -m plait bench structured --tokenizer bench-tokenizer --out "$R" 2>&1 | tail -4
OUT=$R stage 140 bash benchmarks/run_h200.sh fp8
stage 60 python -m plait bench offline --workload offline-throughput --shape llama-3.1-8b --tbo-peer \
  --out "$R" 2>&1 | tail -2
OUT=$R stage 170 bash benchmarks/run_h200.sh moe
echo "=== done $(date +%T)"
