"""Two-batch overlap (TBO): where a batch splits into two micro-batches, and the two child batches.

A batch is cut at a request boundary (``split_seq_index``) and a token boundary
(``split_token_index``). DECODE and TARGET_VERIFY cut in the middle of the requests; EXTEND and
MIXED at the request boundary that best balances the tokens, or, when even that boundary leaves one
side under ``threshold`` of the tokens, inside one request at ``total // 2`` ("two-chunk": that
request's first tokens go to child A, the rest to child B, which sees them as cached prefix).

``split_forward_batch`` builds the two children from a ``ForwardBatch``. ``FIELD_RULES`` declares,
for every ``ForwardBatch`` field, whether the children slice it, share it or recompute it; a field
without a rule makes ``split_forward_batch`` raise, so a new field cannot be silently shared.

This module sits on the ground floor beside ``ForwardBatch``: the attention backend of TBO and the
model read the children it builds.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from typing import Any

import torch

from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode, MLPSyncMetadata, SpecInput

DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD = 0.48


def token_num_per_seq(forward_mode: ForwardMode, spec_info: SpecInput | None) -> int | None:
    """Tokens each request contributes: 1 for DECODE, the draft width for TARGET_VERIFY, 0 for
    IDLE, None for extends (their requests contribute different counts)."""
    if forward_mode.is_target_verify():
        assert spec_info is not None, "a target-verify batch carries its spec input"
        width = spec_info.num_tokens_per_req
        if isinstance(width, int):
            return width
        widths = set(width)
        return widths.pop() if len(widths) == 1 else None
    if forward_mode.is_decode():
        return 1
    if forward_mode.is_idle():
        return 0
    return None


def _is_extend_like(forward_mode: ForwardMode) -> bool:
    return forward_mode.is_extend() and not forward_mode.is_target_verify()


def _split_by_balanced_sum(lens: Sequence[int]) -> int:
    """The request boundary (1..len-1) with the smallest token difference between the sides; the
    scan stops once the difference grows (the left sum only grows). 0 for fewer than 2 requests."""
    total, left, best, best_diff = sum(lens), 0, 0, float("inf")
    for i in range(1, len(lens)):
        left += lens[i - 1]
        diff = abs(left - (total - left))
        if diff > best_diff:
            break
        best, best_diff = i, diff
    return best


def _split_by_cum_over_half(lens: Sequence[int]) -> int:
    """The request in which the running token sum first passes ``total // 2``: the one two-chunk
    cuts."""
    half, left = sum(lens) // 2, 0
    for i, n in enumerate(lens):
        left += n
        if left > half:
            return i
    return 0


def is_two_chunk_split(extend_lens: Sequence[int], threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> bool:
    """Whether an extend batch is cut inside a request: the best request boundary leaves either
    side with less than ``threshold`` of the tokens, and cutting at ``total // 2`` does not give
    child A more requests than tokens (each child request needs at least one token)."""
    if not 0.0 <= threshold <= 0.5:
        raise ValueError(f"tbo_token_distribution_threshold must be in [0, 0.5], got {threshold}")
    total = sum(extend_lens)
    if threshold == 0.0 or total < 2:
        return False
    left = sum(extend_lens[:_split_by_balanced_sum(extend_lens)])
    if threshold * total <= left <= (1 - threshold) * total:
        return False
    seq = _split_by_cum_over_half(extend_lens)
    before = sum(extend_lens[:seq])
    # Child A holds requests 0..seq, the last one cut to (total // 2 - before) >= 1 tokens.
    return total // 2 - before >= 1 and seq + 1 <= total // 2


def compute_split_seq_index(forward_mode: ForwardMode, num_tokens: int, extend_lens: Sequence[int] | None,
                            token_num_per_seq: int | None = 1,
                            threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> int | None:
    """The first request of child B (for a two-chunk extend: the request that is cut, which both
    children hold). None where the batch cannot be split into two non-empty halves."""
    if forward_mode.is_idle():
        if num_tokens != 0:
            raise ValueError(f"an IDLE batch has no tokens, got {num_tokens}")
        return 0
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        if token_num_per_seq is None and forward_mode.is_target_verify() and extend_lens is not None:
            index = len(extend_lens) // 2  # trees of different widths: half the requests
        elif not token_num_per_seq:
            return None
        else:
            index = (num_tokens // token_num_per_seq) // 2
        return index if index > 0 else None
    if _is_extend_like(forward_mode):
        if extend_lens is None:
            raise ValueError("an extend batch is split by its extend_lens")
        if is_two_chunk_split(extend_lens, threshold):
            return _split_by_cum_over_half(extend_lens)
        index = _split_by_balanced_sum(extend_lens)
        return index if index > 0 else None
    raise ValueError(f"no two-batch split for forward mode {forward_mode.name}")


def compute_split_token_index(split_seq_index: int, forward_mode: ForwardMode, extend_seq_lens: Sequence[int] | None,
                              token_num_per_seq: int | None = 1,
                              threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> int:
    """The first token of child B."""
    if forward_mode.is_idle():
        if split_seq_index != 0:
            raise ValueError("an IDLE batch splits at 0")
        return 0
    if forward_mode.is_decode() or forward_mode.is_target_verify():
        if token_num_per_seq is None:
            assert extend_seq_lens is not None, "a verify batch of mixed widths splits by its widths"
            return sum(extend_seq_lens[:split_seq_index])
        return split_seq_index * token_num_per_seq
    if _is_extend_like(forward_mode):
        if extend_seq_lens is None:
            raise ValueError("an extend batch is split by its extend_seq_lens")
        if is_two_chunk_split(extend_seq_lens, threshold):
            return sum(extend_seq_lens) // 2
        return sum(extend_seq_lens[:split_seq_index])
    raise ValueError(f"no two-batch split for forward mode {forward_mode.name}")


@dataclasses.dataclass(frozen=True)
class TboSplit:
    """Where one batch splits: child A holds requests [0, seq_end_a) and tokens [0, token_index);
    child B requests [seq_index, bs) and tokens [token_index, num_tokens). ``seq_end_a`` is
    ``seq_index + 1`` for a two-chunk split (the cut request is in both), else ``seq_index``."""

    seq_index: int
    token_index: int
    two_chunk: bool

    @property
    def seq_end_a(self) -> int:
        return self.seq_index + 1 if self.two_chunk else self.seq_index


def plan_split(fb: ForwardBatch, threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> TboSplit | None:
    """The split of ``fb``, or None where it has no two non-empty halves."""
    mode = fb.forward_mode
    if mode.is_idle():
        return None
    per_seq = token_num_per_seq(mode, fb.spec_info)
    lens = fb.extend.seq_lens_cpu if fb.extend is not None else None
    seq = compute_split_seq_index(mode, fb.num_tokens, lens, per_seq, threshold)
    if seq is None:
        return None
    two_chunk = lens is not None and _is_extend_like(mode) and is_two_chunk_split(lens, threshold)
    token = compute_split_token_index(seq, mode, lens, per_seq, threshold)
    if token <= 0 or token >= fb.num_tokens:
        return None
    return TboSplit(seq, token, two_chunk)


class Rule(enum.Enum):
    """How a child batch gets one ``ForwardBatch`` field."""

    SPLIT_TOKENS = "split by tokens"  # rows [token_start, token_end)
    SPLIT_SEQS = "split by requests"  # rows [seq_start, seq_end)
    SHARED = "shared"  # the same object in parent and children
    RECOMPUTED = "recomputed"  # derived anew for each child


# Every ForwardBatch field and how the children get it. ``split_forward_batch`` refuses a batch
# type with a field missing here: a new field must be given a rule, never inherited by accident.
FIELD_RULES: dict[str, Rule] = {
    "forward_mode": Rule.RECOMPUTED,  # the parent's; IDLE for an empty child (a DP rank's empty half)
    "batch_size": Rule.RECOMPUTED,
    "input_ids": Rule.SPLIT_TOKENS,
    "req_pool_indices": Rule.SPLIT_SEQS,
    "seq_lens": Rule.RECOMPUTED,  # split by requests; two-chunk shortens child A's last request
    "out_cache_loc": Rule.SPLIT_TOKENS,
    "positions": Rule.SPLIT_TOKENS,
    "seq_lens_cpu": Rule.RECOMPUTED,
    "seq_lens_sum": Rule.RECOMPUTED,
    "logits_indices": Rule.RECOMPUTED,  # the parent selects the rows it samples after the children
    "input_logprobs": Rule.RECOMPUTED,  # the parent scores prompt rows after the children: None
    "actual_forward_mode": Rule.SHARED,
    "extend": Rule.RECOMPUTED,
    "spec_info": Rule.RECOMPUTED,
    "lens_on_device": Rule.RECOMPUTED,  # never split (split_forward_batch refuses it): False on children
    "mlp_sync": Rule.RECOMPUTED,  # the parent's micro_batches[i] under DP attention, else empty
    "attn_backend": Rule.RECOMPUTED,  # each child gets its own backend (one per micro-batch)
    "sampling_info": Rule.RECOMPUTED,  # sampling happens on the parent: None on children
    "next_token_logits_buffer": Rule.RECOMPUTED,
    "hidden_capture": Rule.RECOMPUTED,  # the parent captures: None on children
    "dp_row_exchange": Rule.SHARED,
    "forward_metadata_ready": Rule.RECOMPUTED,  # plan marker: reset on every child
    "forward_metadata_planned_bs": Rule.RECOMPUTED,
    "forward_metadata_planned_num_tokens": Rule.RECOMPUTED,
    "forward_metadata_replan_equivalent": Rule.RECOMPUTED,
    "tbo_children": Rule.RECOMPUTED,  # children are never split again: None
}


def check_field_rules(cls: type = ForwardBatch) -> None:
    """Raise when ``cls`` has a field without a rule, or a rule names no field."""
    names = {f.name for f in dataclasses.fields(cls)}
    missing, stale = sorted(names - FIELD_RULES.keys()), sorted(FIELD_RULES.keys() - names)
    if missing or stale:
        raise TypeError(f"two-batch overlap: ForwardBatch fields without a split rule {missing}, rules for "
                        f"fields that do not exist {stale}: give each field a Rule in FIELD_RULES")


def slice_tree_mask(mask: torch.Tensor, widths: Sequence[int], seq_lens_cpu: Sequence[int], start: int,
                    end: int) -> torch.Tensor:
    """Requests [start, end) of a flattened verify tree mask: request i's block is
    [width_i, seq_len_i] (its tree nodes against its prefix and nodes; seq_len_i = prefix + width),
    the blocks back to back (the layout of plait.attention.base.custom_mask_of)."""
    sizes = [w * n for w, n in zip(widths, seq_lens_cpu, strict=True)]
    lo = sum(sizes[:start])
    return mask[lo : lo + sum(sizes[start:end])]


def _split_spec_info(spec_info: SpecInput | None, seq_start: int, seq_end: int,
                     seq_lens_cpu: Sequence[int]) -> SpecInput | None:
    """A verify batch's spec input restricted to requests [seq_start, seq_end): the spec input
    slices itself (an optional ``split(start, end, seq_lens_cpu)`` member, read by name), since only
    it knows what else it holds (the draft trees on rank 0)."""
    if spec_info is None:
        return None
    split = getattr(spec_info, "split", None)
    if split is None:
        raise TypeError(f"{type(spec_info).__name__} cannot be split for two-batch overlap (it has no split())")
    return split(seq_start, seq_end, seq_lens_cpu)


def _child(fb: ForwardBatch, index: int, seq_start: int, seq_end: int, token_start: int, token_end: int,
           seq_lens_cpu: list[int], extend: ExtendInfo | None, attn_backend: Any, cut: bool) -> ForwardBatch:
    # A child without tokens (under DP attention a rank's batch too small to split, or an IDLE rank's)
    # is IDLE: it attends over nothing and joins its micro-batch's MLP collectives on zero rows.
    empty = token_start == token_end
    values: dict[str, Any] = {}
    for f in dataclasses.fields(fb):
        rule = FIELD_RULES[f.name]
        value = getattr(fb, f.name)
        if rule is Rule.SHARED:
            values[f.name] = value
        elif rule is Rule.SPLIT_TOKENS:
            values[f.name] = value[token_start:token_end]
        elif rule is Rule.SPLIT_SEQS:
            values[f.name] = value[seq_start:seq_end]
    # A view of the parent's lengths (a graph replay's children read the static buffers) unless a
    # two-chunk cut changed one of them.
    seq_lens = (torch.tensor(seq_lens_cpu, dtype=fb.seq_lens.dtype, device=fb.seq_lens.device) if cut
                else fb.seq_lens[seq_start:seq_end])
    micro_batches = fb.mlp_sync.micro_batches
    child = ForwardBatch(
        **values,
        forward_mode=ForwardMode.IDLE if empty else fb.forward_mode,
        batch_size=seq_end - seq_start,
        seq_lens=seq_lens,
        seq_lens_cpu=seq_lens_cpu,
        seq_lens_sum=sum(seq_lens_cpu),
        extend=None if empty else extend,
        spec_info=None if empty else _split_spec_info(fb.spec_info, seq_start, seq_end, fb.seq_lens_cpu),
        mlp_sync=MLPSyncMetadata() if micro_batches is None else micro_batches[index],
        attn_backend=attn_backend,
    )
    child.reset_forward_metadata_marker()
    return child


def _extend_info(seq_lens: list[int], prefix_lens: list[int], device: torch.device) -> ExtendInfo:
    starts = [0]
    for n in seq_lens[:-1]:
        starts.append(starts[-1] + n)
    return ExtendInfo(
        num_tokens=sum(seq_lens),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32, device=device),
        start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        seq_lens_cpu=seq_lens,
        prefix_lens_cpu=prefix_lens,
    )


def split_forward_batch(fb: ForwardBatch, split: TboSplit,
                        attn_backends: tuple[Any, Any] = (None, None)) -> tuple[ForwardBatch, ForwardBatch]:
    """The two children of ``fb`` at ``split``, each with its own attention backend and an unset
    plan marker. For a two-chunk split, child A's last request ends after its first tokens and
    child B's first request starts with them as cached prefix."""
    check_field_rules(type(fb))
    if fb.tbo_children is not None:
        raise ValueError("a TBO child batch is not split again")
    if fb.lens_on_device:
        raise ValueError("a batch whose lengths are on the device only is not split: the split reads the host lists")
    bs, n = fb.batch_size, fb.num_tokens
    seq_a_end, seq_b, tok = split.seq_end_a, split.seq_index, split.token_index
    lens_a, lens_b = list(fb.seq_lens_cpu[:seq_a_end]), list(fb.seq_lens_cpu[seq_b:])
    ext_a = ext_b = None
    if fb.extend is not None:
        e = fb.extend
        ext_lens_a, ext_lens_b = list(e.seq_lens_cpu[:seq_a_end]), list(e.seq_lens_cpu[seq_b:])
        pre_a, pre_b = list(e.prefix_lens_cpu[:seq_a_end]), list(e.prefix_lens_cpu[seq_b:])
        if split.two_chunk:
            first_part = tok - sum(e.seq_lens_cpu[:seq_b])  # the cut request's tokens in child A
            ext_lens_a[-1] = first_part
            lens_a[-1] = pre_a[-1] + first_part
            ext_lens_b[0] -= first_part
            pre_b[0] += first_part
        device = e.seq_lens.device
        ext_a, ext_b = _extend_info(ext_lens_a, pre_a, device), _extend_info(ext_lens_b, pre_b, device)
    child_a = _child(fb, 0, 0, seq_a_end, 0, tok, lens_a, ext_a, attn_backends[0], split.two_chunk)
    child_b = _child(fb, 1, seq_b, bs, tok, n, lens_b, ext_b, attn_backends[1], False)
    return child_a, child_b


def choose_split(fb: ForwardBatch, *, has_communication: bool, min_tokens: int,
                 threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> TboSplit | None:
    """The split of ``fb`` where it can pay, else None (the batch runs whole). It pays only with
    communication to hide (tensor-parallel sums) and when both halves keep at least ``min_tokens``
    rows: at and above the GEMMs' ridge a half costs the same per row as the whole, below it each
    half re-reads the weights. A speculative batch splits only when its spec input can (``split``)."""
    if not has_communication or fb.forward_mode.is_idle():
        return None
    if fb.spec_info is not None and getattr(fb.spec_info, "split", None) is None:
        return None
    split = plan_split(fb, threshold)
    if split is None or min(split.token_index, fb.num_tokens - split.token_index) < min_tokens:
        return None
    return split


# --- DP attention ---------------------------------------------------------------------------------
# Every rank of a DP-attention step runs its own batch, but the micro-batches meet at the sharded MLP:
# every rank must split, or none, and issue the same collectives. Each rank proposes its local split
# (``dp_local_split``) in the step's count exchange; the step splits when every rank can and the
# gathered halves pay (``dp_split_pays``); then each rank splits its own batch as it proposed
# (``choose_dp_split``, the DP runner's split policy), a half without tokens an IDLE child.


def dp_local_split(fb: ForwardBatch, threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> TboSplit | None:
    """This rank's split of ``fb`` under DP attention: its own split where it has one, else all of
    its rows in child A and an empty child B (one request, one extend token), an IDLE batch two empty
    children. None: the batch cannot be split at all (a spec input without ``split``), so no rank
    splits the step."""
    if fb.forward_mode.is_idle():
        return TboSplit(0, 0, False)
    if fb.spec_info is not None and getattr(fb.spec_info, "split", None) is None:
        return None
    split = plan_split(fb, threshold)
    return split if split is not None else TboSplit(fb.batch_size, fb.num_tokens, False)


def dp_split_pays(tokens_a: Sequence[int], tokens_b: Sequence[int], min_tokens: int) -> bool:
    """Whether a DP-attention step splits, from every rank's proposed halves (tokens per rank): each
    micro-batch's MLP runs over the rows of every rank, so each must gather at least ``min_tokens``
    (the GEMMs' ridge, as ``choose_split`` asks of one rank's halves)."""
    return sum(tokens_a) >= min_tokens and sum(tokens_b) >= min_tokens


def choose_dp_split(fb: ForwardBatch, threshold: float = DEFAULT_TOKEN_DISTRIBUTION_THRESHOLD) -> TboSplit | None:
    """The DP-attention runner's split policy: the step's exchange decided (``mlp_sync.micro_batches``
    set: split, on every rank); this rank splits as it proposed."""
    if fb.mlp_sync.micro_batches is None:
        return None
    split = dp_local_split(fb, threshold)
    if split is None:
        raise RuntimeError("a DP-attention step was decided split but this rank's batch cannot be")
    return split
