"""Benchmarks of DESIGN 7: named workloads on random weights of real shapes, each run beside its
peer (Hugging Face transformers) in the same process, with the physical floor of the metric."""
