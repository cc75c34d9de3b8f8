"""Launch configurations of the fused MoE kernels, stored as data and read at run time.

``benchmarks/tune_fused_moe.py`` writes one JSON file per expert shape and device under
``configs/`` (or any directory: at run time the one named by ``PLAIT_MOE_CONFIG_DIR`` is read first,
so a fresh tune serves the same GPU session, then ``configs/``), named ``E{E}_N{N}_{device}.json``
(N is the intermediate size per rank, ``w2.shape[2]``; in the device name every character other
than a letter, digit or ``-`` becomes ``_``). Each maps a
batch bucket M (tokens, as a string) to a config; a call takes the bucket nearest its token count.
Block-FP8 experts have their own tables, the dtype named as SGLang names it:
``E{E}_N{N}_{device}_dtype=fp8_w8a8.json`` (``FP8_DTYPE_KEY``; their block_k is at most 128).
Without a file, a default that depends on how many tokens each expert receives on average (valid
for both dtypes).
"""

from __future__ import annotations

import functools
import pathlib
from dataclasses import asdict, dataclass

from plait import envs
from plait.layers.tuned_configs import device_file_tag, first_existing, nearest_bucket

CONFIG_DIR = pathlib.Path(__file__).parent / "configs"
# The dtype key of the tables for block-FP8 experts (W8A8 with 128 x 128 weight blocks).
FP8_DTYPE_KEY = "fp8_w8a8"


def config_dirs() -> tuple[pathlib.Path, ...]:
    """Where the MoE tables (this module's and ``small_batch``'s) are looked up, first match wins:
    ``PLAIT_MOE_CONFIG_DIR`` (if set), then ``configs/``. Every MoE layer call asks (eager steps
    too), so the tuple is built once per setting."""
    return _dirs(envs.MOE_CONFIG_DIR.get(), CONFIG_DIR)


@functools.cache
def _dirs(override: str | None, package_dir: pathlib.Path) -> tuple[pathlib.Path, ...]:
    return ((pathlib.Path(override),) if override else ()) + (package_dir,)


@dataclass(frozen=True)
class MoeKernelConfig:
    """Tile sizes of the two grouped GEMMs (they share ``block_m``: one alignment serves both) and
    whether the activation runs in the gate/up GEMM's epilogue or as its own kernel."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3
    fuse_activation: bool = False

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k"):
            value = getattr(self, name)
            if value < 16 or value & (value - 1):
                raise ValueError(f"MoeKernelConfig.{name} must be a power of two >= 16, got {value}")
        if self.group_m < 1 or self.num_warps < 1 or self.num_stages < 1:
            raise ValueError(f"MoeKernelConfig: group_m, num_warps and num_stages must be >= 1, got {self}")

    def to_json(self) -> dict[str, int | bool]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, int | bool]) -> MoeKernelConfig:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})  # type: ignore[arg-type]


def dtype_suffix(dtype: str | None) -> str:
    """The file-name part naming a table's expert dtype: none for the model dtype, ``_dtype=KEY``."""
    return f"_dtype={dtype}" if dtype else ""


def config_file_name(num_experts: int, intermediate: int, device_name: str, dtype: str | None = None) -> str:
    return f"E{num_experts}_N{intermediate}_{device_file_tag(device_name)}{dtype_suffix(dtype)}.json"


def load_configs(num_experts: int, intermediate: int, device_name: str,
                 dtype: str | None = None) -> dict[int, MoeKernelConfig] | None:
    """Bucket M -> config from the tuned file, or None when no file exists for this shape/device
    (parsed once per shape, device, dtype and ``config_dirs``)."""
    return _load_configs(num_experts, intermediate, device_name, config_dirs(), dtype)


@functools.cache
def _load_configs(num_experts: int, intermediate: int, device_name: str,
                  dirs: tuple[pathlib.Path, ...], dtype: str | None = None) -> dict[int, MoeKernelConfig] | None:
    raw = first_existing(config_file_name(num_experts, intermediate, device_name, dtype), dirs)
    if raw is None:
        return None
    return {int(m): MoeKernelConfig.from_json(cfg) for m, cfg in raw.items()}


def default_config(num_tokens: int, num_experts: int, top_k: int) -> MoeKernelConfig:
    """Untuned fallback: small row blocks while experts see few tokens each, larger once they fill."""
    per_expert = num_tokens * top_k / max(num_experts, 1)
    if per_expert <= 16:
        return MoeKernelConfig(block_m=16, block_n=64, block_k=128, group_m=1, num_warps=4, num_stages=4)
    if per_expert <= 64:
        return MoeKernelConfig(block_m=32, block_n=64, block_k=64, group_m=8, num_warps=4, num_stages=4)
    return MoeKernelConfig(block_m=64, block_n=128, block_k=64, group_m=8, num_warps=8, num_stages=3)


def get_config(num_tokens: int, num_experts: int, intermediate: int, top_k: int,
               device_name: str, dtype: str | None = None) -> MoeKernelConfig:
    """The tuned config of the bucket nearest ``num_tokens`` (ties: the smaller bucket), else the default
    (resolved once per call shape, dtype key and table source)."""
    return _resolve(num_tokens, num_experts, intermediate, top_k, device_name, config_dirs(), dtype)


@functools.lru_cache(maxsize=4096)
def _resolve(num_tokens: int, num_experts: int, intermediate: int, top_k: int, device_name: str,
             dirs: tuple[pathlib.Path, ...], dtype: str | None = None) -> MoeKernelConfig:
    table = _load_configs(num_experts, intermediate, device_name, dirs, dtype)
    if not table:
        return default_config(num_tokens, num_experts, top_k)
    return table[nearest_bucket(table, num_tokens)]
