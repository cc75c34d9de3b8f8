"""Benchmarks (docs/benchmarks.md): named workloads on random weights of real shapes, each run beside its
peer (Hugging Face transformers) in the same process, with the physical floor of the metric."""
