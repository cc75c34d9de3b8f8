"""The batches that run draft trees through a model: TARGET_VERIFY (the target checks every node) and
the DRAFT_EXTEND of one device tree-expansion step (the draft recomputes a partial tree).

Layout: request i's tree nodes are consecutive tokens, in tree order; node n sits at position
``kv_len_i + depth(n)`` and attends to the request's prefix and to its own ancestors (custom mask,
layout of ``plait.attention.base.custom_mask_of``).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT
from plait.speculative.draft_tree import level_tree
from plait.speculative.tree import (
    DraftTree,
    build_verify_mask_from_ancestors,
    depths_of,
    fill_verify_mask,
    verify_mask_size,
)
from plait.transfer import ints_and_bools_to_device, ints_to_device
from plait.two_batch_overlap import slice_tree_mask


class TreeRow(Protocol):
    """Where one request's tree goes: its request-pool row and the positions with KV below the tree
    (``plait.scheduler.req.Req`` satisfies it)."""

    @property
    def kv_len(self) -> int: ...

    @property
    def req_pool_idx(self) -> int | None: ...


@dataclass(frozen=True)
class DraftRow:
    """A tree row that is not a request's own: a draft tree rooted at ``kv_len`` (EAGLE's root
    sits one position below the request's ``kv_len``)."""

    kv_len: int
    req_pool_idx: int


@dataclass
class VerifyInput:
    """``ForwardBatch.spec_info`` of a TARGET_VERIFY batch."""

    trees: list[DraftTree]
    # Flattened bool, layout of plait.attention.base.custom_mask_of; None: every request's nodes are
    # a chain (padding included) and attend causally, which the kernels do without a mask.
    custom_mask: torch.Tensor | None
    # Tokens verified per request (root included). The executor reads widths from here, never from
    # a global draft width: widths differ between requests and between steps.
    num_tokens_per_req: list[int]

    def split(self, start: int, end: int, seq_lens_cpu: Sequence[int]) -> VerifyInput:
        """Requests [start, end) (a two-batch-overlap child)."""
        mask = self.custom_mask
        if mask is not None:
            mask = slice_tree_mask(mask, self.num_tokens_per_req, seq_lens_cpu, start, end)
        return VerifyInput(self.trees[start:end], mask, self.num_tokens_per_req[start:end])


def build_verify_batch(rows: Sequence[TreeRow], trees: list[DraftTree], slots: torch.Tensor,
                       device: torch.device | str, pad_width: int | None = None,
                       input_ids: torch.Tensor | None = None, custom_mask: torch.Tensor | None = None,
                       causal_chains: bool = False) -> ForwardBatch:
    """The TARGET_VERIFY batch of ``trees`` (their nodes' KV into ``slots``, tree order).

    ``pad_width``: every request's block is padded to this many tokens with dummy nodes (children
    of the root, token 0, KV into the reserved dummy slot), so a batch of mixed widths replays
    one captured graph. ``spec_info.trees`` stay the real trees, and request i's real nodes are
    logits rows ``[i * pad_width, i * pad_width + width_i)``.

    ``input_ids`` / ``custom_mask``: the nodes' tokens and the mask when they are on the device
    already (draft-tree expansion); ``trees`` then give only the shape (widths and depths).

    ``causal_chains`` (``EngineConfig.causal_chain_verify``): when every tree is a chain, the batch
    carries no mask (causal attention is a chain's tree attention), and the dummy nodes follow the
    chain."""
    chains = causal_chains and custom_mask is None and all(t.is_chain for t in trees)
    prefix = [r.kv_len for r in rows]
    dummy = len(slots)  # the dummy slot's index in the padded layout's source
    src: list[int] = []  # padded layout: slot j of the real layout, or ``dummy``
    ids: list[int] = []
    pos: list[int] = []
    shapes: list[tuple[int, ...]] = []  # per request its nodes' parents (padded): the mask's layout
    # Dummy nodes are token 0 with their KV in the dummy slot: children of the root (depth 1), or in a
    # chain batch children of the last real node, one position past the chain (causal attention: no
    # real node attends to them), as far as a real next node could reach.
    if chains:  # node i of a chain at kv_len + i: no depths to walk (the chain verify's hot path)
        off = 0
        for tree, pre in zip(trees, prefix, strict=True):
            w = tree.width
            ids += tree.tokens
            pos += range(pre, pre + w)
            if pad_width is not None:
                src += range(off, off + w)
                if pad_width > w:
                    ids += [0] * (pad_width - w)
                    pos += [pre + w] * (pad_width - w)
                    src += [dummy] * (pad_width - w)
            off += w
        widths = [pad_width] * len(trees) if pad_width is not None else [t.width for t in trees]
    else:
        real_widths = [t.width for t in trees]
        shapes = [tuple(t.parents) for t in trees]
        tokens = [t.tokens for t in trees]
        if pad_width is not None:
            shapes = [p + (0,) * (pad_width - len(p)) for p in shapes]
            tokens = [t + [0] * (pad_width - len(t)) for t in tokens]
            off = 0
            for w in real_widths:
                src.extend(range(off, off + w))
                src.extend([dummy] * (pad_width - w))
                off += w
        widths = [len(p) for p in shapes]
        for toks, parents, pre in zip(tokens, shapes, prefix, strict=True):
            ids.extend(toks)
            pos.extend([pre + d for d in depths_of(parents)])
    seq_lens = [p + w for p, w in zip(prefix, widths, strict=True)]
    starts = [0, *itertools.accumulate(widths[:-1])]
    pool_rows = [r.req_pool_idx for r in rows]
    parts = [ids, pos, pool_rows, seq_lens, widths, prefix, starts, src]
    mask = custom_mask  # None for a chain batch
    if custom_mask is None and not chains:
        # The mask rides in the same copy as the integers: one host-to-device transfer per batch.
        flat = np.empty(verify_mask_size(widths, prefix), dtype=np.bool_)
        fill_verify_mask(flat, shapes, prefix)
        (ids_t, pos_t, rows_t, seq_t, ext_t, pre_t, starts_t, src_t), mask = ints_and_bools_to_device(parts, flat,
                                                                                                       device)
    else:
        ids_t, pos_t, rows_t, seq_t, ext_t, pre_t, starts_t, src_t = ints_to_device(parts, device)
    if pad_width is not None:
        slots = torch.cat([slots, slots.new_full((1,), DUMMY_KV_SLOT)])[src_t]
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(rows),
        input_ids=ids_t if input_ids is None else input_ids,
        req_pool_indices=rows_t, seq_lens=seq_t, out_cache_loc=slots, positions=pos_t,
        seq_lens_cpu=seq_lens, seq_lens_sum=sum(seq_lens),
        extend=ExtendInfo(num_tokens=len(ids), seq_lens=ext_t, prefix_lens=pre_t, start_loc=starts_t,
                          seq_lens_cpu=widths, prefix_lens_cpu=prefix),
    )
    # logits_indices stays None: every node's logits are needed.
    fb.spec_info = VerifyInput(trees, mask, widths)
    return fb


@dataclass(frozen=True)
class ChainVerifyInput:
    """``ForwardBatch.spec_info`` of a chain batch launched ahead (``chain_verify_batch_after``): its
    tokens are chosen on the device, so the host has no trees for it yet; chains carry no mask."""

    num_tokens_per_req: list[int]
    custom_mask: None = None


def chain_verify_batch_after(greedy: torch.Tensor, guesses: torch.Tensor, next_drafts: torch.Tensor,
                             kv_lens: torch.Tensor, kv_lens_cpu: list[int], pool_rows: torch.Tensor,
                             slots: torch.Tensor) -> ForwardBatch:
    """The TARGET_VERIFY batch that follows a verify of chains ``W`` wide, built on the device from that
    verify's argmax before the host reads it (the batch's ``lens_on_device``).

    ``greedy`` [bs, W]: the verify's argmax per node; ``guesses`` [bs, W - 1]: its drafts (nodes
    1..W-1); ``next_drafts`` [bs, W, W - 1]: per request and per number of accepted drafts ``a``,
    the drafts to verify after that outcome; ``kv_lens`` [bs]: the requests' KV lengths before the
    verify (its root's position). Greedy acceptance takes the longest run of drafts equal to the
    argmax before them; the bonus is the argmax after the run. The next chain is the bonus, then
    ``next_drafts[b, a]``, at ``kv_len + a + 1`` onwards, its KV into ``slots`` (int64 [bs * W])."""
    bs, width = greedy.shape
    accepted = (guesses == greedy[:, :-1]).to(torch.int32).cumprod(1).sum(1)  # a per request, 0..W-1
    index = accepted.long()[:, None]
    bonus = greedy.gather(1, index)
    drafts = next_drafts.gather(1, index[:, :, None].expand(bs, 1, width - 1))[:, 0]
    prefix = kv_lens + accepted + 1
    steps = torch.arange(width, device=greedy.device)
    fb = ForwardBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs,
        input_ids=torch.cat([bonus, drafts], 1).reshape(-1), req_pool_indices=pool_rows,
        seq_lens=prefix + width, out_cache_loc=slots, positions=(prefix[:, None] + steps).reshape(-1),
        seq_lens_cpu=[k + 1 + width for k in kv_lens_cpu], seq_lens_sum=sum(kv_lens_cpu) + (1 + width) * bs,
        extend=ExtendInfo(num_tokens=bs * width, seq_lens=torch.full_like(prefix, width), prefix_lens=prefix,
                          start_loc=torch.arange(0, bs * width, width, device=greedy.device), seq_lens_cpu=[width] * bs,
                          prefix_lens_cpu=[k + 1 for k in kv_lens_cpu]),
        lens_on_device=True,
    )
    fb.spec_info = ChainVerifyInput([width] * bs)
    return fb


def tree_draft_batch(rows: Sequence[TreeRow], tokens: torch.Tensor, ancestors: torch.Tensor, topk: int
                     ) -> ForwardBatch:
    """The DRAFT_EXTEND batch of one device tree-expansion step (``plait.speculative.draft_tree``):
    every request's first ``width`` nodes, tokens ``[bs, width]`` and ancestor matrices
    ``[bs, width, width]`` from the device, node n at ``kv_len + depth(n)``, KV into the dummy
    slot (the partial tree is recomputed each step, so no slot is held)."""
    bs, width = tokens.shape
    slots = torch.full((bs * width,), DUMMY_KV_SLOT, dtype=torch.int64, device=tokens.device)
    mask = build_verify_mask_from_ancestors(ancestors, [r.kv_len for r in rows])
    fb = build_verify_batch(rows, [level_tree(width, topk)] * bs, slots, tokens.device,
                            input_ids=tokens.reshape(-1), custom_mask=mask)
    fb.forward_mode = ForwardMode.DRAFT_EXTEND
    return fb
