"""Quantized weights and KV-cache scales (docs/quantization.md).

``fp8``: the FP8 checkpoint formats and online FP8 quantization, and ``Fp8LinearMethod``, the object a
quantized linear layer holds; ``fp8_kernels``: its matmuls (Triton GEMV, block-scaled GEMM,
``torch._scaled_mm``) and the dequantizing CPU reference; ``gemv``: the small-M GEMV (FP8 and bf16 /
fp16 weights, one launch) with its launch configs as data (``gemv_config``, ``configs/``);
``kv_cache``: the checkpoint's per-layer KV-cache scales.
"""
