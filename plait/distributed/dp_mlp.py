"""DP attention around the MLP: the tokens of every rank meet at the TP-sharded MLP.

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
two buffers of every rank's rows per layer).

The NCCL collectives are not overlapped with the GEMMs. Running the MLP of a SUM_LEN round in row
slices, with each slice's gather and reduce-scatter in flight while another slice computes, was
slower than the whole MLP, and more so with more slices: NCCL's kernels take SMs from the GEMMs they
run beside, which costs more than the transfer time they would hide. On CUDA the rows go through
symmetric memory instead (``fb.dp_row_exchange``, ``plait.distributed.copy_engine_rows``): SUM_LEN
rounds by copy engine beside the GEMMs of a rank's own rows, MAX_LEN rounds (decode, and its graphs)
by two Triton kernels that store into the peers' buffers (``p2p_rows_kernels``, faster than NCCL at
decode sizes, where NCCL's cost is mostly latency).

A rank with no tokens (IDLE) passes an empty tensor and still joins every collective. Under two-batch
overlap each micro-batch exchanges its own rows (``dp_mlp_ops``): one's gather or reduce-scatter is
in flight while the other computes.
"""

from __future__ import annotations

import functools

import torch

from plait.distributed.parallel_state import CollectiveOps, TPGroup, run_serially
from plait.forward_batch import DPPaddingMode, ForwardBatch, ShardedMLP


def dp_gathered_mlp(mlp: ShardedMLP, hidden: torch.Tensor, fb: ForwardBatch, group: TPGroup) -> torch.Tensor:
    return run_serially(dp_mlp_ops(mlp, hidden, fb, group))


def dp_mlp_ops(mlp: ShardedMLP, hidden: torch.Tensor, fb: ForwardBatch, group: TPGroup) -> CollectiveOps[torch.Tensor]:
    """The gathered MLP cut at its two collectives (the gather of every rank's rows, the
    reduce-scatter of the partial sums): two-batch overlap runs one micro-batch's while the other
    computes. The symmetric-memory exchange runs whole (its copies already overlap its GEMMs). Which
    path runs depends only on the step's global counts, so every rank yields alike."""
    counts = fb.mlp_sync.global_num_tokens_cpu
    if counts is None or fb.mlp_sync.padding_mode is None:
        raise RuntimeError("a DP-attention forward needs its MLP-sync metadata (init_mlp_sync_metadata) and "
                           "padding mode")
    n = hidden.shape[0]
    if n != counts[group.rank]:
        raise RuntimeError(f"rank {group.rank} has {n} tokens but the step's counts say {counts[group.rank]}")
    exchange = fb.dp_row_exchange
    if fb.mlp_sync.padding_mode == DPPaddingMode.SUM_LEN and exchange is not None and exchange.fits(counts):
        return exchange.mlp(mlp, hidden, counts)
    if fb.mlp_sync.padding_mode == DPPaddingMode.MAX_LEN:
        longest = max(counts)
        if n < longest:
            padded = hidden.new_zeros(longest, hidden.shape[1])
            padded[:n] = hidden
            hidden = padded
        if exchange is not None and exchange.fits(counts):
            return exchange.mlp_equal(mlp, hidden)[:n]
        rows = [longest] * group.size
    else:
        rows = list(counts)
    gathered = yield functools.partial(group.all_gather_rows_start, hidden, rows)
    partial = mlp.forward_partial(gathered)
    reduced = yield functools.partial(group.reduce_scatter_rows_start, partial, rows)
    return mlp.add_bias(reduced[:n])
