"""Batched token sampling on the device.

One `SamplingBatchInfo` is built per forward from the requests' `SamplingParams`; `Sampler` turns a
[bs, V] float32 logits tensor into next tokens with no host sync (the caller syncs once, for the
whole batch, when it copies the tokens back).

Order of operations, per row:
  penalties (repetition over prompt+output, frequency/presence over output)
  -> min_new_tokens mask (stop ids set to -inf until enough tokens were generated)
  -> logprobs are taken here (penalised distribution at temperature 1)
  -> greedy rows: argmax
  -> other rows: temperature, top_k, top_p, min_p, then a Gumbel-max draw whose noise is a pure
     function of (seed, step, vocab index): see the random-number section below.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the int64 torch path computes the same noise
    triton = None

from plait.sampling.params import SamplingParams, seed_to_int64
from plait.sampling.penalties import (
    apply_frequency_presence_penalty,
    apply_repetition_penalty,
    build_seen_mask,
    build_token_counts,
)
from plait.transfer import to_device

# Temperatures this small turn logits into +-inf after scaling (softmax NaNs in top_p); sampling at
# them is argmax anyway, so such rows take the greedy path.
GREEDY_TEMPERATURE_EPS = 1e-5

# ------------------------------------------------------------------------------------------------
# Counter-based random numbers.
#
# Each draw is a pure function of (seed, step, stream, column), so a seeded request draws the same
# token alone or inside any batch, in any row, and no global generator is touched. The hash is
# splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
#   key(seed, step, stream) = mix(mix(mix(seed ^ SALT) + step * GOLDEN) + stream * SALT2)
#   word(key, column)       = mix(key + (column + 1) * GOLDEN)
# and u = (top 52 bits of word + 0.5) / 2**52. Keys are [bs] and computed on the host at build time
# (exact Python ints); words are [bs, V] and computed on the device, in int64 torch ops or in a fused
# Triton kernel on CUDA, bit-identical. Two details keep devices identical: int64 add/mul wrap
# modulo 2**64, and `>>` on int64 is arithmetic, so every right shift is masked to make it logical.
# The Gumbel transform runs in float64 (then rounds to float32): libm differences of an ulp in
# float64 vanish in the rounding, and 52-bit uniforms keep the Gumbel tail out to about 37.
# ------------------------------------------------------------------------------------------------

_MASK64 = (1 << 64) - 1


def _as_int64(value: int) -> int:
    """Reinterpret a 64-bit word as the signed int64 that torch scalars must be."""
    value &= _MASK64
    return value - (1 << 64) if value >= (1 << 63) else value


_GOLDEN_U = 0x9E3779B97F4A7C15  # splitmix64 state increment (odd: every column distinct)
_MUL1_U = 0xBF58476D1CE4E5B9
_MUL2_U = 0x94D049BB133111EB
# Salts so that seed 0 / stream 0 do not feed an all-zero word into the first mix.
_SEED_SALT_U = 0x5851F42D4C957F2D
_STREAM_SALT_U = 0xD1B54A32D192ED03
_GOLDEN, _MUL1, _MUL2 = _as_int64(_GOLDEN_U), _as_int64(_MUL1_U), _as_int64(_MUL2_U)
_SEED_SALT, _STREAM_SALT = _as_int64(_SEED_SALT_U), _as_int64(_STREAM_SALT_U)
# 52 bits make (m + 0.5) / 2**52 exact in float64 and strictly inside (0, 1); with 53 the top value
# would round up to exactly 1.0.
_UNIFORM_BITS = 52


def _mix64_host(z: int) -> int:
    z &= _MASK64
    z = ((z ^ (z >> 30)) * _MUL1_U) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2_U) & _MASK64
    return z ^ (z >> 31)


def row_key_host(seed: int, step: int, stream: int = 0) -> int:
    """The row key of (seed, step, stream) as a signed int64, in exact Python arithmetic."""
    k = _mix64_host(seed ^ _SEED_SALT_U)
    k = _mix64_host(k + step * _GOLDEN_U)
    return _as_int64(_mix64_host(k + stream * _STREAM_SALT_U))


def _mix64_np(z: np.ndarray) -> np.ndarray:
    z = (z ^ (z >> np.uint64(30))) * np.uint64(_MUL1_U)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(_MUL2_U)
    return z ^ (z >> np.uint64(31))


def row_keys_host(seeds: Sequence[int], steps: Sequence[int], stream: int = 0) -> list[int]:
    """``row_key_host`` for many rows at once (numpy uint64 wraps modulo 2**64 like the exact form)."""
    with np.errstate(over="ignore"):
        s = np.array([x & _MASK64 for x in seeds], dtype=np.uint64)
        k = _mix64_np(s ^ np.uint64(_SEED_SALT_U))
        k = _mix64_np(k + np.array(steps, dtype=np.uint64) * np.uint64(_GOLDEN_U))
        k = _mix64_np(k + np.uint64((stream * _STREAM_SALT_U) & _MASK64))
    return k.view(np.int64).tolist()


def _lsr(x: Tensor, shift: int) -> Tensor:
    """Logical right shift of int64: arithmetic shift, then clear the sign-extended high bits."""
    return (x >> shift) & ((1 << (64 - shift)) - 1)


def _mix64(z: Tensor) -> Tensor:
    """splitmix64's output function: a bijection on 64-bit words with full avalanche."""
    z = (z ^ _lsr(z, 30)) * _MUL1
    z = (z ^ _lsr(z, 27)) * _MUL2
    return z ^ _lsr(z, 31)


def _mix64_(z: Tensor) -> Tensor:
    """In-place `_mix64` for the [bs, V] tensor: peak memory stays at two int64 temporaries."""
    z ^= _lsr(z, 30)
    z *= _MUL1
    z ^= _lsr(z, 27)
    z *= _MUL2
    z ^= _lsr(z, 31)
    return z


def row_keys(seeds: Tensor, steps: Tensor, stream: int = 0) -> Tensor:
    """int64 [bs] row keys computed on the device (for steps that only exist there, e.g. draft
    positions in speculative decoding); equal to `row_key_host` element by element."""
    k = _mix64(seeds.to(torch.int64) ^ _SEED_SALT)
    k = _mix64(k + steps.to(torch.int64) * _GOLDEN)
    return _mix64(k + _as_int64(stream * _STREAM_SALT_U))


def random_bits_from_keys(keys: Tensor, num_cols: int) -> Tensor:
    """int64 [bs, num_cols] hash words: column j is word j+1 of the splitmix64 stream at the key."""
    cols = torch.arange(1, num_cols + 1, device=keys.device, dtype=torch.int64) * _GOLDEN
    return _mix64_(keys.to(torch.int64)[:, None] + cols[None, :])


def random_bits(seeds: Tensor, steps: Tensor, num_cols: int, stream: int = 0) -> Tensor:
    return random_bits_from_keys(row_keys(seeds, steps, stream), num_cols)


def _uniforms_from_bits(bits: Tensor) -> Tensor:
    return (_lsr(bits, 64 - _UNIFORM_BITS).to(torch.float64) + 0.5) * (2.0**-_UNIFORM_BITS)


def counter_uniforms(seeds: Tensor, steps: Tensor, num_cols: int, stream: int = 0) -> Tensor:
    """float64 [bs, num_cols] uniforms strictly inside (0, 1). `stream` gives independent draws
    for the same (seed, step), e.g. acceptance tests in speculative decoding."""
    return _uniforms_from_bits(random_bits(seeds, steps, num_cols, stream))


def gumbel_noise_from_keys(keys: Tensor, num_cols: int) -> Tensor:
    """float32 [bs, num_cols] standard Gumbel noise -log(-log u).

    argmax(logits + g) is a draw from softmax(logits): the Gumbel-max trick, the log form of the
    exponential race argmax(p / E) with E = -log u. The log form needs no softmax and keeps masked
    (-inf) tokens out without special cases.
    """
    u = _uniforms_from_bits(random_bits_from_keys(keys, num_cols))
    return u.log_().neg_().log_().neg_().to(torch.float32)


def gumbel_noise(seeds: Tensor, steps: Tensor, num_cols: int, stream: int = 0) -> Tensor:
    return gumbel_noise_from_keys(row_keys(seeds, steps, stream), num_cols)


if triton is not None:
    _TL_GOLDEN = tl.constexpr(_GOLDEN)
    _TL_MUL1 = tl.constexpr(_MUL1)
    _TL_MUL2 = tl.constexpr(_MUL2)
    _TL_MASK30 = tl.constexpr((1 << 34) - 1)
    _TL_MASK27 = tl.constexpr((1 << 37) - 1)
    _TL_MASK31 = tl.constexpr((1 << 33) - 1)
    _TL_MASK_U = tl.constexpr((1 << _UNIFORM_BITS) - 1)
    _TL_SHIFT_U = tl.constexpr(64 - _UNIFORM_BITS)
    _TL_SCALE_U = tl.constexpr(2.0**-_UNIFORM_BITS)

    @triton.jit
    def _add_gumbel_kernel(x_ptr, keys_ptr, num_cols, stride_row, BLOCK: tl.constexpr):
        # The same words as random_bits_from_keys and the same float64 transform as
        # gumbel_noise_from_keys, fused: the eager version makes ~20 passes over [bs, V] int64.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = cols < num_cols
        z = tl.load(keys_ptr + row) + (cols + 1) * _TL_GOLDEN
        z = (z ^ ((z >> 30) & _TL_MASK30)) * _TL_MUL1
        z = (z ^ ((z >> 27) & _TL_MASK27)) * _TL_MUL2
        z = z ^ ((z >> 31) & _TL_MASK31)
        u = (((z >> _TL_SHIFT_U) & _TL_MASK_U).to(tl.float64) + 0.5) * _TL_SCALE_U
        g = -tl.log(-tl.log(u))
        ptrs = x_ptr + row * stride_row + cols
        x = tl.load(ptrs, mask=in_range)
        tl.store(ptrs, x + g.to(tl.float32), mask=in_range)


_TRITON_BLOCK = 1024


def greedy_ids(x: Tensor) -> Tensor:
    """Row-wise argmax (first maximum on ties). On CUDA a two-pass Triton kernel: torch's
    reduction reads a whole vocabulary row with one block, the slowest kernel of a bs=1 step."""
    if x.is_cuda and triton is not None:
        from plait.layers.triton_ops import argmax

        return argmax(x)
    return x.argmax(dim=-1)


def add_gumbel_noise_(x: Tensor, keys: Tensor, use_triton: bool | None = None) -> Tensor:
    """x += gumbel_noise_from_keys(keys, V), in place on a float32 [bs, V] tensor.

    use_triton: None picks the fused kernel on CUDA when Triton is importable; the result is the
    same either way.
    """
    if use_triton is None:
        use_triton = x.is_cuda and triton is not None
    if not use_triton:
        return x.add_(gumbel_noise_from_keys(keys, x.shape[1]))
    if triton is None:
        raise RuntimeError("use_triton=True but triton is not installed; pass use_triton=None")
    if x.dtype != torch.float32 or x.dim() != 2 or x.stride(1) != 1:
        raise ValueError("add_gumbel_noise_ needs a float32 [bs, V] tensor with unit column stride")
    bs, num_cols = x.shape
    if bs and num_cols:
        grid = (bs, triton.cdiv(num_cols, _TRITON_BLOCK))
        _add_gumbel_kernel[grid](x, keys.to(torch.int64).contiguous(), num_cols, x.stride(0), BLOCK=_TRITON_BLOCK)
    return x


# ------------------------------------------------------------------------------------------------
# Batch state.
# ------------------------------------------------------------------------------------------------


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
    need_logprobs: bool = False
    top_logprobs_num: int = 0
    seeds_host: tuple[int, ...] = ()  # int64-wrapped seeds, kept to re-key the draws (with_steps)

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
        ints = to_device(torch.tensor([list(steps), row_keys_host(self.seeds_host, steps)], dtype=torch.int64),
                         self.temperatures.device)
        return dataclasses.replace(self, steps=ints[0], noise_keys=ints[1])

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

        greedy = [p.is_greedy or p.temperature < GREEDY_TEMPERATURE_EPS for p in params]
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
        keys = row_keys_host(seeds64, steps)

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


@dataclass
class SampleOutput:
    next_token_ids: Tensor  # int64 [bs]
    # Log-probability of the chosen token under the penalised, temperature-1 distribution.
    logprobs: Tensor | None = None  # float32 [bs]
    # Best `top_logprobs_num` tokens of that distribution, sorted by descending logprob; rows that
    # asked for fewer slice their prefix.
    top_logprobs_ids: Tensor | None = None  # int64 [bs, k]
    top_logprobs_vals: Tensor | None = None  # float32 [bs, k]


# ------------------------------------------------------------------------------------------------
# Sampler.
# ------------------------------------------------------------------------------------------------


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
            # warp returns a fresh tensor, so the noise can be added in place.
            scores = add_gumbel_noise_(self.warp(logits, info), info.noise_keys, self.use_triton)
            next_ids = greedy_ids(scores)
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
        """Penalties and the min_new_tokens mask, in float32; returns a new tensor when it changes
        anything, so the caller's logits stay intact."""
        x = logits.float()
        if info.seen_token_mask is not None:
            assert info.repetition_penalties is not None
            x = apply_repetition_penalty(x, info.seen_token_mask, info.repetition_penalties)
        if info.output_token_counts is not None:
            assert info.frequency_penalties is not None and info.presence_penalties is not None
            x = apply_frequency_presence_penalty(
                x, info.output_token_counts, info.frequency_penalties, info.presence_penalties
            )
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
