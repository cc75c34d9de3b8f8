from plait.engine.engine import Engine
from plait.engine.outputs import RequestOutput, StreamChunk

__all__ = ["Engine", "RequestOutput", "StreamChunk"]
