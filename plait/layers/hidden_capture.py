"""HiddenCapture: target hidden states an EAGLE draft head reads, written by the model itself.

EAGLE reads the final normed hidden state of every token (slot -1); EAGLE3 the residual-stream inputs
of three layers, concatenated. The model writes them with ``store`` during its forward, so a captured
CUDA graph writes them on every replay too (forward hooks are Python and do not run on replay).

Where they land (the invariant readers rely on): a forward of T tokens writes into
``static[:T]`` when T <= ``static_rows`` (every graph-replayed forward: the runners size ``static``
for their largest batch before capturing, and it is never reallocated), else into a fresh tensor
made by ``begin``. ``read(T)`` follows the same rule, so it returns the rows of the latest forward of
T tokens, replayed or eager. The rows are views: a reader keeps what it needs across forwards by
copying (the next target forward overwrites them).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


class HiddenCapture:
    def __init__(self, layers: Sequence[int], hidden_size: int, static_rows: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        """``layers``: decoder-layer indices whose input (hidden + residual) is captured, or -1 for the
        final normed hidden, in output column order. ``static_rows``: the most tokens a graph runs."""
        self.layers = tuple(layers)
        # layer -> its column blocks (a small target can repeat a layer: EAGLE3 over 4 layers is [2, 2, 1])
        self.slots: dict[int, list[int]] = {}
        for i, layer in enumerate(self.layers):
            self.slots.setdefault(layer, []).append(i)
        self.hidden_size = hidden_size
        self.width = hidden_size * len(self.layers)
        self.static_rows = static_rows
        self.static = torch.zeros(static_rows, self.width, dtype=dtype, device=device)
        self._fresh: torch.Tensor | None = None  # the latest eager forward's rows when T > static_rows

    def begin(self, num_tokens: int) -> None:
        """A forward of ``num_tokens`` starts (called by the model, inside a captured region too)."""
        if num_tokens > self.static_rows:
            self._fresh = torch.empty(num_tokens, self.width, dtype=self.static.dtype, device=self.static.device)

    def _rows(self, num_tokens: int) -> torch.Tensor:
        if num_tokens <= self.static_rows:
            return self.static[:num_tokens]
        assert self._fresh is not None and self._fresh.shape[0] >= num_tokens, "begin() the forward first"
        return self._fresh[:num_tokens]

    def store(self, layer: int, hidden: torch.Tensor) -> None:
        """hidden [T, hidden_size] of capture layer ``layer`` into its columns."""
        rows, h = self._rows(hidden.shape[0]), self.hidden_size
        for slot in self.slots[layer]:
            rows[:, slot * h : (slot + 1) * h].copy_(hidden)

    def read(self, num_tokens: int) -> torch.Tensor:
        """[num_tokens, width]: the rows of the latest forward of at least that many tokens (a view)."""
        return self._rows(num_tokens)
