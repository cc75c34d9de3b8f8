"""Triton attention kernels on a page-size-1 paged KV cache (pure functions, no engine objects).

The code lives in ``decode.py`` (split-KV decode + split heuristic), ``extend.py`` (prefix + new tokens,
causal or custom mask), ``indices.py`` (kv_indptr/kv_indices from req_to_token, per request or per
verify token) and ``store.py``; this module is the one import site for callers. Plain-torch references
of the same signatures are in ``reference.py``.
"""

from __future__ import annotations

from ._common import LaunchConfig
from .decode import decode_attention_fwd, decode_config, get_num_kv_splits
from .extend import extend_attention_fwd, extend_config
from .indices import build_kv_indices, build_verify_kv_indices
from .store import store_kv

__all__ = [
    "LaunchConfig",
    "build_kv_indices",
    "build_verify_kv_indices",
    "decode_attention_fwd",
    "decode_config",
    "extend_attention_fwd",
    "extend_config",
    "get_num_kv_splits",
    "store_kv",
]
