"""Shared attention-backend test cases: a paged KV cache with random contents, a layer description,
extend batches over cached prefixes, and one planned forward through the backend contract."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool


def make_pools(hkv: int, d: int, seed: int = 0, dtype: torch.dtype = torch.float32, device: str = "cpu",
               max_context: int = 96, slots: int = 400,
               max_reqs: int = 16) -> tuple[ReqToTokenPool, MHATokenToKVPool, torch.Generator]:
    g = torch.Generator().manual_seed(seed)
    pool = ReqToTokenPool(max_reqs, max_context, device)  # extend_batch uses rows 2.. (max_reqs - 2 requests)
    kv = MHATokenToKVPool(slots, dtype, 1, hkv, d, device)
    kv.k_buffer[0].copy_(torch.randn(kv.k_buffer[0].shape, generator=g))
    kv.v_buffer[0].copy_(torch.randn(kv.v_buffer[0].shape, generator=g))
    return pool, kv, g


def layer(hq: int, hkv: int, d: int, window: int | None = None, logit_cap: float = 0.0):
    return SimpleNamespace(layer_id=0, num_heads=hq, num_kv_heads=hkv, head_dim=d, scaling=d**-0.5,
                           logit_cap=logit_cap, sliding_window=window, sinks=None)


def extend_batch(pool: ReqToTokenPool, g: torch.Generator, prefix: list[int], ext: list[int],
                 num_slots: int = 400) -> ForwardBatch:
    """Requests in rows 2.. with random, scattered KV slots (never the dummy slot 0)."""
    rows = list(range(2, 2 + len(prefix)))
    slots = torch.randperm(num_slots - 1, generator=g)[: sum(prefix) + sum(ext)] + 1
    dev = pool.req_to_token.device
    new_slots = []
    off = 0
    for row, p, e in zip(rows, prefix, ext, strict=True):
        pool.write(row, 0, slots[off : off + p + e].to(dev))
        new_slots.append(slots[off + p : off + p + e])
        off += p + e
    t = sum(ext)
    starts = [sum(ext[:i]) for i in range(len(ext))]
    lens = [p + e for p, e in zip(prefix, ext, strict=True)]
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(rows), input_ids=torch.zeros(t, dtype=torch.long, device=dev),
        req_pool_indices=torch.tensor(rows, device=dev), seq_lens=torch.tensor(lens, device=dev),
        out_cache_loc=torch.cat(new_slots).to(dev),
        positions=torch.cat([torch.arange(p, p + e) for p, e in zip(prefix, ext, strict=True)]).to(dev),
        seq_lens_cpu=lens, seq_lens_sum=sum(lens),
        extend=ExtendInfo(num_tokens=t, seq_lens=torch.tensor(ext, device=dev),
                          prefix_lens=torch.tensor(prefix, device=dev), start_loc=torch.tensor(starts, device=dev),
                          seq_lens_cpu=ext, prefix_lens_cpu=prefix))


def run(backend, fb: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay,
        clone: bool = True) -> torch.Tensor:
    """Plan ``fb`` through the contract and run one forward. ``clone=False`` hands q/k/v as they are
    (strided views stay strided: a clone of a non-dense view is contiguous)."""
    fb.reset_forward_metadata_marker()
    backend.init_forward_metadata(fb)
    if clone:
        q, k, v = q.clone(), k.clone(), v.clone()
    return backend.forward(q, k, v, lay, fb)


def fused_qkv(t: int, hq: int, hkv: int, d: int, g: torch.Generator, dtype: torch.dtype = torch.float32,
              device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [t, hq*d], k/v [t, hkv*d] as column views of one [t, (hq + 2 hkv) * d] projection output, as the
    model hands them to attention: last dim contiguous, token stride (hq + 2 hkv) * d."""
    qkv = torch.randn(t, (hq + 2 * hkv) * d, generator=g).to(device, dtype)
    return qkv.split([hq * d, hkv * d, hkv * d], dim=1)


def as_target_verify(fb: ForwardBatch, custom_mask: torch.Tensor | None) -> ForwardBatch:
    """``fb`` (from extend_batch) as a TARGET_VERIFY batch under ``custom_mask``."""
    fb.forward_mode = ForwardMode.TARGET_VERIFY
    fb.spec_info = SimpleNamespace(custom_mask=custom_mask)
    return fb


def random_tree_mask(prefix: list[int], ext: list[int], g: torch.Generator) -> torch.Tensor:
    """A flattened verify-style custom mask: each new token sees the whole prefix, itself, and a
    random subset of the other new tokens (rows of [ext_i, prefix_i + ext_i], concatenated)."""
    blocks = []
    for p, e in zip(prefix, ext, strict=True):
        m = torch.rand(e, p + e, generator=g) > 0.4
        m[:, :p] = True
        m[torch.arange(e), p + torch.arange(e)] = True  # every token sees itself
        blocks.append(m.flatten())
    return torch.cat(blocks)

