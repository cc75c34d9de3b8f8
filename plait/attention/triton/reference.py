"""Plain-torch references for the Triton kernels (same signatures; slow, per-request loops; fp32 math).

They gather K/V from the page-size-1 cache through ``kv_indices`` and compute softmax attention in
float32, then cast into the output tensor. Workspace arguments (``attn_logits``, ``attn_lse``,
``num_kv_splits``, ``max_kv_splits``) are accepted and ignored: splitting does not change the math.
No Triton import, so these run anywhere.
"""

from __future__ import annotations

import torch


def build_kv_indices(
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_start_idx: torch.Tensor | None = None,
) -> None:
    for i in range(req_pool_indices.shape[0]):
        row = int(req_pool_indices[i])
        n = int(seq_lens[i])
        start = 0 if kv_start_idx is None else int(kv_start_idx[i])
        out = int(kv_indptr[i])
        kv_indices[out : out + n] = req_to_token[row, start : start + n].to(kv_indices.dtype)



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
    num_rows = row_lens.shape[0]
    lists: list[torch.Tensor] = []
    for b in range(req_pool_indices.shape[0]):
        q0, q1 = int(qo_indptr[b]), int(qo_indptr[b + 1])
        pre, ext = int(prefix_lens[b]), q1 - q0
        prefix = req_to_token[int(req_pool_indices[b]), :pre]
        for i in range(ext):
            if custom_mask is None:
                seen = torch.arange(ext, device=out_cache_loc.device) <= i
            else:
                assert mask_indptr is not None
                start = int(mask_indptr[b]) + i * (pre + ext) + pre
                seen = custom_mask[start : start + ext].bool()
            lists.append(torch.cat([prefix, out_cache_loc[q0:q1][seen].to(prefix.dtype)]))
    assert len(lists) == num_rows
    kv_indptr[0] = 0
    off = 0
    for r, slots in enumerate(lists):
        row_lens[r] = slots.numel()
        kv_indices[off : off + slots.numel()] = slots.to(kv_indices.dtype)
        off += slots.numel()
        kv_indptr[r + 1] = off


def store_kv(
    k_buffer: torch.Tensor, v_buffer: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> None:
    k_buffer[loc.long()] = k.to(k_buffer.dtype)
    v_buffer[loc.long()] = v.to(v_buffer.dtype)


def get_num_kv_splits(
    seq_lens: torch.Tensor,
    num_kv_splits_out: torch.Tensor,
    max_kv_splits: int,
    num_sms: int,
    num_kv_heads: int = 1,
    programs_per_sm: int = 4,  # == decode.DEFAULT_PROGRAMS_PER_SM (a test checks)
    min_split_len: int = 128,  # == decode.DEFAULT_MIN_SPLIT_LEN
) -> None:
    """Same heuristic as the kernel (see ``decode.get_num_kv_splits``)."""
    bs = seq_lens.shape[0]
    if bs == 0:
        return
    lens = seq_lens.to(torch.int64)
    target = max(1, num_sms * programs_per_sm)
    work = lens.sum() * num_kv_heads
    chunk = torch.clamp((work + target - 1) // target, min=max(1, min_split_len))
    n = torch.clamp((lens + chunk - 1) // chunk, 1, max_kv_splits)
    num_kv_splits_out[:bs] = n.to(num_kv_splits_out.dtype)


def _attend(
    q: torch.Tensor,  # [M, Hq, D] fp32
    k: torch.Tensor,  # [N, Hkv, D] fp32
    v: torch.Tensor,  # [N, Hkv, Dv] fp32
    visible: torch.Tensor | None,  # [M, N] bool, None = all visible
    sm_scale: float,
    logit_cap: float,
    sinks: torch.Tensor | None = None,  # [Hq]: per-head logits in the denominator only
) -> torch.Tensor:  # [M, Hq, Dv] fp32
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    s = torch.einsum("mhd,nhd->hmn", q, k) * sm_scale
    if logit_cap > 0:
        s = logit_cap * torch.tanh(s / logit_cap)
    if visible is not None:
        s = s.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        sink = sinks.float()[:, None, None].expand(-1, s.shape[1], 1)
        p = torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]
    else:
        p = torch.softmax(s, dim=-1)
    p = torch.nan_to_num(p, nan=0.0)  # rows that see nothing -> zeros (matches the kernels)
    return torch.einsum("hmn,nhd->mhd", p, v)


def decode_attention_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    attn_logits: torch.Tensor | None,
    attn_lse: torch.Tensor | None,
    num_kv_splits: torch.Tensor | None,
    max_kv_splits: int,
    sm_scale: float,
    logit_cap: float = 0.0,
    *,
    sinks: torch.Tensor | None = None,
) -> None:
    for i in range(q.shape[0]):
        lo, hi = int(kv_indptr[i]), int(kv_indptr[i + 1])
        if hi == lo:
            o[i] = 0
            continue
        slots = kv_indices[lo:hi].long()
        out = _attend(q[i : i + 1].float(), k_buffer[slots].float(), v_buffer[slots].float(), None, sm_scale, logit_cap,
                     sinks)
        o[i] = out[0].to(o.dtype)


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
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    bs = qo_indptr.shape[0] - 1
    for i in range(bs):
        q0, q1 = int(qo_indptr[i]), int(qo_indptr[i + 1])
        p0, p1 = int(kv_indptr[i]), int(kv_indptr[i + 1])
        ext, pre = q1 - q0, p1 - p0
        if ext == 0:
            continue
        slots = kv_indices[p0:p1].long()
        k = torch.cat([k_buffer[slots].float(), k_extend[q0:q1].float()])
        v = torch.cat([v_buffer[slots].float(), v_extend[q0:q1].float()])
        if custom_mask is not None:
            assert mask_indptr is not None
            m0 = int(mask_indptr[i])
            visible = custom_mask[m0 : m0 + ext * (pre + ext)].view(ext, pre + ext).bool()
        elif is_causal:
            cols = torch.arange(pre + ext, device=q_extend.device)
            rows = torch.arange(ext, device=q_extend.device)
            visible = cols[None, :] <= (pre + rows)[:, None]
        else:
            visible = None
        if sliding_window:
            cols = torch.arange(pre + ext, device=q_extend.device)
            rows = torch.arange(ext, device=q_extend.device) + pre
            window = cols[None, :] > rows[:, None] - sliding_window
            visible = window if visible is None else visible & window
        out = _attend(q_extend[q0:q1].float(), k, v, visible, sm_scale, logit_cap, sinks)
        o_extend[q0:q1] = out.to(o_extend.dtype)
