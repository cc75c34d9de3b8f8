"""DP attention around the MLP (DESIGN 3.4): the tokens of every rank meet at the TP-sharded MLP.

Each rank attends over its own requests; before the MLP its rows join those of the other ranks,
the sharded MLP runs over all of them, and since the row-parallel down projection leaves partial
sums, they are reduced and each rank keeps its own rows. The layout is the step's padding mode:

  SUM_LEN  a buffer of the summed length, each rank's rows at its offset (an all-gather of
           uneven counts); after the MLP a reduce-scatter of the partial sums leaves each rank the
           sums of its own rows.
  MAX_LEN  every rank pads to the longest, then the same with equal counts. Graph replays are
           MAX_LEN steps whose every rank holds the bucket's rows, so the padding copy is skipped
           there.

Both are ``TPGroup.all_gather_rows`` before the MLP and ``reduce_scatter_rows`` after it: half the
bytes of the all-reduces that assembling a zero buffer would need (the SUM_LEN extend rounds move
two buffers of every rank's rows per layer). Large SUM_LEN rounds run in row slices so that the
collectives overlap the GEMMs (below).

A rank with no tokens (IDLE) passes an empty tensor and still joins every collective.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from plait.distributed.parallel_state import TPGroup
from plait.forward_batch import DPPaddingMode, ForwardBatch

if TYPE_CHECKING:
    from plait.models.llama import LlamaMLP


# SUM_LEN rounds carry prefill chunks: each collective moves tens of MB (8192 rows of 4096 bf16 per
# rank is 64 MB), long enough to hide behind the MLP GEMMs. Such a round runs the MLP in row slices:
# every slice's gather is issued at once, and each slice's reduce-scatter is issued as soon as its
# partial sums exist, so NCCL moves slice i + 1 (and reduces slice i - 1) while slice i computes; only
# the first gather and the last reduce-scatter stay exposed. Below PIPELINE_ROWS rows per rank a
# slice's collectives are latency-bound and slicing would only add launches.
PIPELINE_ROWS = 2048
MAX_SLICES = 4


def dp_gathered_mlp(mlp: LlamaMLP, hidden: torch.Tensor, fb: ForwardBatch, group: TPGroup,
                    pipeline_rows: int = PIPELINE_ROWS) -> torch.Tensor:
    counts = fb.global_num_tokens_cpu
    if counts is None or fb.dp_padding_mode is None:
        raise RuntimeError("a DP-attention forward needs its MLP-sync metadata (init_mlp_sync_metadata) and "
                           "padding mode")
    n = hidden.shape[0]
    if n != counts[group.rank]:
        raise RuntimeError(f"rank {group.rank} has {n} tokens but the step's counts say {counts[group.rank]}")
    if fb.dp_padding_mode == DPPaddingMode.MAX_LEN:
        longest = max(counts)
        if n < longest:
            padded = hidden.new_zeros(longest, hidden.shape[1])
            padded[:n] = hidden
            hidden = padded
        rows = [longest] * group.size
        slices = 1
    else:
        rows = list(counts)
        slices = max(1, min(MAX_SLICES, min(rows) // pipeline_rows))
    # Rank r's slice i is its rows [rows[r] * i // slices, rows[r] * (i + 1) // slices); every rank
    # computes every rank's bounds, so the slices' counts agree everywhere.
    bounds = [[c * i // slices for i in range(slices + 1)] for c in rows]
    mine = bounds[group.rank]
    slice_counts = [[b[i + 1] - b[i] for b in bounds] for i in range(slices)]
    gathers = [group.all_gather_rows_async(hidden[mine[i] : mine[i + 1]], slice_counts[i]) for i in range(slices)]
    scatters = [group.reduce_scatter_rows_async(mlp.forward_partial(g.wait()), c)
                for g, c in zip(gathers, slice_counts, strict=True)]
    reduced = scatters[0].wait() if slices == 1 else torch.cat([s.wait() for s in scatters])
    return mlp.down_proj.add_bias(reduced[:n])
