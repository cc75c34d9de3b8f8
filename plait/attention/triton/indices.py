"""Building the CSR KV index list (``kv_indptr`` / ``kv_indices``) from ``req_to_token``."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

_COPY_BLOCK = 512


@triton.jit
def _build_kv_indices_kernel(
    Req_To_Token,  # [max_reqs, max_context] int32
    Req_Pool_Indices,  # [bs] int
    Seq_Lens,  # [bs] int
    Kv_Indptr,  # [bs + 1] int32, already holding the exclusive cumsum of Seq_Lens
    Kv_Start_Idx,  # [bs] int or a dummy pointer (HAS_START False)
    Kv_Indices,  # [>= sum(seq_lens)] int32 output
    stride_req,
    HAS_START: tl.constexpr,
    BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    row = tl.load(Req_Pool_Indices + i).to(tl.int64)
    n = tl.load(Seq_Lens + i).to(tl.int32)
    out_start = tl.load(Kv_Indptr + i).to(tl.int64)
    src = Req_To_Token + row * stride_req
    if HAS_START:
        src += tl.load(Kv_Start_Idx + i).to(tl.int64)
    for start in range(0, n, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < n
        slots = tl.load(src + offs, mask=mask)
        tl.store(Kv_Indices + out_start + offs, slots, mask=mask)


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_start_idx: torch.Tensor | None = None,
) -> None:
    """``kv_indices[kv_indptr[i] : kv_indptr[i] + seq_lens[i]] =
    req_to_token[req_pool_indices[i], start_i : start_i + seq_lens[i]]`` with start_i = kv_start_idx[i] or 0.

    The caller fills ``kv_indptr[1:] = cumsum(seq_lens)`` (kv_indptr[0] = 0). One program per request;
    no host sync and a grid that depends only on bs, so it can be recorded in a CUDA graph.
    """
    bs = req_pool_indices.shape[0]
    if bs == 0:
        return
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token: last dim must be contiguous")
    has_start = kv_start_idx is not None
    _build_kv_indices_kernel[(bs,)](
        req_to_token,
        req_pool_indices,
        seq_lens,
        kv_indptr,
        kv_start_idx if has_start else seq_lens,
        kv_indices,
        req_to_token.stride(0),
        HAS_START=has_start,
        BLOCK=_COPY_BLOCK,
        num_warps=4,
    )
