"""Building the CSR KV index lists (``kv_indptr`` / ``kv_indices``) from ``req_to_token``: one list per
request (decode, extend prefixes), or one per verify token (TARGET_VERIFY through the decode kernel)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import next_pow2

_COPY_BLOCK = 512


# The per-request inputs are read one scalar per program, and callers pass slices at any offset (a mixed
# step's extend requests after its decode rows): no variant per pointer alignment (extend.py says why).
@triton.jit(do_not_specialize_on_alignment=["Req_Pool_Indices", "Seq_Lens", "Kv_Indptr", "Kv_Start_Idx"])
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


@triton.jit
def _verify_row_mask(
    Custom_Mask,  # flat bool/uint8, request b's [ext_b, prefix_b + ext_b] block at Mask_Indptr[b]
    Mask_Indptr,
    b,
    i,
    prefix,
    ext,
    HAS_MASK: tl.constexpr,
    BLOCK_W: tl.constexpr,
):
    """[BLOCK_W] bool: which new tokens j of request b verify token i sees (the mask's tree part,
    columns >= prefix; without a mask, the causal chain j <= i)."""
    offs_j = tl.arange(0, BLOCK_W)
    in_ext = offs_j < ext
    if HAS_MASK:
        row = Custom_Mask + tl.load(Mask_Indptr + b).to(tl.int64) + i.to(tl.int64) * (prefix + ext) + prefix
        seen = tl.load(row + offs_j, mask=in_ext, other=0) != 0
    else:
        seen = offs_j <= i
    return seen & in_ext


@triton.jit(do_not_specialize_on_alignment=["Req_Pool_Indices", "Prefix_Lens", "Qo_Indptr", "Mask_Indptr",
                                            "Row_Lens", "Kv_Indptr"])
def _verify_kv_rows_kernel(
    Req_To_Token,  # [max_reqs, max_context] int32
    Req_Pool_Indices,  # [bs] int
    Prefix_Lens,  # [bs] int: cached tokens per request (all visible to every verify token)
    Qo_Indptr,  # [bs + 1] int: request b's verify tokens are rows [Qo_Indptr[b], Qo_Indptr[b + 1])
    Out_Cache_Loc,  # [num_rows] int: KV slot of each verify token (stored before attention)
    Custom_Mask,  # flat bool/uint8 or a dummy pointer (HAS_MASK False)
    Mask_Indptr,  # [bs + 1] int or a dummy pointer
    Row_Lens,  # [num_rows] int32: written when not FILL
    Kv_Indptr,  # [num_rows + 1] int32: read when FILL (the exclusive cumsum of Row_Lens)
    Kv_Indices,  # [>= sum(Row_Lens)] int32: written when FILL
    stride_req,
    HAS_MASK: tl.constexpr,
    FILL: tl.constexpr,
    BLOCK_W: tl.constexpr,
    BLOCK: tl.constexpr,
):
    # Grid (bs, max_width): program (b, i) owns verify token i of request b (nothing if i >= ext_b).
    b = tl.program_id(0)
    i = tl.program_id(1)
    q_start = tl.load(Qo_Indptr + b)
    ext = tl.load(Qo_Indptr + b + 1) - q_start
    if i < ext:
        prefix = tl.load(Prefix_Lens + b).to(tl.int32)
        seen = _verify_row_mask(Custom_Mask, Mask_Indptr, b, i, prefix, ext, HAS_MASK, BLOCK_W)
        r = q_start + i
        if FILL:
            out = Kv_Indices + tl.load(Kv_Indptr + r).to(tl.int64)
            src = Req_To_Token + tl.load(Req_Pool_Indices + b).to(tl.int64) * stride_req
            for start in range(0, prefix, BLOCK):
                offs = start + tl.arange(0, BLOCK)
                mask = offs < prefix
                tl.store(out + offs, tl.load(src + offs, mask=mask), mask=mask)
            # The visible new tokens, compacted in token order after the prefix.
            pos = tl.cumsum(seen.to(tl.int32), 0) - 1
            offs_j = tl.arange(0, BLOCK_W)
            slots = tl.load(Out_Cache_Loc + q_start + offs_j, mask=seen, other=0)
            tl.store(out + prefix + pos, slots.to(tl.int32), mask=seen)
        else:
            tl.store(Row_Lens + r, prefix + tl.sum(seen.to(tl.int32), 0))


def build_verify_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    prefix_lens: torch.Tensor,
    qo_indptr: torch.Tensor,
    out_cache_loc: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    max_width: int,
    row_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
) -> None:
    """Per-token KV lists of a TARGET_VERIFY batch, for the split-KV decode kernel (one decode "row"
    per verify token).

    Row ``r = qo_indptr[b] + i`` (verify token i of request b) attends to the request's cached prefix
    ``req_to_token[req_pool_indices[b], :prefix_lens[b]]`` and then to ``out_cache_loc[qo_indptr[b] + j]``
    for every new token j with ``custom_mask`` true at (b, i, prefix_b + j), in increasing j (the
    layout of ``custom_mask_of``: request b's row-major ``[ext_b, prefix_b + ext_b]`` block at
    ``mask_indptr[b]``; its prefix columns are taken as all true, which every verify mask is). No mask:
    the causal chain, j <= i. Writes ``row_lens[:num_rows]`` (int32), ``kv_indptr[:num_rows + 1]``
    (the exclusive cumsum) and ``kv_indices[:kv_indptr[num_rows]]``, with num_rows = qo_indptr[bs]
    (= ``row_lens.shape[0]``, a host int the caller knows: the batch's token count).

    Three launches (row lengths, cumsum, fill) with grids that depend only on bs, ``max_width``
    (>= every ext_b; a host int fixed per captured graph) and num_rows: no host sync, capturable.
    """
    bs = req_pool_indices.shape[0]
    num_rows = row_lens.shape[0]
    if bs == 0 or num_rows == 0 or max_width <= 0:
        return
    if req_to_token.stride(1) != 1:
        raise ValueError("req_to_token: last dim must be contiguous")
    if kv_indptr.shape[0] < num_rows + 1:
        raise ValueError(f"kv_indptr holds {kv_indptr.shape[0]} entries, {num_rows + 1} needed")
    has_mask = custom_mask is not None
    if has_mask and mask_indptr is None:
        raise ValueError("custom_mask given without mask_indptr")
    args = (
        req_to_token,
        req_pool_indices,
        prefix_lens,
        qo_indptr,
        out_cache_loc,
        custom_mask if has_mask else qo_indptr,  # dummy pointers: never dereferenced without a mask
        mask_indptr if has_mask else qo_indptr,
        row_lens,
        kv_indptr,
        kv_indices,
        req_to_token.stride(0),
    )
    grid = (bs, max_width)
    block_w = max(2, next_pow2(max_width))
    _verify_kv_rows_kernel[grid](*args, HAS_MASK=has_mask, FILL=False, BLOCK_W=block_w, BLOCK=_COPY_BLOCK,
                                 num_warps=1)
    kv_indptr[:1].zero_()  # a fill kernel: a Python scalar store would be a host copy (illegal in capture)
    torch.cumsum(row_lens, 0, dtype=torch.int32, out=kv_indptr[1 : num_rows + 1])
    _verify_kv_rows_kernel[grid](*args, HAS_MASK=has_mask, FILL=True, BLOCK_W=block_w, BLOCK=_COPY_BLOCK,
                                 num_warps=4)
