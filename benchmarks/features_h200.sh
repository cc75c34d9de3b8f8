#!/usr/bin/env bash
# One device call for the feature measurements, in priority order under one deadline: the GPU tests
# of structured outputs / FP8 / GGUF / the native API / fused MoE, then structured-overhead, the FP8
# benchmarks (GEMM sweep, decode-bs1, offline-throughput), two-batch overlap's cost on one GPU and
# the MoE end-to-end runs against transformers. Needs .whl (xgrammar, gguf, ...) carried and
# installed, and bench-tokenizer/ (SmolLM2's tokenizer files) carried. Results under $OUT/r.
exec bash benchmarks/staged_h200.sh 150:feature-tests 70:structured 140:fp8 60:tbo-cost 170:moe
