"""Helpers shared by tests, the demo and benchmarks: tiny random Hugging Face checkpoints."""

from plait.testing.tiny_model import TINY_ARCHS, demo_model_path, make_tiny_model

__all__ = ["TINY_ARCHS", "demo_model_path", "make_tiny_model"]
