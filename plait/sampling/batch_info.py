"""Per-batch sampling state: the requests' `SamplingParams` gathered into device tensors."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import Tensor

from plait.sampling.params import SamplingParams, seed_to_int64
from plait.sampling.penalties import build_logit_bias, build_seen_mask, build_token_counts
from plait.sampling.rng import row_keys_from_seed_keys, seed_keys_host
from plait.transfer import to_device


@dataclass
class SamplingBatchInfo:
    """Per-batch sampling state as device tensors, built once per forward by `build`.

    Host booleans (`all_greedy`, `need_*`) come from the params, so skipping work never needs a
    device read.
    """

    vocab_size: int
    temperatures: Tensor  # float32 [bs]; 1.0 on greedy rows so the division is harmless
    top_ps: Tensor  # float32 [bs]; 1.0 = off
    top_ks: Tensor  # int64 [bs]; vocab_size = off
    min_ps: Tensor  # float32 [bs]; 0.0 = off
    is_greedy: Tensor  # bool [bs]
    seeds: Tensor  # int64 [bs]
    steps: Tensor  # int64 [bs]: tokens the request has generated so far
    noise_keys: Tensor  # int64 [bs]: row_key_host(seed, step), what the draw actually hashes
    all_greedy: bool
    any_greedy: bool = False
    need_top_p: bool = False
    need_top_k: bool = False
    need_min_p: bool = False
    max_top_k: int = 0  # largest active top_k: a torch.topk of this size replaces a full sort
    # Every sampling row has an active top_k, so top_p only needs the max_top_k best values.
    top_p_within_top_k: bool = False
    # Penalties: each group is None unless some row uses it.
    repetition_penalties: Tensor | None = None  # float32 [bs]
    seen_token_mask: Tensor | None = None  # bool [bs, V], prompt + output tokens
    frequency_penalties: Tensor | None = None  # float32 [bs]
    presence_penalties: Tensor | None = None  # float32 [bs]
    output_token_counts: Tensor | None = None  # float32 [bs, V]
    # min_new_tokens: (row, token id) pairs whose logit is set to -inf this step.
    min_tokens_rows: Tensor | None = None  # int64 [n]
    min_tokens_ids: Tensor | None = None  # int64 [n]
    # logit_bias: float32 [bs, V] added to the logits (zeros on rows without one); None unless some
    # row has a bias. Constant over a request's life, so ``with_steps`` shares it.
    logit_bias: Tensor | None = None
    need_logprobs: bool = False
    top_logprobs_num: int = 0
    seeds_host: tuple[int, ...] = ()  # int64-wrapped seeds, kept to re-key the draws (with_steps)
    # seed_keys_host(seeds_host), which with_steps re-keys from (derived from seeds_host: not compared).
    seed_keys: np.ndarray | None = field(default=None, compare=False)
    # Constrained decoding: xgrammar's token bitmask of this step, int32 [bs, ceil(V / 32)] on the
    # device (bit set = allowed; unconstrained rows all ones). Filled per step by the scheduler from
    # the requests' matchers, after build (never reused by with_steps); None when no row is constrained.
    vocab_mask: Tensor | None = None

    @property
    def batch_size(self) -> int:
        return self.temperatures.shape[0]

    @property
    def has_penalties(self) -> bool:
        return self.seen_token_mask is not None or self.output_token_counts is not None

    @property
    def reusable_next_step(self) -> bool:
        """Whether the same requests' next step may reuse this info with only the step index moved:
        nothing here reads the output tokens (penalties) or the step count (min_new_tokens masks:
        once no row is under its minimum, none will be)."""
        return not self.has_penalties and self.min_tokens_rows is None

    def with_steps(self, steps: Sequence[int]) -> SamplingBatchInfo:
        """A copy for the same requests one step on: new ``steps`` and ``noise_keys`` (one small
        host-to-device copy), every other tensor shared. Only when ``reusable_next_step``."""
        if not self.reusable_next_step or len(steps) != self.batch_size:
            raise ValueError("with_steps needs a reusable info (no penalties, no min_new_tokens mask) "
                             f"and one step per row ({self.batch_size}), got {len(steps)}")
        seed_keys = self.seed_keys if self.seed_keys is not None else seed_keys_host(self.seeds_host)
        host = np.empty((2, len(steps)), dtype=np.int64)  # steps, then their keys: one copy
        host[0] = steps
        host[1] = row_keys_from_seed_keys(seed_keys, host[0])
        ints = to_device(torch.from_numpy(host), self.temperatures.device)
        return dataclasses.replace(self, steps=ints[0], noise_keys=ints[1], vocab_mask=None, seed_keys=seed_keys)

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        seeds: Sequence[int],
        output_ids: Sequence[Sequence[int]],
        prompt_ids: Sequence[Sequence[int]],
        eos_token_ids: Sequence[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingBatchInfo:
        """Gather the batch's params into device tensors (a handful of host-to-device copies).

        `seeds` holds every request's seed (the engine draws one at creation for unseeded
        requests); `output_ids[i]` are the tokens request i generated so far, so its length is the
        step index that keys the random draw: a request replays the same draws after retraction.
        `prompt_ids` are read only for rows with a repetition penalty.
        """
        bs = len(params)
        if not (len(seeds) == len(output_ids) == len(prompt_ids) == bs):
            raise ValueError(
                "params, seeds, output_ids and prompt_ids must have one entry per request, got "
                f"{bs}, {len(seeds)}, {len(output_ids)}, {len(prompt_ids)}"
            )
        if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
            raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
        for s in seeds:
            if isinstance(s, bool) or not isinstance(s, int):
                raise ValueError(f"seeds must be ints (one per request), got {s!r}")

        greedy = [p.samples_argmax for p in params]
        # Greedy rows get neutral values so they never switch on the filtering work.
        temps = [1.0 if g else p.temperature for p, g in zip(params, greedy, strict=True)]
        top_ps = [1.0 if g else p.top_p for p, g in zip(params, greedy, strict=True)]
        min_ps = [0.0 if g else p.min_p for p, g in zip(params, greedy, strict=True)]
        top_ks = [
            vocab_size if g or p.top_k == -1 or p.top_k >= vocab_size else p.top_k
            for p, g in zip(params, greedy, strict=True)
        ]
        reps = [p.repetition_penalty for p in params]
        freqs = [p.frequency_penalty for p in params]
        press = [p.presence_penalty for p in params]
        steps = [len(out) for out in output_ids]
        seeds64 = [seed_to_int64(s) for s in seeds]
        seed_keys = seed_keys_host(seeds64)
        keys = row_keys_from_seed_keys(seed_keys, np.array(steps, dtype=np.int64)).tolist()

        # Two copies (one float, one int) instead of one per field.
        floats = torch.tensor([temps, top_ps, min_ps, reps, freqs, press], dtype=torch.float32)
        floats = to_device(floats.reshape(6, bs), device)
        ints = torch.tensor([top_ks, seeds64, steps, keys, [int(g) for g in greedy]], dtype=torch.int64)
        ints = to_device(ints.reshape(5, bs), device)

        sampling_top_ks = [k for k, g in zip(top_ks, greedy, strict=True) if not g]
        need_top_p = any(p < 1.0 for p in top_ps)
        info = cls(
            vocab_size=vocab_size,
            temperatures=floats[0],
            top_ps=floats[1],
            min_ps=floats[2],
            top_ks=ints[0],
            seeds=ints[1],
            steps=ints[2],
            noise_keys=ints[3],
            is_greedy=ints[4].bool(),
            all_greedy=all(greedy),
            any_greedy=any(greedy),
            need_top_p=need_top_p,
            need_top_k=any(k < vocab_size for k in top_ks),
            need_min_p=any(m > 0.0 for m in min_ps),
            max_top_k=max((k for k in top_ks if k < vocab_size), default=0),
            top_p_within_top_k=need_top_p and all(k < vocab_size for k in sampling_top_ks),
            need_logprobs=any(p.logprobs or p.top_logprobs > 0 for p in params),
            top_logprobs_num=max((p.top_logprobs for p in params), default=0),
            seeds_host=tuple(seeds64),
            seed_keys=seed_keys,
        )

        if any(r != 1.0 for r in reps):
            info.repetition_penalties = floats[3]
            seen = [
                None if p.repetition_penalty == 1.0 else (prompt, out)
                for p, prompt, out in zip(params, prompt_ids, output_ids, strict=True)
            ]
            info.seen_token_mask = build_seen_mask(seen, vocab_size, device)
        if any(f != 0.0 or q != 0.0 for f, q in zip(freqs, press, strict=True)):
            info.frequency_penalties = floats[4]
            info.presence_penalties = floats[5]
            counted = [
                (out,) if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) else None
                for p, out in zip(params, output_ids, strict=True)
            ]
            info.output_token_counts = build_token_counts(counted, vocab_size, device)

        if any(p.logit_bias for p in params):
            info.logit_bias = build_logit_bias([p.logit_bias for p in params], vocab_size, device)

        rows: list[int] = []
        ids: list[int] = []
        for i, (p, out) in enumerate(zip(params, output_ids, strict=True)):
            if len(out) >= p.min_new_tokens:
                continue
            # ignore_eos: eos does not stop this request, so there is nothing to hold back.
            stop_ids = set(p.stop_token_ids) if p.ignore_eos else {*eos_token_ids, *p.stop_token_ids}
            for tid in sorted(stop_ids):
                if 0 <= tid < vocab_size:
                    rows.append(i)
                    ids.append(tid)
        if rows:
            pairs = to_device(torch.tensor([rows, ids], dtype=torch.int64), device)
            info.min_tokens_rows, info.min_tokens_ids = pairs[0], pairs[1]
        return info
