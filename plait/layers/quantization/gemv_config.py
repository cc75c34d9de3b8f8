"""Launch configurations of the small-M GEMV (``plait.layers.quantization.gemv``), stored as data.

``benchmarks/tune_gemv.py`` writes one JSON file per device, ``gemv_{device}.json`` (the device name as
``plait.layers.tuned_configs.device_file_tag`` spells it), into ``configs/`` beside this module or into
any directory; at run time the directory named by ``PLAIT_GEMV_CONFIG_DIR`` is read first (a fresh tune
used in the same GPU session), then ``configs/``. Layout::

    {"fp8_channel": {"N6144_K4096": {"1": {"block_n": 8, "block_k": 512, "split_k": 1,
                                           "num_warps": 4, "num_stages": 3}, "16": {...}}}, ...}

An FP8 weight-only entry may carry ``"prefer_w8a8": 1``: that case runs the W8A8 form, with the entry of
``fp8_channel_mma`` / ``fp8_block_mma`` (``tune_gemv.py --compare`` sets it where W8A8 measured faster).

The outer keys are weight kinds (``gemv_kind``); a call takes the smallest tuned bucket >= its token
count (its tiles were measured for that many rows). A shape or kind without an entry gets
``default_config``.
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import asdict, dataclass

import torch

from plait import envs
from plait.layers.tuned_configs import covering_bucket, device_file_tag, first_existing

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"
# Token counts the tuner measures; the kernel serves 1..GEMV_MAX_TOKENS.
M_BUCKETS = (1, 2, 4, 8, 16)
GEMV_MAX_TOKENS = 16
KINDS = ("fp8_channel", "fp8_block", "fp8_channel_mma", "fp8_block_mma", "bf16", "fp16")


# GemvConfig's booleans: a table entry holds each only where set.
FLAGS = ("prefer_w8a8", "swap_ab", "prefer_cublas")


@dataclass(frozen=True)
class GemvConfig:
    """One launch: ``block_n`` weight rows per program, ``block_k`` columns per loop step (elements),
    ``split_k`` programs along K per row tile (1: each program reads whole rows), ``num_warps``,
    ``num_stages`` (software pipelining of the weight loads). ``prefer_w8a8`` (FP8 weight-only tables
    only): the W8A8 form, with its own table's config, measured faster for this case; calls that do not
    choose a form take it (``plait.layers.quantization.gemv``). ``swap_ab`` (2+ tokens, not W8A8): the
    tensor-core form with the weight rows as the dot's M. ``prefer_cublas`` (bf16 / fp16 tables, 2+
    tokens): cuBLAS measured faster than every config tried, so dense layers call it there
    (``gemv_takes``); the config stays the fastest GEMV for direct calls."""

    block_n: int
    block_k: int
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3
    prefer_w8a8: bool = False
    swap_ab: bool = False
    prefer_cublas: bool = False

    def __post_init__(self) -> None:
        for name in ("block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            if value < 1 or value & (value - 1):
                raise ValueError(f"GemvConfig.{name} must be a power of two, got {value}")
        if self.block_k < 16:
            raise ValueError(f"GemvConfig.block_k must be >= 16, got {self.block_k}")
        if self.split_k < 1 or self.num_stages < 1:
            raise ValueError(f"GemvConfig: split_k and num_stages must be >= 1, got {self}")

    def to_json(self) -> dict[str, int]:
        """The table entry: the flags (``FLAGS``) only where set (1)."""
        data = {k: int(v) for k, v in asdict(self).items()}
        for flag in FLAGS:
            if not data[flag]:
                del data[flag]
        return data

    @classmethod
    def from_json(cls, data: dict[str, int]) -> GemvConfig:
        values = {k: int(data[k]) for k in cls.__dataclass_fields__ if k in data}
        for flag in FLAGS:
            if flag in values:
                values[flag] = bool(values[flag])
        return cls(**values)  # type: ignore[arg-type]


def gemv_kind(weight_dtype: torch.dtype, block: tuple[int, int] | None, w8a8: bool = False) -> str:
    """The table a weight's configs live in: its dtype and, for FP8, its scale layout and form (``_mma``:
    activations quantized, e4m3 x e4m3 tensor-core dots; else weight-only)."""
    if weight_dtype == torch.float8_e4m3fn:
        return ("fp8_block" if block is not None else "fp8_channel") + ("_mma" if w8a8 else "")
    if weight_dtype == torch.bfloat16:
        return "bf16"
    if weight_dtype == torch.float16:
        return "fp16"
    raise ValueError(f"gemv: weight dtype {weight_dtype} is not float8_e4m3fn, bfloat16 or float16")


def shape_key(n: int, k: int) -> str:
    return f"N{n}_K{k}"


def config_file_name(device_name: str) -> str:
    return f"gemv_{device_file_tag(device_name)}.json"


def config_dirs() -> list[pathlib.Path]:
    """Where tables are looked up, first match wins: ``PLAIT_GEMV_CONFIG_DIR`` (if set), ``configs/``."""
    override = envs.GEMV_CONFIG_DIR.get()
    return ([pathlib.Path(override)] if override else []) + [CONFIG_DIR]


@functools.cache
def _load_tables(device_name: str, dirs: tuple[pathlib.Path, ...]) -> dict[str, dict[str, dict[int, GemvConfig]]]:
    raw = first_existing(config_file_name(device_name), dirs) or {}
    return {kind: {shape: {int(m): GemvConfig.from_json(cfg) for m, cfg in buckets.items()}
                   for shape, buckets in shapes.items()}
            for kind, shapes in raw.items()}


def load_tables(device_name: str) -> dict[str, dict[str, dict[int, GemvConfig]]]:
    """kind -> shape key -> bucket -> config, from the first directory holding this device's file
    (parsed once per device and directory list; {} without a file)."""
    return _load_tables(device_name, tuple(config_dirs()))


def clear_cache() -> None:
    """Forget parsed tables and resolved configs (tests that write tables)."""
    _load_tables.cache_clear()
    _resolve.cache_clear()
    _gemv_takes.cache_clear()


def balanced_split(n_tiles: int, k_steps: int, num_sms: int) -> int:
    """split_k for ``n_tiles`` row tiles of ``k_steps`` steps each: 1 when the tiles alone give >= 4
    programs per SM, else the smallest divisor of ``k_steps`` that does (slices of equal whole steps,
    no column masks), at most ``k_steps // 2`` (each slice >= 2 steps, so the pipeline has work)."""
    target = -(-4 * num_sms // n_tiles)
    if target <= 1:
        return 1
    divisors = [d for d in range(1, k_steps // 2 + 1) if k_steps % d == 0] or [1]
    return next((d for d in divisors if d >= target), divisors[-1])


def default_config(kind: str, m: int, n: int, k: int, num_sms: int) -> GemvConfig:
    """Untuned fallback, sized for bandwidth:

    - one token: 8 rows (4 where 8 would give fewer than 4 programs per SM) x 512 bytes of weights per
      loop step as an elementwise product (no tensor cores), 4 warps each issuing 16-byte loads, three
      steps in flight. Small row tiles give about a thousand programs or more at the llama shapes
      (4-27 per SM), so enough loads are in flight to cover HBM latency, and the K reduction runs once
      per program.
    - 2..16 tokens: the tensor-core form needs 16 rows and 16+ columns; 32 rows x 256 columns per step.
    - split-K only when the row tiles alone give fewer than about 4 programs per SM, into whole
      ``block_k`` steps (FP8 block scales: steps of at most one 128-column scale block).
    - the FP8 W8A8 kinds (``*_mma``): 64 rows x one 128-column group per step, four steps in flight.
    """
    fp8 = kind.startswith("fp8")
    if kind.endswith("_mma"):
        # 64 weight rows (one warpgroup MMA of 4 warps) x one 128-column activation group (128 bytes of
        # each row) per step: the depth of the pipeline carries the bytes in flight.
        block_n = 64
        split_k = balanced_split(-(-n // block_n), -(-k // 128), num_sms)
        return GemvConfig(block_n=block_n, block_k=128, split_k=split_k, num_warps=4, num_stages=4)
    if m == 1:
        # Halving the row tile before splitting K: a split adds a partial round trip to each tile's tail.
        block_n, block_k = 8 if -(-n // 8) >= 4 * num_sms else 4, 512 if fp8 else 256
    else:
        block_n, block_k = 32, 256 if fp8 else 128
    if kind == "fp8_block":
        block_k = min(block_k, 128)
        block_n *= 2 if m == 1 else 1
    split_k = balanced_split(-(-n // block_n), -(-k // block_k), num_sms)
    return GemvConfig(block_n=block_n, block_k=block_k, split_k=split_k, num_warps=4, num_stages=3)


def _buckets(kind: str, n: int, k: int, device_name: str) -> dict[int, GemvConfig] | None:
    """This device's tuned entries of (kind, N, K) by token bucket, or None."""
    return load_tables(device_name).get(kind, {}).get(shape_key(n, k))


def gemv_takes(kind: str, m: int, n: int, k: int, device_name: str) -> bool:
    """Whether a dense layer's call of ``m`` tokens should run the GEMV rather than cuBLAS: one token
    always; 2..``GEMV_MAX_TOKENS`` where this device's table (``load_tables``) has an entry of (kind,
    N, K) at a bucket past one token covering ``m`` (``covering_bucket``), not marked
    ``prefer_cublas``. Untuned, the tensor-core form's default tiles lose to cuBLAS's small-N kernels."""
    if m == 1:
        return True
    return m <= GEMV_MAX_TOKENS and _gemv_takes(kind, m, n, k, device_name, envs.GEMV_CONFIG_DIR.get(), CONFIG_DIR)


@functools.cache
def _gemv_takes(kind: str, m: int, n: int, k: int, device_name: str, override: str | None,
                package_dir: pathlib.Path) -> bool:
    del override, package_dir  # cache keys: load_tables reads the same sources
    buckets = _buckets(kind, n, k, device_name)
    if not buckets:
        return False
    bucket = covering_bucket(buckets, m)
    return bucket > 1 and not buckets[bucket].prefer_cublas


def get_config(kind: str, m: int, n: int, k: int, device_name: str, num_sms: int) -> GemvConfig:
    """The tuned config of (kind, N, K) at the smallest bucket >= m, else ``default_config``; one token
    of a one-row kind (not ``_mma``: W8A8 runs every M as a tile) takes only a one-token entry: tiles
    tuned for the tensor-core form of several rows are no guide to the one-row form's. Resolved once
    per call shape and config source: a decode step asks for every layer, host time matters."""
    return _resolve(kind, m, n, k, device_name, num_sms, envs.GEMV_CONFIG_DIR.get(), CONFIG_DIR)


@functools.cache
def _resolve(kind: str, m: int, n: int, k: int, device_name: str, num_sms: int, override: str | None,
             package_dir: pathlib.Path) -> GemvConfig:
    del override, package_dir  # cache keys: load_tables reads the same sources
    buckets = _buckets(kind, n, k, device_name)
    if not buckets or (m == 1 and 1 not in buckets and not kind.endswith("_mma")):
        return default_config(kind, m, n, k, num_sms)
    return buckets[covering_bucket(buckets, m)]
