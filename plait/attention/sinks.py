"""Attention sinks in float32 at the kernel's call site (docs/architecture.md 3.5).

A sink model keeps its per-head sink logits in the model dtype (bf16 on a GPU); the kernels read
them in float32. Converting on every layer of every step would launch a kernel per layer, so each
backend keeps a cache keyed by the tensor's identity and its ``_version``: a weight updated in
place (``copy_`` under ``no_grad``/``inference_mode`` bumps ``_version``) is converted again, never
served stale. During a graph capture the conversion is recorded unconditionally: a cached copy
would be baked into the graph, and replays would keep reading it after the weight changed.
"""

from __future__ import annotations

import torch


class Float32Cache:
    """float32 views of parameters, converted once per (tensor, version)."""

    def __init__(self) -> None:
        # id(tensor) -> (the tensor itself, its _version when converted, the float32 copy). Holding
        # the tensor guards against a new tensor reusing a dead one's id.
        self._entries: dict[int, tuple[torch.Tensor, int, torch.Tensor]] = {}
        self.conversions = 0  # copies made, cached or not (tests read it)

    def get(self, t: torch.Tensor, capturing: bool) -> torch.Tensor:
        if t.dtype == torch.float32:
            return t  # the parameter itself: always current
        if capturing or (t.is_cuda and torch.cuda.is_current_stream_capturing()):
            self.conversions += 1
            return t.float()
        entry = self._entries.get(id(t))
        if entry is not None and entry[0] is t and entry[1] == t._version:
            return entry[2]
        converted = t.detach().float()
        self.conversions += 1
        self._entries[id(t)] = (t, t._version, converted)
        return converted
