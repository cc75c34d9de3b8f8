"""plait: a compact LLM serving engine."""

from plait.engine import Engine, RequestOutput, StreamChunk
from plait.sampling import SamplingParams

__all__ = ["Engine", "RequestOutput", "SamplingParams", "StreamChunk"]
__version__ = "0.1.0"
