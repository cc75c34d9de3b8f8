"""Tensor-parallel group handle, passed to layers (never looked up from a global)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class TPGroup:
    rank: int = 0
    size: int = 1
    group: Any = None  # a torch.distributed ProcessGroup when size > 1

    def __post_init__(self) -> None:
        if not 0 <= self.rank < self.size:
            raise ValueError(f"tp rank must be in [0, {self.size}), got {self.rank}")
        if self.size > 1 and self.group is None:
            raise ValueError("a TPGroup of size > 1 needs its torch.distributed process group")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        torch.distributed.all_reduce(x, group=self.group)
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        torch.distributed.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim=-1)


SINGLE = TPGroup()
