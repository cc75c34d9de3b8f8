"""Repetition, frequency and presence penalties as batched tensor ops.

State is dense per batch row ([bs, V] mask or counts), built from token ids once per forward, so
applying it is a couple of elementwise kernels with no host sync.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

from plait.transfer import to_device

# One request's token ids: a list, a tuple, a 1-D array or a 1-D tensor.
TokenIds = Sequence[int] | np.ndarray | Tensor


def _flat_token_index(rows_of_parts: Sequence[Sequence[TokenIds] | None], vocab_size: int) -> tuple[Tensor, Tensor]:
    """(row, token id) pairs on the host; row i holds the tokens of all its parts (e.g. prompt and
    output, without concatenating them), None rows hold none.

    Lists go through one numpy.fromiter over all rows: per-row tensor conversions cost several
    times more at large batch sizes. Ids outside [0, vocab_size) are dropped: they can never be sampled, and an
    out-of-range index would be a device-side assert on CUDA rather than a clean error.
    """
    rows_of_parts = [() if parts is None else parts for parts in rows_of_parts]
    lengths = [sum(len(part) for part in parts) for parts in rows_of_parts]
    total = sum(lengths)
    if all(isinstance(part, list | tuple) for parts in rows_of_parts for part in parts):
        flat = itertools.chain.from_iterable(itertools.chain.from_iterable(rows_of_parts))
        ids = torch.from_numpy(np.fromiter(flat, dtype=np.int64, count=total))
    else:
        chunks = [torch.as_tensor(part, dtype=torch.int64).reshape(-1).cpu() for p in rows_of_parts for part in p]
        ids = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.int64)
    rows = torch.repeat_interleave(
        torch.arange(len(lengths), dtype=torch.int64), torch.tensor(lengths, dtype=torch.int64)
    )
    keep = (ids >= 0) & (ids < vocab_size)
    return rows[keep], ids[keep]


def build_seen_mask(
    rows_of_parts: Sequence[Sequence[TokenIds] | None], vocab_size: int, device: torch.device | str
) -> Tensor:
    """bool [bs, V]: True where the row's tokens (prompt + output, for repetition) contain the id."""
    rows, ids = _flat_token_index(rows_of_parts, vocab_size)
    mask = torch.zeros(len(rows_of_parts), vocab_size, dtype=torch.bool, device=device)
    mask.index_put_((to_device(rows, device), to_device(ids, device)), mask.new_ones(()))
    return mask


def build_token_counts(
    rows_of_parts: Sequence[Sequence[TokenIds] | None], vocab_size: int, device: torch.device | str
) -> Tensor:
    """float32 [bs, V]: occurrences of each id in the row's output tokens (exact below 2**24)."""
    rows, ids = _flat_token_index(rows_of_parts, vocab_size)
    counts = torch.zeros(len(rows_of_parts), vocab_size, dtype=torch.float32, device=device)
    ones = torch.ones(rows.numel(), dtype=torch.float32, device=device)
    counts.index_put_((to_device(rows, device), to_device(ids, device)), ones, accumulate=True)
    return counts


def apply_repetition_penalty(logits: Tensor, seen_mask: Tensor, penalties: Tensor) -> Tensor:
    """HF/vLLM rule on seen tokens: positive logits divided by the penalty, negative multiplied.

    Dividing a negative logit would raise it, so both branches lower the logit for penalty > 1.
    Rows with penalty 1 are unchanged. Returns a new tensor.
    """
    rep = penalties[:, None]
    penalised = torch.where(logits > 0, logits / rep, logits * rep)
    return torch.where(seen_mask, penalised, logits)


def apply_frequency_presence_penalty(logits: Tensor, counts: Tensor, frequency: Tensor, presence: Tensor) -> Tensor:
    """OpenAI rule over output tokens: logit -= frequency * count + presence * (count > 0)."""
    return logits - (frequency[:, None] * counts + presence[:, None] * (counts > 0))


def build_logit_bias(rows: Sequence[Sequence[tuple[int, float]]], vocab_size: int,
                     device: torch.device | str) -> Tensor:
    """float32 [bs, V]: row i holds request i's (token id, bias) pairs, zeros elsewhere (one
    host-to-device copy of the pairs, one scatter). Ids were validated against the vocabulary."""
    r = [i for i, pairs in enumerate(rows) for _ in pairs]
    ids = [tid for pairs in rows for tid, _ in pairs]
    vals = [v for pairs in rows for _, v in pairs]
    bias = torch.zeros(len(rows), vocab_size, dtype=torch.float32, device=device)
    index = to_device(torch.tensor([r, ids], dtype=torch.int64).reshape(2, len(r)), device)
    bias.index_put_((index[0], index[1]), to_device(torch.tensor(vals, dtype=torch.float32), device))
    return bias
