"""Kernel launch configurations stored as data: the pieces every tuned-config table shares.

A tuner script (``benchmarks/tune_fused_moe.py``, ``benchmarks/tune_gemv.py``) measures launch configs on
a GPU and writes JSON files named after the device; a kernel's wrapper reads them at run time
(``plait.layers.moe.kernel_config``, ``plait.layers.quantization.gemv_config``). Tables map a token
bucket M (a string key in JSON) to a config; a call takes a bucket chosen from its token count.
"""

from __future__ import annotations

import functools
import json
import pathlib
import re
from collections.abc import Iterable
from typing import Any

import torch


def device_file_tag(device_name: str) -> str:
    """A device name as it appears in config file names: every character other than a letter, digit
    or ``-`` becomes ``_`` (``NVIDIA H200`` -> ``NVIDIA_H200``)."""
    return re.sub(r"[^A-Za-z0-9-]", "_", device_name)


@functools.lru_cache(maxsize=8)
def _cuda_device(index: int) -> tuple[str, int]:
    props = torch.cuda.get_device_properties(index)
    return props.name, props.multi_processor_count


def device_info(t: torch.Tensor) -> tuple[str, int]:
    """(device name as config files key it, SM count) of a tensor's device; the interpreter's stand-in
    on the CPU (no tuned file, any positive SM count)."""
    if t.device.type != "cuda":
        return "cpu", 8
    return _cuda_device(t.device.index if t.device.index is not None else torch.cuda.current_device())


def read_json_file(path: pathlib.Path) -> Any | None:
    """The parsed file, or None when it does not exist (callers cache what they build from it)."""
    if not path.is_file():
        return None
    return json.loads(path.read_text())


def first_existing(name: str, dirs: Iterable[pathlib.Path]) -> Any | None:
    """The parsed ``name`` from the first directory of ``dirs`` that holds it, else None."""
    for d in dirs:
        data = read_json_file(d / name)
        if data is not None:
            return data
    return None


def nearest_bucket(buckets: Iterable[int], m: int) -> int:
    """The bucket nearest ``m`` (ties: the smaller one)."""
    return min(buckets, key=lambda b: (abs(b - m), b))


def covering_bucket(buckets: Iterable[int], m: int) -> int:
    """The smallest bucket >= ``m``, else the largest: for kernels whose tiles are sized by the bucket."""
    ordered = sorted(buckets)
    return next((b for b in ordered if b >= m), ordered[-1])
