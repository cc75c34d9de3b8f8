"""Test helpers: tiny random Hugging Face checkpoints and random EAGLE heads (for tests and
benchmarks only; production code imports the writers from ``plait.models`` directly)."""

from plait.models.eagle_heads import make_eagle_head
from plait.models.tiny import TINY_ARCHS, TINY_MOE_ARCHS, demo_model_path, make_tiny_model

__all__ = ["TINY_ARCHS", "TINY_MOE_ARCHS", "demo_model_path", "make_eagle_head", "make_tiny_model"]
