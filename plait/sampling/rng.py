"""Counter-based random numbers and the Gumbel noise the sampler draws with.

Each draw is a pure function of (seed, step, stream, column), so a seeded request draws the same
token alone or inside any batch, in any row, and no global generator is touched. The hash is
splitmix64 (Steele, Lea and Flood, "Fast splittable pseudorandom number generators", 2014):
  key(seed, step, stream) = mix(mix(mix(seed ^ SALT) + step * GOLDEN) + stream * SALT2)
  word(key, column)       = mix(key + (column + 1) * GOLDEN)
and u = (top 52 bits of word + 0.5) / 2**52. Keys are [bs] and computed on the host at build time
(exact Python ints); words are [bs, V] and computed on the device, in int64 torch ops or in a fused
Triton kernel on CUDA, bit-identical. Two details keep devices identical: int64 add/mul wrap
modulo 2**64, and `>>` on int64 is arithmetic, so every right shift is masked to make it logical.
The Gumbel transform runs in float64 (then rounds to float32): libm differences of an ulp in
float64 vanish in the rounding, and 52-bit uniforms keep the Gumbel tail out to about 37.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the int64 torch path computes the same noise
    triton = None

# Whether the fused noise kernel (and the sampler's Triton argmax) can run at all.
TRITON_AVAILABLE = triton is not None


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


def seed_keys_host(seeds: Sequence[int]) -> np.ndarray:
    """The seeds' part of their rows' keys (uint64 ``[n]``, read-only): a batch's seeds do not change
    from step to step, so this is computed once per batch of requests."""
    with np.errstate(over="ignore"):
        k = _mix64_np(np.array([x & _MASK64 for x in seeds], dtype=np.uint64) ^ np.uint64(_SEED_SALT_U))
    k.flags.writeable = False
    return k


def row_keys_from_seed_keys(seed_keys: np.ndarray, steps: np.ndarray, stream: int = 0) -> np.ndarray:
    """``row_keys_host`` from ``seed_keys_host(seeds)`` and the steps (int ``[n]``), as int64 ``[n]``."""
    with np.errstate(over="ignore"):
        k = _mix64_np(seed_keys + steps.astype(np.uint64) * np.uint64(_GOLDEN_U))
        k = _mix64_np(k + np.uint64((stream * _STREAM_SALT_U) & _MASK64))
    return k.view(np.int64)


def row_keys_host(seeds: Sequence[int], steps: Sequence[int], stream: int = 0) -> list[int]:
    """``row_key_host`` for many rows at once (numpy uint64 wraps modulo 2**64 like the exact form)."""
    return row_keys_from_seed_keys(seed_keys_host(seeds), np.array(steps, dtype=np.uint64), stream).tolist()


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
    def _gumbel(key, cols):
        # The same words as random_bits_from_keys and the same float64 transform as
        # gumbel_noise_from_keys (the eager version makes ~20 passes over [bs, V] int64), rounded to
        # float32 as that function returns it.
        z = key + (cols + 1) * _TL_GOLDEN
        z = (z ^ ((z >> 30) & _TL_MASK30)) * _TL_MUL1
        z = (z ^ ((z >> 27) & _TL_MASK27)) * _TL_MUL2
        z = z ^ ((z >> 31) & _TL_MASK31)
        u = (((z >> _TL_SHIFT_U) & _TL_MASK_U).to(tl.float64) + 0.5) * _TL_SCALE_U
        return (-tl.log(-tl.log(u))).to(tl.float32)

    @triton.jit
    def _add_gumbel_kernel(x_ptr, keys_ptr, num_cols, stride_row, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = cols < num_cols
        ptrs = x_ptr + row * stride_row + cols
        x = tl.load(ptrs, mask=in_range)
        tl.store(ptrs, x + _gumbel(tl.load(keys_ptr + row), cols), mask=in_range)

    @triton.jit
    def _gumbel_max_blocks_kernel(x_ptr, temps_ptr, keys_ptr, vals_ptr, idx_ptr, num_cols, stride_row, n_blocks,
                                  BLOCK: tl.constexpr):
        # The first argmax pass over x / t + g for one block of a row; the scores are never stored. The
        # division rounds to nearest as torch's does (Triton's plain fp32 `/` is approximate), so each
        # score, and the token, equals the unfused path's bit for bit.
        row = tl.program_id(0).to(tl.int64)
        blk = tl.program_id(1)
        cols = blk.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        in_range = cols < num_cols
        x = tl.load(x_ptr + row * stride_row + cols, mask=in_range, other=0.0).to(tl.float32)
        s = tl.math.div_rn(x, tl.load(temps_ptr + row)) + _gumbel(tl.load(keys_ptr + row), cols)
        s = tl.where(in_range, s, -float("inf"))
        val, i = tl.max(s, axis=0, return_indices=True, return_indices_tie_break_left=True)
        tl.store(vals_ptr + row * n_blocks + blk, val)
        tl.store(idx_ptr + row * n_blocks + blk, blk * BLOCK + i)


_TRITON_BLOCK = 1024


def noise_in_triton(x: Tensor, use_triton: bool | None) -> bool:
    """Whether noise over ``x`` runs in the Triton kernels: ``use_triton`` as given, or (None) on CUDA
    when Triton is importable."""
    return (x.is_cuda and triton is not None) if use_triton is None else use_triton


def add_gumbel_noise_(x: Tensor, keys: Tensor, use_triton: bool | None = None) -> Tensor:
    """x += gumbel_noise_from_keys(keys, V), in place on a float32 [bs, V] tensor.

    use_triton: None picks the fused kernel on CUDA when Triton is importable; the result is the
    same either way.
    """
    if not noise_in_triton(x, use_triton):
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


def gumbel_max_sample(logits: Tensor, temperatures: Tensor, keys: Tensor) -> Tensor:
    """int64 [bs]: argmax over columns of logits / temperatures[:, None] + gumbel_noise_from_keys(keys, V),
    the token a temperature-only row draws (no top-k, top-p or min-p), in two Triton passes that read the
    logits once and never store the scores. Equal to the unfused ``add_gumbel_noise_`` then argmax.

    logits: float [bs, V] with unit column stride (a view of a wider buffer is fine); temperatures:
    float32 [bs] (> 0); keys: int64 [bs].
    """
    if triton is None:
        raise RuntimeError("gumbel_max_sample needs triton; use add_gumbel_noise_ and an argmax instead")
    from plait.layers.triton_ops import ARGMAX_BLOCK, argmax_block_buffers, argmax_of_blocks

    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError("gumbel_max_sample needs a [bs, V] logits tensor with unit column stride")
    bs, num_cols = logits.shape
    vals, idx = argmax_block_buffers(bs, num_cols, logits.device)
    if bs:
        _gumbel_max_blocks_kernel[(bs, vals.shape[1])](
            logits, temperatures.to(torch.float32).contiguous(), keys.to(torch.int64).contiguous(), vals, idx,
            num_cols, logits.stride(0), vals.shape[1], BLOCK=ARGMAX_BLOCK, num_warps=8)
    return argmax_of_blocks(vals, idx)
