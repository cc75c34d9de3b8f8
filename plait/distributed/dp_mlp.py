"""DP attention around the MLP (DESIGN 3.4): the tokens of every rank meet at the TP-sharded MLP.

Each rank attends over its own requests; before the MLP its rows join those of the other ranks,
the sharded MLP runs over all of them, and since the row-parallel down projection leaves partial
sums, they are reduced and each rank keeps its own rows. The layout is the step's padding mode:

  SUM_LEN  a zero buffer of the summed length; each rank writes its rows at its offset and an
           all-reduce assembles the buffer; after the MLP (whose down projection all-reduces) each
           rank slices its rows back out.
  MAX_LEN  every rank pads to the longest; all-gather before; after the MLP each rank keeps its
           chunk. The reduction is the down projection's all-reduce followed by the slice: the
           same numbers as a reduce-scatter, which gloo does not have (on NCCL a reduce-scatter
           would move less data; not done yet).

A rank with no tokens (IDLE) passes an empty tensor and still joins every collective.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.distributed.parallel_state import TPGroup
from plait.forward_batch import DPPaddingMode, ForwardBatch


def dp_gathered_mlp(mlp: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, fb: ForwardBatch,
                    group: TPGroup) -> torch.Tensor:
    counts = fb.global_num_tokens_cpu
    if counts is None or fb.dp_padding_mode is None:
        raise RuntimeError("a DP-attention forward needs its MLP-sync metadata (init_mlp_sync_metadata) and "
                           "padding mode")
    n = hidden.shape[0]
    if n != counts[group.rank]:
        raise RuntimeError(f"rank {group.rank} has {n} tokens but the step's counts say {counts[group.rank]}")
    if fb.dp_padding_mode == DPPaddingMode.MAX_LEN:
        longest = max(counts)
        padded = hidden.new_zeros(longest, hidden.shape[1])
        padded[:n] = hidden
        out = mlp(group.all_gather_first_dim(padded))
        start = group.rank * longest
        return out[start : start + n]
    offset = sum(counts[: group.rank])
    buf = hidden.new_zeros(sum(counts), hidden.shape[1])
    buf[offset : offset + n] = hidden
    out = mlp(group.all_reduce(buf))
    return out[offset : offset + n]
