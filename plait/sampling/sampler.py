"""Batched token sampling on the device.

One `SamplingBatchInfo` is built per forward from the requests' `SamplingParams`; `Sampler` turns a
[bs, V] float32 logits tensor into next tokens with no host sync (the caller syncs once, for the
whole batch, when it copies the tokens back).

Order of operations, per row:
  grammar mask (constrained rows: tokens the grammar does not allow next are set to -inf)
  -> penalties (repetition over prompt+output, frequency/presence over output)
  -> logit_bias (OpenAI's, added to the logits)
  -> min_new_tokens mask (stop ids set to -inf until enough tokens were generated)
  -> logprobs are taken here (penalised distribution at temperature 1)
  -> greedy rows: argmax
  -> other rows: temperature, top_k, top_p, min_p, then a Gumbel-max draw whose noise is a pure
     function of (seed, step, vocab index): see plait.sampling.rng.

A batch whose sampled rows use a temperature alone may draw in one Triton pass over the logits
(``rng.gumbel_max_sample``, PLAIT_FUSED_GUMBEL_MAX) instead of the division, the noise and the argmax
as three: the same tokens, bit for bit.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from plait import envs
from plait.sampling.batch_info import SamplingBatchInfo
from plait.sampling.penalties import apply_frequency_presence_penalty, apply_repetition_penalty
from plait.sampling.rng import TRITON_AVAILABLE, add_gumbel_noise_, gumbel_max_sample, noise_in_triton

# Temperature-only draws in one Triton pass (PLAIT_FUSED_GUMBEL_MAX; the same tokens either way).
FUSED_GUMBEL_MAX = envs.FUSED_GUMBEL_MAX.get()


def greedy_ids(x: Tensor) -> Tensor:
    """Row-wise argmax (first maximum on ties). On CUDA a two-pass Triton kernel: torch's
    reduction reads a whole vocabulary row with one block, the slowest kernel of a bs=1 step."""
    if x.is_cuda and TRITON_AVAILABLE:
        from plait.layers.triton_ops import argmax

        return argmax(x)
    return x.argmax(dim=-1)


@dataclass
class SampleOutput:
    next_token_ids: Tensor  # int64 [bs]
    # Log-probability of the chosen token under the penalised, temperature-1 distribution.
    logprobs: Tensor | None = None  # float32 [bs]
    # Best `top_logprobs_num` tokens of that distribution, sorted by descending logprob; rows that
    # asked for fewer slice their prefix.
    top_logprobs_ids: Tensor | None = None  # int64 [bs, k]
    top_logprobs_vals: Tensor | None = None  # float32 [bs, k]



def _top_p_threshold(vals: Tensor, top_ps: Tensor) -> Tensor:
    """Smallest kept value per row [bs, 1], from values sorted in descending order.

    A token is kept when the probability mass sorted before it is <= top_p (so the first always
    is). The caller masks by value (`x < threshold`), so tokens tied with the last kept one are
    kept too: the cut depends on values only, never on how a sort ordered equal logits (bf16 logits
    tie often), and a full sort and a top-k prefix give the same threshold. Masses are unnormalised
    prefix sums compared with top_p * total: for top_p == 1 that is `before <= total`, which holds
    exactly because prefix sums of non-negative terms never decrease, so such rows lose nothing.
    """
    e = (vals - vals[:, :1]).exp()
    cum = e.cumsum(dim=-1)
    before = torch.cat([torch.zeros_like(cum[:, :1]), cum[:, :-1]], dim=-1)
    keep = before <= top_ps[:, None] * cum[:, -1:]
    return torch.where(keep, vals, math.inf).amin(dim=-1, keepdim=True)


class Sampler:
    """Stateless apart from the kernel choice: every input is in the logits and the batch info.
    The caller's logits are never modified.

    use_triton: None (default) uses the fused Triton noise kernel on CUDA when Triton is
    importable; True/False force it. Tokens are the same either way.
    """

    def __init__(self, use_triton: bool | None = None) -> None:
        self.use_triton = use_triton

    def __call__(self, logits: Tensor, info: SamplingBatchInfo) -> SampleOutput:
        self._check_shape(logits, info)
        logits = self.penalize(logits, info)

        if info.all_greedy:
            # Fast path: no temperature, filtering or noise at all.
            next_ids = greedy_ids(logits)
        else:
            filters = info.need_top_k or info.need_top_p or info.need_min_p
            if FUSED_GUMBEL_MAX and not filters and noise_in_triton(logits, self.use_triton):
                next_ids = gumbel_max_sample(logits, info.temperatures, info.noise_keys)
            else:
                # warp returns a fresh tensor, so the noise can be added in place.
                next_ids = greedy_ids(add_gumbel_noise_(self.warp(logits, info), info.noise_keys, self.use_triton))
            if info.any_greedy:
                next_ids = torch.where(info.is_greedy, greedy_ids(logits), next_ids)

        out = SampleOutput(next_token_ids=next_ids)
        if info.need_logprobs:
            logp = torch.log_softmax(logits, dim=-1)
            out.logprobs = logp.gather(1, next_ids[:, None]).squeeze(1)
            if info.top_logprobs_num > 0:
                k = min(info.top_logprobs_num, info.vocab_size)
                out.top_logprobs_vals, out.top_logprobs_ids = logp.topk(k, dim=-1, sorted=True)
        return out

    @staticmethod
    def _check_shape(logits: Tensor, info: SamplingBatchInfo) -> None:
        # Shapes are host metadata: checking them costs no sync.
        expected = (info.batch_size, info.vocab_size)
        if logits.dim() != 2 or tuple(logits.shape) != expected:
            raise ValueError(f"logits must have shape [bs, vocab] = {list(expected)}, got {list(logits.shape)}")

    @staticmethod
    def penalize(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
        """Penalties, logit_bias and the min_new_tokens mask, in float32; returns a new tensor when it changes
        anything, so the caller's logits stay intact."""
        x = logits.float()
        if info.vocab_mask is not None:
            # Imported here: xgrammar loads only where constrained requests exist.
            from plait.sampling.grammar import apply_vocab_mask

            # xgrammar's kernel writes in place into a dense tensor: a copy keeps the caller's
            # logits intact (and makes a sliced, padded-vocabulary view contiguous).
            x = x.clone(memory_format=torch.contiguous_format)
            apply_vocab_mask(x, info.vocab_mask)
        if info.seen_token_mask is not None:
            assert info.repetition_penalties is not None
            x = apply_repetition_penalty(x, info.seen_token_mask, info.repetition_penalties)
        if info.output_token_counts is not None:
            assert info.frequency_penalties is not None and info.presence_penalties is not None
            x = apply_frequency_presence_penalty(
                x, info.output_token_counts, info.frequency_penalties, info.presence_penalties
            )
        if info.logit_bias is not None:
            x = x + info.logit_bias
        if info.min_tokens_rows is not None:
            assert info.min_tokens_ids is not None
            # new_full is a device fill; torch.tensor(..., device=cuda) would be a synchronous copy.
            x = x.index_put((info.min_tokens_rows, info.min_tokens_ids), x.new_full((), -math.inf))
        return x

    @staticmethod
    def warp(logits: Tensor, info: SamplingBatchInfo) -> Tensor:
        """Temperature, then top_k, top_p and min_p as -inf masks; always returns a new tensor.

        softmax of the result is the distribution a non-greedy row samples from (speculative
        rejection sampling needs exactly that); values of greedy rows are meaningless. Each filter
        yields a per-row threshold and one mask applies the largest, so ties at a boundary are all
        kept, whichever path (full sort or top-k prefix) the batch took.
        """
        x = logits / info.temperatures[:, None]
        threshold: Tensor | None = None
        if info.need_top_k or info.need_top_p:
            if info.need_top_p and not info.top_p_within_top_k:
                vals = x.sort(dim=-1, descending=True).values
            else:
                vals = x.topk(info.max_top_k, dim=-1, sorted=True).values
            if info.need_top_k:
                kth = vals.gather(1, (info.top_ks.clamp(max=vals.shape[1]) - 1)[:, None])
                active = (info.top_ks < info.vocab_size)[:, None]
                threshold = torch.where(active, kth, -math.inf)
                if info.need_top_p:
                    # top_p renormalises over what top_k kept (HF order: top_k, then top_p).
                    vals = vals.masked_fill(vals < threshold, -math.inf)
            if info.need_top_p:
                t_p = _top_p_threshold(vals, info.top_ps)
                threshold = t_p if threshold is None else torch.maximum(threshold, t_p)
        if info.need_min_p:
            # p < min_p * p_max  <=>  logit < max_logit + log(min_p); log(0) = -inf masks nothing.
            # The other filters never remove the best token, so the order does not matter.
            t_m = x.amax(dim=-1, keepdim=True) + info.min_ps.log()[:, None]
            threshold = t_m if threshold is None else torch.maximum(threshold, t_m)
        if threshold is not None:
            x = x.masked_fill(x < threshold, -math.inf)
        return x
