"""Expert parallelism's all-to-all dispatch and combine (``--moe-a2a-backend all_to_all``).

Layout: ``ep_size == tp_size``, so rank r holds the whole experts ``[r * E_local, (r + 1) * E_local)``.
Each rank routes only its own share of the step's tokens (under DP attention its own requests' rows;
under plain tensor parallelism a 1/tp slice of the replicated rows, the outputs all-gathered back
by the caller) and:

1. flattens its ``[n, K]`` routing into ``n * K`` (token, k) pairs, pair ``p = t * K + k``, and
   orders them by destination rank (a stable sort: token order inside each destination);
2. exchanges the per-destination pair counts, then sends each pair's hidden row, its local expert id
   and its routing weight in one ``all_to_all_single`` with those split sizes (the rows as bytes,
   the id and the float32 weight beside them);
3. runs its local experts on what it received (``fused_experts`` with one expert per row, the
   routing weight applied there);
4. sends the results back by the inverse exchange, puts each at its pair's place and sums each
   token's K results in float32 over k = 0..K-1: a fixed order, so the result does not depend on
   which rank computed which pair or on the arrival order.

Pairs are sent one by one: a token whose K experts include several of one rank is sent to it once
per expert (DeepEP sends it once and fans out there; that saves bytes at large K / small ep_size).
The split sizes are host ints exchanged every call, so this path cannot run inside a CUDA graph; on
CUDA the steps of the kinds graphs are captured for take the all-gather path
(``SparseMoeBlock.dispatches_all_to_all`` says which).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from plait.distributed.all_to_all import all_to_all_rows, exchange_counts
from plait.distributed.parallel_state import TPGroup


def _pack(rows: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """[N, H] rows of any dtype and [N, 2] float32 meta (local expert id, exact below 2**24; routing
    weight) -> [N, H * itemsize + 8] bytes: one exchange carries both."""
    return torch.cat([rows.contiguous().view(torch.uint8), meta.contiguous().view(torch.uint8)], dim=1)


def _unpack(packed: torch.Tensor, dtype: torch.dtype, hidden: int) -> tuple[torch.Tensor, torch.Tensor]:
    row_bytes = hidden * torch.empty((), dtype=dtype).element_size()
    return packed[:, :row_bytes].contiguous().view(dtype), packed[:, row_bytes:].contiguous().view(torch.float32)


# rows [N, H], weights [N, 1] float32, local expert ids [N, 1] int32 -> the weighted outputs [N, H].
LocalExperts = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def split_rows(num_rows: int, parts: int) -> list[int]:
    """Near-equal row counts of ``parts`` consecutive slices (the first ``num_rows % parts`` one
    longer): each rank's share of replicated rows under plain tensor parallelism."""
    base, extra = divmod(num_rows, parts)
    return [base + (r < extra) for r in range(parts)]


def dispatch_combine(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, group: TPGroup,
                     num_local_experts: int, run_local_experts: LocalExperts) -> torch.Tensor:
    """This rank's tokens ``x`` [n, H] routed to global experts ``topk_ids`` [n, K] with weights
    ``topk_weights`` [n, K] -> [n, H] in ``x``'s dtype: the weighted sum over each token's K experts,
    wherever they live. ``run_local_experts(rows [N, H], weights [N, 1] float32, local_ids [N, 1]
    int32) -> [N, H]`` computes this rank's experts on the pairs it received. Every rank of ``group``
    calls this together (an IDLE rank with n = 0)."""
    n, k = topk_ids.shape
    hidden = x.shape[1]
    ids = topk_ids.reshape(-1).long()
    dest = torch.div(ids, num_local_experts, rounding_mode="floor")
    order = torch.sort(dest, stable=True).indices
    send_counts = torch.bincount(dest, minlength=group.size)
    recv_counts = exchange_counts(group, send_counts)
    send_list = send_counts.tolist()
    sorted_ids = ids[order]
    meta = torch.stack([(sorted_ids - dest[order] * num_local_experts).float(),
                        topk_weights.reshape(-1)[order].float()], dim=1)
    received = all_to_all_rows(group, _pack(x[order // k], meta), send_list, recv_counts)
    rows, recv_meta = _unpack(received, x.dtype, hidden)
    local_ids = recv_meta[:, 0:1].to(torch.int32)
    out = run_local_experts(rows, recv_meta[:, 1:2].contiguous(), local_ids)
    returned = all_to_all_rows(group, out, recv_counts, send_list)
    per_pair = torch.empty(n * k, hidden, dtype=torch.float32, device=x.device)
    per_pair[order] = returned.float()
    # torch's sum over a dimension is a fixed-order reduction (no atomics): deterministic.
    return per_pair.view(n, k, hidden).sum(dim=1).to(x.dtype)
