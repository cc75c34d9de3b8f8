"""Split-KV (flash-decoding) attention for decode: one new query token per request.

Stage 1, grid ``(bs, num_kv_heads / kv_pack, max_kv_splits)``: a program owns one request, one KV head
(or ``kv_pack`` adjacent ones, read as one row per slot) and one contiguous split of that request's KV.
All ``G = Hq / Hkv`` query heads of the KV group are one ``[BLOCK_H, D]`` tile (BLOCK_H =
max(16, next_pow2(G)), rows >= G masked), so each K/V tile is read from HBM once per group and the
products are ``tl.dot``s. It runs an online softmax over the split and
writes the split's normalised partial output and natural-log LSE into the fp32 workspaces.

Stage 2, grid ``(bs, Hkv)``: merges a request's splits with their LSEs into ``o`` (``_merge_splits``, which the
fused form runs inside stage 1 instead, in its last split program per request and KV head).

Split layout (shared by both stages, derived on device so the pair is CUDA-graph capturable):
    n          = clamp(num_kv_splits[b], 1, max_kv_splits)
    split_len  = roundup(ceil(seq_len / n), MIN_BLOCK_KV)
    split s    = [s * split_len, min((s + 1) * split_len, seq_len))   (empty -> skipped by both stages)
Programs with ``s >= n`` or an empty split exit at once and write nothing; stage 2 never reads them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from plait import envs
from plait.layers.pdl import pdl_prologue, use_pdl

from ._common import (
    LaunchConfig,
    check_head_dim,
    check_last_dim_contiguous,
    device_capability,
    device_num_sms,
    dot_precision,
    next_pow2,
    scale_logits,
)

# Split heuristic defaults (tuned on Hopper, bf16, 8 kv heads; see get_num_kv_splits): aim for about 4
# stage-1 programs per SM in total, and never split below 128 tokens (a split must pay for its stage-2
# traffic and its pipeline warm-up, so short contexts lose from splitting finer).
DEFAULT_PROGRAMS_PER_SM = 4
DEFAULT_MIN_SPLIT_LEN = 128


# The (request, kv head) grid at which decode switches to its large-batch tiles, in programs per SM.
LARGE_BATCH_PROGRAMS_PER_SM = 4


def large_batch_min_bs(num_sms: int, num_kv_heads: int, head_dim: int) -> int:
    """The smallest decode batch (requests) from which ``decode_config`` picks the large-batch tiles: where
    the (request, kv head) grid reaches LARGE_BATCH_PROGRAMS_PER_SM programs per SM, or half of that at
    head dim <= 64, where the packed tiles already win (bs 64 with 8 kv heads)."""
    min_bs = -(-LARGE_BATCH_PROGRAMS_PER_SM * num_sms // max(1, num_kv_heads))
    return (min_bs + 1) // 2 if head_dim <= 64 else min_bs


KV_PACK_OVERRIDE = envs.DECODE_KV_PACK.get()


def decode_config(q: torch.Tensor, head_dim: int, num_kv_heads: int) -> tuple[LaunchConfig, int]:
    """(stage-1 launch config, MIN_BLOCK_KV split granularity) for this device and batch size.

    Chosen from host ints only (bs = q.shape[0]), so it is fixed for a captured graph. The KV tiles are
    gathered through ``kv_indices``; the [16, D] x [D, BLOCK_N] dots are tiny, what matters is bytes in
    flight. On Hopper (bf16, D = 128, 8 kv heads) 128-token tiles, 4 warps, 2 stages are best or close
    for small and medium batches over short and long contexts; once the (request, kv head) grid alone
    is >= 4 programs per SM (2 at head dim 64), 64-token tiles (more CTAs resident per SM) win, and two KV
    heads per program (32-token tiles at head dim 128, there only with >= 4 query heads per KV head)
    (``kernels_bench.py --sweep-decode`` compares them; DP attention's per-rank decode batches sit in
    that range).
    Interpreter (CPU): 16-token tiles, so small test shapes cover multi-tile splits, tails and empty
    splits.
    """
    cap = device_capability(q)
    if cap is None:
        return LaunchConfig(block_n=16, num_warps=4, num_stages=1), 16
    if head_dim > 128:
        return LaunchConfig(block_n=32, num_warps=4, num_stages=2), 64
    if q.shape[0] >= large_batch_min_bs(device_num_sms(q), num_kv_heads, head_dim):
        # Large batches read K/V rows at random slots: two KV heads per program read one row of twice the
        # bytes per slot (256 bytes at head dim 64, 512 at 128). At head dim 128 the tile keeps 64 x 128
        # elements per operand (32 tokens x 2 heads), so as many CTAs stay resident per SM as unpacked;
        # there it pays only with >= 4 query heads per KV head (llama-3.1-8b gains, qwen3-0.6b's groups of
        # 2 lose end to end).
        group = q.shape[1] // max(1, num_kv_heads)
        packs = num_kv_heads % 2 == 0 and (head_dim <= 64 or group >= 4)
        pack = KV_PACK_OVERRIDE or (2 if packs else 1)
        block_n = 64 if head_dim <= 64 else max(16, 64 // pack)
        return LaunchConfig(block_n=block_n, num_warps=4, num_stages=2, kv_pack=pack), 64
    return LaunchConfig(block_n=128, num_warps=4, num_stages=2, kv_pack=KV_PACK_OVERRIDE or 1), 64


# Metadata read at runtime offsets, and Sinks (without sinks, a stand-in pointer): their alignment must
# not pick the variant, or a mixed step's slices compile new ones on the request path.
@triton.jit(do_not_specialize_on_alignment=["Kv_Indptr", "Kv_Indices", "Num_Kv_Splits", "Sinks"])
def _decode_stage1_kernel(
    Q,  # [bs, Hq, D]
    K_Buffer,  # [num_slots, Hkv, D]
    V_Buffer,  # [num_slots, Hkv, DV]
    Kv_Indptr,  # [bs + 1] int32
    Kv_Indices,  # [total] int32 slots
    Num_Kv_Splits,  # [bs] int32
    Att_Out,  # [bs, Hq, MAX_KV_SPLITS, DV] fp32: normalised partial outputs
    Att_Lse,  # [bs, Hq, MAX_KV_SPLITS] fp32: natural-log LSE of each split
    Out,  # [bs, Hq, DV]: written here only when FUSED_REDUCE
    Split_Counters,  # [bs, Hkv] int32, zero between launches: splits finished (FUSED_REDUCE)
    Sinks,  # [Hq] fp32 per-head sink logits (natural log units; read only when HAS_SINKS)
    sm_scale,  # the K cache scale folded in
    v_scale,
    logit_cap,
    stride_qb,
    stride_qh,
    stride_kbs,
    stride_kh,
    stride_vbs,
    stride_vh,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_o_b,
    stride_o_h,
    num_kv_heads,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    D: tl.constexpr,
    DV: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr,
    USE_LOGIT_CAP: tl.constexpr,
    INPUT_PRECISION: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,
    GPU_FENCE: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
    USE_PDL: tl.constexpr = False,
    KV_PACK: tl.constexpr = 1,
    PRELOAD: tl.constexpr = False,  # the split layout and the first tile's slots before the PDL wait
):
    b = tl.program_id(0)
    kv_pack = tl.program_id(1)  # KV heads kv_pack * KV_PACK .. + KV_PACK
    split_id = tl.program_id(2)

    if PRELOAD:
        # The indptr, split counts and slot lists are built before the step's first layer, by kernels that
        # do not release their dependents early (pdl.py): read while the rotary kernel before this one
        # finishes. The tiles themselves wait (the newest token's K and V are that kernel's output).
        kv_start, split_start, split_end, n_active = _program_split(Kv_Indptr, Num_Kv_Splits, b, split_id,
                                                                    MIN_BLOCK_KV, MAX_KV_SPLITS)
        offs_first = split_start + tl.arange(0, BLOCK_N)
        loc_first = tl.load(Kv_Indices + kv_start + offs_first, mask=(offs_first < split_end) & (split_id < n_active),
                            other=0).to(tl.int64)
    pdl_prologue(USE_PDL)
    if not PRELOAD:
        kv_start, split_start, split_end, n_active = _program_split(Kv_Indptr, Num_Kv_Splits, b, split_id,
                                                                    MIN_BLOCK_KV, MAX_KV_SPLITS)

    if split_id < n_active:  # a non-empty split
        offs_h = tl.arange(0, BLOCK_H)
        mask_h = offs_h < GROUP * KV_PACK
        heads = kv_pack * KV_PACK * GROUP + offs_h
        # With KV_PACK > 1 a K (V) tile row is the pack's KV_PACK heads side by side (the heads of a slot
        # are contiguous), and the q tile is block-diagonal: row r holds its head's q in the columns of
        # its own KV head, zeros elsewhere, so one dot gives every row its own head's logits exactly.
        offs_d = tl.arange(0, KV_PACK * D)
        offs_dv = tl.arange(0, KV_PACK * DV)
        own = (offs_d[None, :] // D) == (offs_h[:, None] // GROUP)

        q = tl.load(
            Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + (offs_d % D)[None, :],
            mask=mask_h[:, None] & own,
            other=0.0,
        )
        k_head = K_Buffer + kv_pack * KV_PACK * stride_kh
        v_head = V_Buffer + kv_pack * KV_PACK * stride_vh

        # Every tile holds >= 1 valid token (the loop stays inside [split_start, split_end)), so the
        # running max is finite after the first tile and -inf is a safe start.
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, KV_PACK * DV], dtype=tl.float32)
        for start_n in range(split_start, split_end, BLOCK_N):
            offs_n = start_n + tl.arange(0, BLOCK_N)
            mask_n = offs_n < split_end
            if PRELOAD:  # the first tile's slots are loaded already
                first = start_n == split_start
                loc = tl.load(Kv_Indices + kv_start + offs_n, mask=mask_n & (start_n != split_start),
                              other=0).to(tl.int64)
                loc = tl.where(first, loc_first, loc)
            else:
                loc = tl.load(Kv_Indices + kv_start + offs_n, mask=mask_n, other=0).to(tl.int64)
            k = tl.load(k_head + loc[:, None] * stride_kbs + offs_d[None, :], mask=mask_n[:, None], other=0.0)
            # V is issued with K, before the QK dot that does not need it: the two gathers overlap
            # (at short contexts a split is one tile, and its loads' latency is the kernel's time).
            v = tl.load(v_head + loc[:, None] * stride_vbs + offs_dv[None, :], mask=mask_n[:, None], other=0.0)
            # An FP8 cache converts in registers; its K scale is folded into sm_scale, its V scale
            # multiplies each split's output (the merge is linear in V).
            qk = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=INPUT_PRECISION)  # [BLOCK_H, BLOCK_N] fp32
            qk = scale_logits(qk, sm_scale, logit_cap, USE_LOGIT_CAP)
            qk = tl.where(mask_n[None, :], qk, float("-inf"))

            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=INPUT_PRECISION)
            m_i = m_new

        if KV_PACK > 1:
            # Row r's output is its own KV head's DV columns of acc (the others mixed in other heads' V).
            acc3 = tl.reshape(acc, [BLOCK_H, KV_PACK, DV])
            mine = tl.arange(0, KV_PACK)[None, :] == (offs_h // GROUP)[:, None]
            acc_own = tl.sum(tl.where(mine[:, :, None], acc3, 0.0), axis=1)
        else:
            acc_own = acc
        offs_dv = tl.arange(0, DV)
        out = acc_own / l_i[:, None] * v_scale
        lse = m_i * 0.6931471805599453 + tl.log(l_i)  # base-2 max -> natural-log LSE
        if (n_active == 1) & FUSED_REDUCE:
            # The only split is the whole answer: write it at once, without the workspace round trip,
            # the fence, the counter and the merge (short contexts, where those latencies dominate).
            # A sink adds exp(sink) to the denominator: out * exp(lse) / (exp(lse) + exp(sink)).
            if HAS_SINKS:
                sink = tl.load(Sinks + heads, mask=mask_h, other=0.0)
                out = out / (1.0 + tl.exp(sink - lse))[:, None]
            tl.store(Out + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + offs_dv[None, :],
                     out.to(Out.dtype.element_ty), mask=mask_h[:, None])
        else:
            o_ptrs = (Att_Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split_id * stride_os
                      + offs_dv[None, :])
            tl.store(o_ptrs, out, mask=mask_h[:, None])
            tl.store(Att_Lse + b.to(tl.int64) * stride_lb + heads * stride_lh + split_id, lse, mask=mask_h)
        if FUSED_REDUCE:
            if n_active > 1:
                # The last split of (request, kv head) to finish merges all of them (stage 2 without a
                # second launch). Publication protocol (CUDA's threadfence reduction): every thread fences
                # its partial stores at GPU scope, the CTA synchronises, then one acq_rel atomic counts the
                # split; the program that sees count == active - 1 reads the partials through L2 (.cg).
                if GPU_FENCE:
                    tl.inline_asm_elementwise("fence.acq_rel.gpu; mov.u32 $0, 0;", "=r,r", [offs_h],
                                              dtype=tl.int32, is_pure=False, pack=1)
                tl.debug_barrier()
                counter = Split_Counters + b * (num_kv_heads // KV_PACK) + kv_pack
                if tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu") == n_active - 1:
                    tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")  # zero again for the next launch
                    _merge_splits(Att_Out, Att_Lse, Out, Sinks, b, heads, mask_h, n_active, stride_ob, stride_oh,
                                  stride_os, stride_lb, stride_lh, stride_o_b, stride_o_h, BLOCK_H, DV, HAS_SINKS)
    if FUSED_REDUCE:
        if (n_active == 0) & (split_id == 0):
            # No split at all (a padded CUDA-graph row with fill value 0): zeros, as stage 2 writes.
            offs_h0 = tl.arange(0, BLOCK_H)
            _store_zeros(Out, b, kv_pack * KV_PACK * GROUP + offs_h0, offs_h0 < GROUP * KV_PACK, stride_o_b,
                         stride_o_h, BLOCK_H, DV)


@triton.jit
def _split_layout(Kv_Indptr, Num_Kv_Splits, b, MIN_BLOCK_KV: tl.constexpr, MAX_KV_SPLITS: tl.constexpr):
    """Request ``b``'s split layout, the one both stages use (module docstring): (kv_start, seq_len,
    split_len, n_active), n_active = the non-empty splits, which are the first n_active (0 if seq_len 0)."""
    n_splits = tl.minimum(tl.maximum(tl.load(Num_Kv_Splits + b), 1), MAX_KV_SPLITS)
    kv_start = tl.load(Kv_Indptr + b)
    seq_len = tl.load(Kv_Indptr + b + 1) - kv_start
    split_len = tl.cdiv(tl.cdiv(seq_len, n_splits), MIN_BLOCK_KV) * MIN_BLOCK_KV
    n_active = tl.minimum(n_splits, tl.cdiv(seq_len, tl.maximum(split_len, 1)))
    return kv_start, seq_len, split_len, n_active


@triton.jit
def _program_split(Kv_Indptr, Num_Kv_Splits, b, split_id, MIN_BLOCK_KV: tl.constexpr, MAX_KV_SPLITS: tl.constexpr):
    """(kv_start, split_start, split_end, n_active) of request ``b``'s split ``split_id`` (``_split_layout``)."""
    kv_start, seq_len, split_len, n_active = _split_layout(Kv_Indptr, Num_Kv_Splits, b, MIN_BLOCK_KV, MAX_KV_SPLITS)
    split_start = split_id * split_len
    return kv_start, split_start, tl.minimum(split_start + split_len, seq_len), n_active


@triton.jit
def _store_zeros(Out, b, heads, mask_h, stride_o_b, stride_o_h, BLOCK_H: tl.constexpr, DV: tl.constexpr):
    offs_dv = tl.arange(0, DV)
    tl.store(Out + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + offs_dv[None, :],
             tl.zeros([BLOCK_H, DV], dtype=Out.dtype.element_ty), mask=mask_h[:, None])


@triton.jit
def _merge_splits(Att_Out, Att_Lse, Out, Sinks, b, heads, mask_h, n_active, stride_ob, stride_oh, stride_os,
                  stride_lb, stride_lh, stride_o_b, stride_o_h, BLOCK_H: tl.constexpr, DV: tl.constexpr,
                  HAS_SINKS: tl.constexpr):
    """Merge the first ``n_active`` splits of ``heads`` (a KV group) by their LSEs into ``Out``. A sink
    joins as one more split whose LSE is the sink logit and whose output is zero: it adds
    ``exp(sink)`` to the softmax denominator and nothing to the numerator."""
    offs_dv = tl.arange(0, DV)
    a_base = Att_Out + b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + offs_dv[None, :]
    l_base = Att_Lse + b.to(tl.int64) * stride_lb + heads * stride_lh
    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    den = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, DV], dtype=tl.float32)
    for s in range(0, n_active):
        lse_s = tl.load(l_base + s, mask=mask_h, other=0.0, cache_modifier=".cg")
        out_s = tl.load(a_base + s * stride_os, mask=mask_h[:, None], other=0.0, cache_modifier=".cg")
        m_new = tl.maximum(m, lse_s)
        old_scale = tl.exp(m - m_new)
        w = tl.exp(lse_s - m_new)
        acc = acc * old_scale[:, None] + out_s * w[:, None]
        den = den * old_scale + w
        m = m_new
    if HAS_SINKS:
        sink = tl.load(Sinks + heads, mask=mask_h, other=0.0)
        m_new = tl.maximum(m, sink)
        old_scale = tl.exp(m - m_new)
        acc = acc * old_scale[:, None]
        den = den * old_scale + tl.exp(sink - m_new)
    out = acc / den[:, None]  # n_active >= 1 here, so den > 0
    tl.store(Out + b.to(tl.int64) * stride_o_b + heads[:, None] * stride_o_h + offs_dv[None, :],
             out.to(Out.dtype.element_ty), mask=mask_h[:, None])


@triton.jit
def _decode_stage2_kernel(
    Att_Out,  # [bs, Hq, MAX_KV_SPLITS, DV] fp32
    Att_Lse,  # [bs, Hq, MAX_KV_SPLITS] fp32
    Out,  # [bs, Hq, DV]
    Kv_Indptr,
    Num_Kv_Splits,
    Sinks,
    stride_ab,
    stride_ah,
    stride_as,
    stride_lb,
    stride_lh,
    stride_o_b,
    stride_o_h,
    GROUP: tl.constexpr,
    BLOCK_H: tl.constexpr,
    DV: tl.constexpr,
    MIN_BLOCK_KV: tl.constexpr,
    MAX_KV_SPLITS: tl.constexpr,
    HAS_SINKS: tl.constexpr = False,
):
    # Grid (bs, Hkv): the same merge the fused form runs in its last split program.
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    _, _, _, n_active = _split_layout(Kv_Indptr, Num_Kv_Splits, b, MIN_BLOCK_KV, MAX_KV_SPLITS)
    offs_h = tl.arange(0, BLOCK_H)
    mask_h = offs_h < GROUP
    heads = kv_head * GROUP + offs_h
    if n_active > 0:  # the non-empty splits stage 1 wrote
        _merge_splits(Att_Out, Att_Lse, Out, Sinks, b, heads, mask_h, n_active, stride_ab, stride_ah, stride_as,
                      stride_lb, stride_lh, stride_o_b, stride_o_h, BLOCK_H, DV, HAS_SINKS)
    else:
        # seq_len == 0 (e.g. a padded CUDA-graph row with fill value 0) has no split: write zeros.
        _store_zeros(Out, b, heads, mask_h, stride_o_b, stride_o_h, BLOCK_H, DV)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor,
    attn_lse: torch.Tensor,
    num_kv_splits: torch.Tensor,
    max_kv_splits: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    *,
    config: LaunchConfig | None = None,
    split_counters: torch.Tensor | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Decode attention over a page-size-1 paged KV cache, written into ``o``.

    The cache may hold FP8 (--kv-cache-dtype fp8_*): K and V are ``stored * k_scale`` /
    ``stored * v_scale``, converted to q's dtype as they are read.

    q ``[bs, Hq, D]``; o ``[bs, Hq, Dv]``; k_buffer/v_buffer ``[num_slots, Hkv, D/Dv]``;
    kv_indptr ``[bs + 1]`` int32 and kv_indices int32: request i attends to slots
    ``kv_indices[kv_indptr[i]:kv_indptr[i + 1]]`` (its whole context, the new token included);
    attn_logits ``[bs, Hq, max_kv_splits, Dv]`` fp32 and attn_lse ``[bs, Hq, max_kv_splits]`` fp32 workspaces
    (>= bs rows); num_kv_splits ``[bs]`` int32 device tensor, values clamped to [1, max_kv_splits].
    No host sync and no allocation: capturable in a CUDA graph. ``config`` overrides the stage-1
    launch config (tuning only).

    ``split_counters`` int32 ``[>= bs * Hkv]``, all zero (and left zero): the split merge runs inside
    stage 1, by the last split of each (request, kv head) to finish, and stage 2 is not launched
    (one kernel launch fewer per layer, which matters in small decode steps). None: the two-stage form.

    ``sinks`` fp32 ``[Hq]`` (gpt-oss): per-head logits that join each softmax denominator and attend
    to nothing (the caller converts them to fp32).
    """
    bs, num_q_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    head_dim_v = v_buffer.shape[-1]
    if bs == 0:
        return
    if num_q_heads % num_kv_heads != 0:
        raise ValueError(f"num_q_heads={num_q_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    check_head_dim("head_dim", head_dim)
    check_head_dim("head_dim_v", head_dim_v)
    check_last_dim_contiguous(q=q, k_buffer=k_buffer, v_buffer=v_buffer, o=o, attn_logits=attn_logits)
    if attn_lse.stride(-1) != 1:
        raise ValueError("attn_lse: last dim must be contiguous")
    if attn_logits.shape[2] < max_kv_splits or attn_lse.shape[2] < max_kv_splits:
        raise ValueError(f"attn_logits/attn_lse hold fewer than max_kv_splits={max_kv_splits} splits")
    group = num_q_heads // num_kv_heads
    cfg, min_block_kv = decode_config(q, head_dim, num_kv_heads)
    if config is not None:
        cfg = config
    precision = dot_precision(q.dtype)
    fused = split_counters is not None
    if fused and (split_counters.dtype != torch.int32 or split_counters.numel() < bs * num_kv_heads):
        raise ValueError(f"split_counters must be int32 with >= bs * num_kv_heads = {bs * num_kv_heads} entries")
    if sinks is not None and (sinks.dtype != torch.float32 or sinks.shape != (num_q_heads,)):
        raise ValueError(f"sinks must be float32 [num_q_heads={num_q_heads}], got {sinks.dtype} {tuple(sinks.shape)}")
    sinks_arg = sinks if sinks is not None else num_kv_splits  # unused without sinks
    pdl = use_pdl(q)
    pack = cfg.kv_pack
    if pack > 1 and (num_kv_heads % pack or pack & (pack - 1) or k_buffer.stride(1) != head_dim
                     or v_buffer.stride(1) != head_dim_v):
        pack = 1  # a pack reads its heads as one contiguous row: needs whole packs of dense heads

    _decode_stage1_kernel[(bs, num_kv_heads // pack, max_kv_splits)](
        q,
        k_buffer,
        v_buffer,
        kv_indptr,
        kv_indices,
        num_kv_splits,
        attn_logits,
        attn_lse,
        o,
        split_counters if fused else num_kv_splits,  # unused when not fused
        sinks_arg,
        sm_scale * k_scale,
        v_scale,
        logit_cap,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        attn_logits.stride(0),
        attn_logits.stride(1),
        attn_logits.stride(2),
        attn_lse.stride(0),
        attn_lse.stride(1),
        o.stride(0),
        o.stride(1),
        num_kv_heads,
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group * pack)),
        D=head_dim,
        DV=head_dim_v,
        BLOCK_N=cfg.block_n,
        MIN_BLOCK_KV=min_block_kv,
        MAX_KV_SPLITS=max_kv_splits,
        USE_LOGIT_CAP=logit_cap > 0,
        INPUT_PRECISION=precision,
        FUSED_REDUCE=fused,
        GPU_FENCE=fused and q.is_cuda,
        HAS_SINKS=sinks is not None,
        USE_PDL=pdl,
        KV_PACK=pack,
        PRELOAD=envs.PDL_PRELOAD.get(),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        launch_pdl=pdl,
    )
    if fused:
        return
    _decode_stage2_kernel[(bs, num_kv_heads)](
        attn_logits,
        attn_lse,
        o,
        kv_indptr,
        num_kv_splits,
        sinks_arg,
        attn_logits.stride(0),
        attn_logits.stride(1),
        attn_logits.stride(2),
        attn_lse.stride(0),
        attn_lse.stride(1),
        o.stride(0),
        o.stride(1),
        GROUP=group,
        BLOCK_H=max(16, next_pow2(group)),
        DV=head_dim_v,
        MIN_BLOCK_KV=min_block_kv,
        MAX_KV_SPLITS=max_kv_splits,
        HAS_SINKS=sinks is not None,
        num_warps=4,
        num_stages=1,
    )


# Launched once per decode step with the step's batch size: an int argument or a block size that
# followed it would make each batch-size class (1, a multiple of 16, each power of two) a variant of
# its own, compiled on the request path the first time serving meets it. One variant serves all.
@triton.jit(do_not_specialize=["bs"], do_not_specialize_on_alignment=["Seq_Lens", "Out"])
def _num_kv_splits_kernel(
    Seq_Lens,  # [bs] int
    Out,  # [bs] int32
    bs,
    num_kv_heads,
    target_programs,
    max_kv_splits,
    min_split_len,
    BLOCK: tl.constexpr,
):
    # One program. Pass 1: total KV work (tokens x kv heads). The chunk (tokens per split) is sized so
    # that all requests' splits together make about `target_programs` stage-1 programs, but never below
    # `min_split_len`; pass 2: each request gets ceil(len / chunk) splits, clamped to [1, max_kv_splits].
    # Long requests thus get many splits, short ones one, and the per-program work is balanced.
    total = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, bs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        lens = tl.load(Seq_Lens + offs, mask=offs < bs, other=0).to(tl.int64)
        total += lens
    work = tl.sum(total, 0) * num_kv_heads
    chunk = tl.maximum((work + target_programs - 1) // target_programs, min_split_len)
    for start in range(0, bs, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        mask = offs < bs
        lens = tl.load(Seq_Lens + offs, mask=mask, other=0).to(tl.int64)
        n = (lens + chunk - 1) // chunk
        n = tl.minimum(tl.maximum(n, 1), max_kv_splits)
        tl.store(Out + offs, n.to(tl.int32), mask=mask)


_NUM_KV_SPLITS_BLOCK = 256  # requests per pass of the split planner; larger batches loop


def get_num_kv_splits(
    seq_lens: torch.Tensor,
    num_kv_splits_out: torch.Tensor,
    max_kv_splits: int,
    num_sms: int,
    num_kv_heads: int = 1,
    programs_per_sm: int = DEFAULT_PROGRAMS_PER_SM,
    min_split_len: int = DEFAULT_MIN_SPLIT_LEN,
) -> None:
    """Choose per-request split counts on device (one tiny kernel; no host sync, capturable).

    seq_lens ``[bs]`` (any int dtype; KV length of each request), num_kv_splits_out ``[>= bs]`` int32.
    chunk = max(min_split_len, ceil(sum(seq_lens) * num_kv_heads / (num_sms * programs_per_sm)));
    splits_i = clamp(ceil(seq_lens[i] / chunk), 1, max_kv_splits).
    """
    bs = seq_lens.shape[0]
    if bs == 0:
        return
    _num_kv_splits_kernel[(1,)](
        seq_lens,
        num_kv_splits_out,
        bs,
        num_kv_heads,
        max(1, num_sms * programs_per_sm),
        max_kv_splits,
        max(1, min_split_len),
        BLOCK=_NUM_KV_SPLITS_BLOCK,
        num_warps=4,
    )
