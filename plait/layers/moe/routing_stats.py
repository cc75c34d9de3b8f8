"""How many distinct experts each sparse layer's forward routes its tokens to, counted on the device
for benchmarks (the decode floor reads exactly those experts' weights: plait.bench.workloads).

Off by default: a ``SparseMoeBlock`` records only when a counter is attached (``attach``; the model
runner does so under PLAIT_COUNT_ROUTED_EXPERTS=1, before CUDA graphs are captured, so replays record
too). ``record`` is device work only (no host sync, no host-to-device copy), hence graph-safe: the
distinct ids of the step's ``topk_ids`` counted, then two writes at a device-side cursor into a ring
of ``capacity`` calls. On CUDA that is one Triton launch per layer call (``fused``; torch's form is
seven or eight small launches, which would inflate the very decode steps a benchmark times), on
the CPU a ``[E]`` bool scatter and its sum. Under tensor or expert parallelism every rank routes
every token of the step, so rank 0's counts are the step's.
"""

from __future__ import annotations

import torch
from torch import nn

DEFAULT_CAPACITY = 1 << 16  # calls kept (the ring overwrites the oldest): ~1 MiB of int64 pairs


class RoutedExpertCounter:
    """A ring of (tokens, distinct experts) per recorded sparse-layer call, shared by a model's layers."""

    def __init__(self, num_experts: int, device: torch.device | str, capacity: int = DEFAULT_CAPACITY) -> None:
        if num_experts < 1 or capacity < 1:
            raise ValueError(f"num_experts ({num_experts}) and capacity ({capacity}) must be >= 1")
        self.num_experts = num_experts
        self.capacity = capacity
        self.tokens = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.distinct = torch.zeros(capacity, dtype=torch.int64, device=device)
        self.cursor = torch.zeros(1, dtype=torch.int64, device=device)  # calls recorded since reset

    def record(self, topk_ids: torch.Tensor, fused: bool | None = None) -> None:
        """One layer's routing ``topk_ids [T, k]`` (global expert ids in [0, E); others are not
        counted). ``fused``: the one-launch Triton kernel, by default on CUDA."""
        if topk_ids.is_cuda if fused is None else fused:
            from plait.layers.moe.routing_stats_triton import record_routing

            record_routing(topk_ids, self.num_experts, self.tokens, self.distinct, self.cursor)
            return
        ids = topk_ids.reshape(-1).long()
        e = self.num_experts
        # Ids outside [0, E) land in a spare slot E that is not summed (no data-dependent shapes).
        seen = torch.zeros(e + 1, dtype=torch.bool, device=topk_ids.device)
        seen.index_fill_(0, torch.where((ids >= 0) & (ids < e), ids, e), True)
        slot = self.cursor % self.capacity
        self.tokens.index_fill_(0, slot, topk_ids.shape[0])
        self.distinct.index_copy_(0, slot, seen[:e].sum().view(1))
        self.cursor += 1

    def reset(self) -> None:
        self.cursor.zero_()

    def calls(self) -> list[tuple[int, int]]:
        """(tokens, distinct experts) of each call since ``reset``, oldest first (the last ``capacity``)."""
        n = int(self.cursor.item())
        kept = min(n, self.capacity)
        order = [(n - kept + i) % self.capacity for i in range(kept)]
        tokens, distinct = self.tokens.tolist(), self.distinct.tolist()
        return [(tokens[i], distinct[i]) for i in order]

    def mean_distinct_by_tokens(self) -> dict[int, float]:
        """Token count of a call -> the mean distinct experts over the calls with that many tokens."""
        sums: dict[int, list[int]] = {}
        for tokens, distinct in self.calls():
            acc = sums.setdefault(tokens, [0, 0])
            acc[0] += distinct
            acc[1] += 1
        return {t: s / n for t, (s, n) in sorted(sums.items())}


def sparse_blocks(model: nn.Module) -> list[nn.Module]:
    """The model's modules that route tokens to experts (they carry a ``routing_counter`` slot)."""
    return [m for m in model.modules() if hasattr(m, "routing_counter")]


def attach(model: nn.Module, device: torch.device | str, capacity: int = DEFAULT_CAPACITY
           ) -> RoutedExpertCounter | None:
    """One counter shared by every sparse layer of ``model`` (None for a dense model)."""
    blocks = sparse_blocks(model)
    if not blocks:
        return None
    counter = RoutedExpertCounter(blocks[0].router_config.num_experts, device, capacity)
    for block in blocks:
        block.routing_counter = counter
    return counter


def counter_of(model: nn.Module) -> RoutedExpertCounter | None:
    """The counter ``attach`` put on ``model``, if any."""
    return next((b.routing_counter for b in sparse_blocks(model) if b.routing_counter is not None), None)
