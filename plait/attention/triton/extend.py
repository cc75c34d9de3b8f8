"""Extend (prefill / chunked prefill / verify) attention over a page-size-1 paged KV cache.

One kernel, grid ``(Hq / P, cdiv(max_len_extend, BLOCK_M / P), bs)``: a program owns a tile of BLOCK_M
query rows of one request: BLOCK_M new tokens of one query head (P = 1), or, with GQA packing
(P = G = Hq / Hkv), BLOCK_M / G new tokens x the G query heads of one KV group. It runs one online
softmax over two KV sources:
  1. the request's cached prefix, gathered through ``kv_indices[kv_indptr[i]:kv_indptr[i+1]]`` from
     ``k_buffer``/``v_buffer`` (every prefix token is visible to every new token unless a custom mask
     says otherwise);
  2. the new tokens themselves, read from ``k_extend``/``v_extend`` (so it does not matter whether they
     were already stored in the cache), causal (new token j sees new tokens 0..j), bidirectional when
     ``is_causal=False``, or under ``custom_mask``.
Heads are the fastest grid axis, so the query heads that share a KV head run side by side and reuse
its K/V tiles from L2; query blocks are visited last-first so the longest causal rows start first.
Packing pays for short extends over long prefixes (verify, draft extend), where it cuts prefix reads
by G; long prefills use unpacked 128-row tiles.

Tiles that need no mask (whole prefix tiles; causal tiles strictly left of the diagonal block) take an
unmasked path; only tail and diagonal tiles pay for masks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._common import (
    LaunchConfig,
    check_head_dim,
    check_last_dim_contiguous,
    device_capability,
    dot_precision,
    next_pow2,
    scale_logits,
)

# Extends of at most this many tokens (speculative verify, draft extend) launch the short config.
SHORT_EXTEND_MAX_TOKENS = 64


def extend_config(q: torch.Tensor, head_dim: int, max_len_extend: int, group: int) -> LaunchConfig:
    """Launch config for this device, the longest extend (a host int, fixed per captured graph) and the
    GQA group size.

    Hopper, long extends (prefill, chunked prefill) over 64-token K/V tiles, 3 stages: at head dim <= 64,
    128 query rows with 8 warps (two warpgroups for the 128-row wgmma); at head dim 128, 64 rows of
    packed GQA heads with 4 warps, so each K/V tile serves the whole group (``kernels_bench.py
    --sweep-extend`` over 16 x 512 and 16 x 1024 fresh prompts and 1024-token chunks over a 1024-token
    prefix: the best or within 1% of it at each, where 128 x 128 tiles ran 1-29% slower). Short extends
    (<= 64 tokens: speculative verify, draft extend): the G heads of a KV group are packed into the rows
    of one tile, so a long prefix is read once per group instead of once per query head and few rows
    are dead; 64-token KV tiles, 4 warps.
    Interpreter (CPU): 16 x 16 tiles, unpacked, so tiny test shapes cover several query blocks, unmasked
    and masked KV tiles and the diagonal (tests force the packed path through ``config``).
    """
    cap = device_capability(q)
    if cap is None:
        return LaunchConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)
    hopper = cap[0] >= 9
    if max_len_extend <= SHORT_EXTEND_MAX_TOKENS:
        # 64 rows even when G x extend is smaller: a 64-row packed tile runs closer to the memory floor
        # over a long prefix than 32-row tiles, and far closer than unpacked ones.
        block_m = max(64, next_pow2(group)) if group > 1 else max(16, min(64, next_pow2(max_len_extend)))
        return LaunchConfig(block_m=block_m, block_n=64, num_warps=4, num_stages=3 if hopper else 2, pack_gqa=group > 1)
    if head_dim > 128:
        return LaunchConfig(block_m=64, block_n=64, num_warps=8, num_stages=2)
    if hopper:
        if head_dim <= 64:
            return LaunchConfig(block_m=128, block_n=64, num_warps=8, num_stages=3)
        return LaunchConfig(block_m=max(64, next_pow2(group)), block_n=64, num_warps=4, num_stages=3,
                            pack_gqa=group > 1)
    return LaunchConfig(block_m=128, block_n=64, num_warps=4 if head_dim <= 64 else 8, num_stages=2)


@triton.jit
def _attend_tile(
    acc,  # [BLOCK_M, DV] fp32 running (unnormalised) output
    l_i,  # [BLOCK_M] fp32 running softmax denominator
    m_i,  # [BLOCK_M] fp32 running max (base-2 logits)
    q,  # [BLOCK_M, D]
    k_ptrs,  # [BLOCK_N, D] pointers
    v_ptrs,  # [BLOCK_N, DV] pointers
    mask_n,  # [BLOCK_N] rows of K/V that exist (used only when MASKED)
    visible,  # [BLOCK_M, BLOCK_N] which (query, key) pairs may attend (used only when MASKED)
    sm_scale,  # includes the K cache scale for tiles of an FP8 cache
    v_scale,  # the V cache scale (1.0 for the new tokens' own V)
    logit_cap,
    MASKED: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
):
    # K/V may be FP8 (the cache of --kv-cache-dtype fp8_*): converted to q's dtype in registers.
    if MASKED:
        k = tl.load(k_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
    qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=INPUT_PRECISION)
    qk = scale_logits(qk, sm_scale, logit_cap, USE_LOGIT_CAP)
    if MASKED:
        qk = tl.where(visible, qk, float("-inf"))
    # m_i starts at a finite -1e30 (not -inf): a row whose whole tile is masked keeps m = -1e30,
    # alpha = 1 and p = 0 instead of producing NaN from (-inf) - (-inf).
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(qk - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs, mask=mask_n[:, None], other=0.0)
    else:
        v = tl.load(v_ptrs)
    acc = acc * alpha[:, None] + tl.dot((p * v_scale).to(q.dtype), v.to(q.dtype), input_precision=INPUT_PRECISION)
    return acc, l_i, m_new


# Per-request metadata and index lists read at runtime offsets: a step may pass them as slices at any
# offset (a mixed step's extend part starts after its decode rows, a verify's indptrs share one packed
# buffer), and without a mask or sinks Custom_Mask, Mask_Indptr and Sinks are stand-ins for Qo_Indptr. A
# pointer's 16-byte alignment is otherwise part of the compiled variant, so each new offset class would
# compile on the request path.
@triton.jit(do_not_specialize_on_alignment=["Qo_Indptr", "Kv_Indptr", "Kv_Indices", "Custom_Mask", "Mask_Indptr",
                                            "Sinks"])
def _extend_kernel(
    Q,  # [T, Hq, D] new tokens' queries
    K_Ext,  # [T, Hkv, D]
    V_Ext,  # [T, Hkv, DV]
    Out,  # [T, Hq, DV]
    K_Buffer,  # [num_slots, Hkv, D]
    V_Buffer,  # [num_slots, Hkv, DV]
    Qo_Indptr,  # [bs + 1]: request i's new tokens are rows [Qo_Indptr[i], Qo_Indptr[i+1])
    Kv_Indptr,  # [bs + 1]: request i's prefix slots are Kv_Indices[Kv_Indptr[i] : Kv_Indptr[i+1]]
    Kv_Indices,
    Custom_Mask,  # flat bool/uint8; request i: [ext_len, prefix_len + ext_len] row-major at Mask_Indptr[i]
    Mask_Indptr,
    Sinks,  # [Hq] fp32 per-head sink logits (natural log units; read only when HAS_SINKS)
    sm_scale,
    k_scale,  # multipliers of the cached prefix's K / V (an FP8 cache; 1.0 otherwise)
    v_scale,
    logit_cap,
    stride_qt,
    stride_qh,
    stride_ket,
    stride_keh,
    stride_vet,
    stride_veh,
    stride_ot,
    stride_oh,
    stride_kbs,
    stride_kbh,
    stride_vbs,
    stride_vbh,
    GROUP: tl.constexpr,
    PACK: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    IS_CAUSAL: tl.constexpr,
    USE_CUSTOM_MASK: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    WINDOW: tl.constexpr = 0,  # sliding window: key j visible to query i iff j > i - WINDOW (0 = off)
    HAS_SINKS: tl.constexpr = False,
):
    # Tile rows: row r is new token (m_block * TOK + r // PACK) of query head (head0 + r % PACK).
    # PACK = 1: one head, BLOCK_M tokens. PACK = GROUP: the whole KV group shares each K/V tile.
    TOK: tl.constexpr = BLOCK_M // PACK  # new tokens per query block
    head0 = tl.program_id(0) * PACK
    m_block = tl.num_programs(1) - 1 - tl.program_id(1)  # longest (causal) query blocks first
    b = tl.program_id(2)
    kv_head = head0 // GROUP

    q_start = tl.load(Qo_Indptr + b)
    ext_len = tl.load(Qo_Indptr + b + 1) - q_start
    if m_block * TOK < ext_len:
        pre_start = tl.load(Kv_Indptr + b)
        pre_len = tl.load(Kv_Indptr + b + 1) - pre_start

        offs_r = tl.arange(0, BLOCK_M)
        offs_m = m_block * TOK + offs_r // PACK  # [BLOCK_M] token index of each row within the extend
        heads = head0 + offs_r % PACK  # [BLOCK_M] query head of each row
        mask_m = offs_m < ext_len
        if TOK * PACK != BLOCK_M:  # PACK not a power of two: the last BLOCK_M % PACK rows are padding
            mask_m = mask_m & (offs_r < TOK * PACK)
        offs_d = tl.arange(0, D)
        offs_dv = tl.arange(0, DV)
        offs_nb = tl.arange(0, BLOCK_N)
        rows_q = (q_start + offs_m).to(tl.int64)
        q_row = rows_q * stride_qt + heads * stride_qh
        q = tl.load(Q + q_row[:, None] + offs_d[None, :], mask=mask_m[:, None], other=0.0)

        m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, DV], dtype=tl.float32)

        kb_head = K_Buffer + kv_head * stride_kbh
        vb_head = V_Buffer + kv_head * stride_vbh
        if USE_CUSTOM_MASK:
            mask_row = (
                Custom_Mask + tl.load(Mask_Indptr + b).to(tl.int64) + offs_m.to(tl.int64)[:, None] * (pre_len + ext_len)
            )

        # ---- 1. cached prefix, gathered through kv_indices ----
        if USE_CUSTOM_MASK:
            pre_full = 0
            pre_lo = 0
        elif WINDOW > 0:
            # Every tile is masked; tiles left of the first row's window are never read.
            pre_full = 0
            pre_lo = (tl.maximum(pre_len + m_block * TOK - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        else:
            pre_full = (pre_len // BLOCK_N) * BLOCK_N
            pre_lo = pre_full
        for start_n in range(0, pre_full, BLOCK_N):  # whole tiles, everything visible: no masks
            loc = tl.load(Kv_Indices + pre_start + start_n + offs_nb).to(tl.int64)
            acc, l_i, m_i = _attend_tile(
                acc,
                l_i,
                m_i,
                q,
                kb_head + loc[:, None] * stride_kbs + offs_d[None, :],
                vb_head + loc[:, None] * stride_vbs + offs_dv[None, :],
                offs_nb,
                offs_nb[None, :],
                sm_scale * k_scale,
                v_scale,
                logit_cap,
                MASKED=False,
                USE_LOGIT_CAP=USE_LOGIT_CAP,
                INPUT_PRECISION=INPUT_PRECISION,
            )
        for start_n in range(pre_lo, pre_len, BLOCK_N):  # tail tile, or every tile under a mask or window
            offs_n = start_n + offs_nb
            mask_n = offs_n < pre_len
            loc = tl.load(Kv_Indices + pre_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            visible = mask_n[None, :]
            if USE_CUSTOM_MASK:
                cm = tl.load(mask_row + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0)
                visible = visible & (cm != 0)
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > (pre_len + offs_m)[:, None] - WINDOW)
            acc, l_i, m_i = _attend_tile(
                acc,
                l_i,
                m_i,
                q,
                kb_head + loc[:, None] * stride_kbs + offs_d[None, :],
                vb_head + loc[:, None] * stride_vbs + offs_dv[None, :],
                mask_n,
                visible,
                sm_scale * k_scale,
                v_scale,
                logit_cap,
                MASKED=True,
                USE_LOGIT_CAP=USE_LOGIT_CAP,
                INPUT_PRECISION=INPUT_PRECISION,
            )

        # ---- 2. the new tokens, read from k_extend / v_extend ----
        ke_head = K_Ext + kv_head * stride_keh
        ve_head = V_Ext + kv_head * stride_veh
        if USE_CUSTOM_MASK:
            ext_full = 0
            ext_end = ext_len
        elif IS_CAUSAL:
            # Tiles strictly left of this query block are fully visible; the diagonal block is masked
            # and nothing right of it is read.
            ext_full = (m_block * TOK // BLOCK_N) * BLOCK_N
            ext_end = tl.minimum(ext_len, (m_block + 1) * TOK)
        else:
            ext_full = (ext_len // BLOCK_N) * BLOCK_N
            ext_end = ext_len
        ext_lo = ext_full
        if WINDOW > 0:
            ext_full = 0
            ext_lo = (tl.maximum(m_block * TOK - WINDOW + 1, 0) // BLOCK_N) * BLOCK_N
        for start_n in range(0, ext_full, BLOCK_N):
            rows_k = (q_start + start_n + offs_nb).to(tl.int64)
            acc, l_i, m_i = _attend_tile(
                acc,
                l_i,
                m_i,
                q,
                ke_head + rows_k[:, None] * stride_ket + offs_d[None, :],
                ve_head + rows_k[:, None] * stride_vet + offs_dv[None, :],
                offs_nb,
                offs_nb[None, :],
                sm_scale,
                1.0,
                logit_cap,
                MASKED=False,
                USE_LOGIT_CAP=USE_LOGIT_CAP,
                INPUT_PRECISION=INPUT_PRECISION,
            )
        for start_n in range(ext_lo, ext_end, BLOCK_N):
            offs_n = start_n + offs_nb
            mask_n = offs_n < ext_len
            rows_k = (q_start + offs_n).to(tl.int64)
            visible = mask_n[None, :]
            if USE_CUSTOM_MASK:
                cm = tl.load(mask_row + pre_len + offs_n[None, :], mask=mask_m[:, None] & mask_n[None, :], other=0)
                visible = visible & (cm != 0)
            elif IS_CAUSAL:
                visible = visible & (offs_m[:, None] >= offs_n[None, :])
            if WINDOW > 0:
                visible = visible & (offs_n[None, :] > offs_m[:, None] - WINDOW)
            acc, l_i, m_i = _attend_tile(
                acc,
                l_i,
                m_i,
                q,
                ke_head + rows_k[:, None] * stride_ket + offs_d[None, :],
                ve_head + rows_k[:, None] * stride_vet + offs_dv[None, :],
                mask_n,
                visible,
                sm_scale,
                1.0,
                logit_cap,
                MASKED=True,
                USE_LOGIT_CAP=USE_LOGIT_CAP,
                INPUT_PRECISION=INPUT_PRECISION,
            )

        if HAS_SINKS:
            # The sink joins the denominator (a logit attending to nothing), in base-2 units.
            sink = tl.load(Sinks + heads, mask=mask_m, other=0.0) * 1.4426950408889634
            m_f = tl.maximum(m_i, sink)
            alpha = tl.exp2(m_i - m_f)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp2(sink - m_f)
        # A row that saw nothing (only possible under a custom mask) has l = 0 and acc = 0: write 0.
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)  # l == 0 implies acc == 0
        out = acc / l_safe[:, None]
        tl.store(
            Out + (rows_q * stride_ot + heads * stride_oh)[:, None] + offs_dv[None, :],
            out.to(Out.dtype.element_ty),
            mask=mask_m[:, None],
        )


def extend_attention_fwd(
    q_extend: torch.Tensor,
    k_extend: torch.Tensor,
    v_extend: torch.Tensor,
    o_extend: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    custom_mask: torch.Tensor | None,
    mask_indptr: torch.Tensor | None,
    max_len_extend: int,
    sm_scale: float,
    is_causal: bool = True,
    logit_cap: float = 0.0,
    *,
    config: LaunchConfig | None = None,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Attention of new tokens over (cached prefix + new tokens), written into ``o_extend``.

    ``k_buffer`` / ``v_buffer`` may hold FP8 (an FP8 KV cache): the prefix's K and V are then
    ``stored * k_scale`` / ``stored * v_scale``; the new tokens' own K/V are read as given.

    ``sliding_window`` W (Mistral style): a query at position i sees keys at positions j > i - W, on
    top of the causal rule or the custom mask. ``sinks`` fp32 ``[Hq]`` (gpt-oss): per-head logits
    that join each softmax denominator and attend to nothing.

    q_extend ``[T, Hq, D]``, k_extend/v_extend ``[T, Hkv, D/Dv]``, o_extend ``[T, Hq, Dv]``;
    qo_indptr ``[bs + 1]`` over the T new tokens; kv_indptr ``[bs + 1]``/kv_indices over each request's
    cached PREFIX only (may be empty); custom_mask: None, or flat bool/uint8 with request i's
    ``[ext_len_i, prefix_len_i + ext_len_i]`` row-major block at ``mask_indptr[i]`` (replaces the causal
    rule); max_len_extend: a host int >= every ext_len_i (sizes the grid). No host sync. ``config``
    overrides the launch config chosen by ``extend_config`` (tuning and tests).
    """
    num_tokens, num_q_heads, head_dim = q_extend.shape
    num_kv_heads = k_extend.shape[1]
    head_dim_v = v_extend.shape[-1]
    bs = qo_indptr.shape[0] - 1
    if num_tokens == 0 or bs <= 0 or max_len_extend <= 0:
        return
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    if k_buffer.shape[1] != num_kv_heads:
        raise ValueError(f"k_buffer has {k_buffer.shape[1]} kv heads, k_extend {num_kv_heads}")
    check_head_dim("head_dim", head_dim)
    check_head_dim("head_dim_v", head_dim_v)
    check_last_dim_contiguous(
        q_extend=q_extend,
        k_extend=k_extend,
        v_extend=v_extend,
        o_extend=o_extend,
        k_buffer=k_buffer,
        v_buffer=v_buffer,
    )
    use_custom_mask = custom_mask is not None
    if use_custom_mask and mask_indptr is None:
        raise ValueError("custom_mask given without mask_indptr")
    group = num_q_heads // num_kv_heads
    cfg = config if config is not None else extend_config(q_extend, head_dim, max_len_extend, group)
    # Dummy pointers when no mask: never dereferenced (USE_CUSTOM_MASK is a constexpr).
    mask_arg = custom_mask if use_custom_mask else qo_indptr
    mask_indptr_arg = mask_indptr if use_custom_mask else qo_indptr
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,)):
        raise ValueError(f"sinks must be float32 [num_q_heads={num_q_heads}], got {sinks.dtype} {tuple(sinks.shape)}")

    pack = group if cfg.pack_gqa else 1
    if cfg.block_m < pack:
        raise ValueError(f"block_m={cfg.block_m} cannot hold the {pack} packed heads of a KV group")
    grid = (num_q_heads // pack, triton.cdiv(max_len_extend, cfg.block_m // pack), bs)
    _extend_kernel[grid](
        q_extend,
        k_extend,
        v_extend,
        o_extend,
        k_buffer,
        v_buffer,
        qo_indptr,
        kv_indptr,
        kv_indices,
        mask_arg,
        mask_indptr_arg,
        sinks if sinks is not None else qo_indptr,  # unused without sinks
        sm_scale,
        k_scale,
        v_scale,
        logit_cap,
        q_extend.stride(0),
        q_extend.stride(1),
        k_extend.stride(0),
        k_extend.stride(1),
        v_extend.stride(0),
        v_extend.stride(1),
        o_extend.stride(0),
        o_extend.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        GROUP=group,
        PACK=pack,
        D=head_dim,
        DV=head_dim_v,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        IS_CAUSAL=is_causal,
        USE_CUSTOM_MASK=use_custom_mask,
        USE_LOGIT_CAP=logit_cap > 0,
        INPUT_PRECISION=dot_precision(q_extend.dtype),
        WINDOW=sliding_window or 0,
        HAS_SINKS=sinks is not None,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
