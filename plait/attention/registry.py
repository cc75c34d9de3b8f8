"""Attention backend registry: name -> factory returning ``(effective_name, backend)``.

A leaf answers the kernel it actually built, so an alias or a host-dependent choice is named by
what it built (docs/architecture.md). ``create_attention_backend`` builds the serving backend for a
(prefill, decode) pair: one backend when both halves agree, else a HybridAttnBackend.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from plait.attention.base import AttentionBackend
from plait.config import auto_backends

if TYPE_CHECKING:
    from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool

# (req_to_token_pool, kv_pool, query heads per rank, the model's sliding window or None)
#   -> (effective kernel name, backend)
BackendFactory = Callable[["ReqToTokenPool", "MHATokenToKVPool", int, "int | None"], tuple[str, AttentionBackend]]

_REGISTRY: dict[str, BackendFactory] = {}


def register_backend(name: str) -> Callable[[BackendFactory], BackendFactory]:
    def wrap(factory: BackendFactory) -> BackendFactory:
        _REGISTRY[name] = factory
        return factory

    return wrap


def registered_backends() -> tuple[str, ...]:
    return tuple(sorted(_REGISTRY))


@register_backend("torch_native")
def _torch_native(
    req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_q_heads: int,
    sliding_windows: tuple[int, ...]
) -> tuple[str, AttentionBackend]:
    from plait.attention.torch_native import TorchNativeAttnBackend

    return "torch_native", TorchNativeAttnBackend(req_to_token_pool, kv_pool)


@register_backend("triton")
def _triton(
    req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_q_heads: int,
    sliding_windows: tuple[int, ...]
) -> tuple[str, AttentionBackend]:
    # The Triton interpreter (TRITON_INTERPRET=1) runs the same kernels on CPU tensors, for tests.
    if kv_pool.k_buffer[0].device.type != "cuda" and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError(
            "attention backend 'triton' needs a CUDA device; on the CPU use --attention-backend torch_native"
        )
    from plait.attention.triton_backend import TritonAttnBackend

    return "triton", TritonAttnBackend(req_to_token_pool, kv_pool, num_q_heads, sliding_windows)


@register_backend("torch_flash")
def _torch_flash(
    req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_q_heads: int,
    sliding_windows: tuple[int, ...]
) -> tuple[str, AttentionBackend]:
    from plait.attention.torch_flash import TorchFlashAttnBackend, check_available

    check_available(kv_pool.k_buffer[0].device)  # ValueError naming the backends that run here
    # It applies each layer's own window at the call; the constructor only asks whether any layer has one.
    return "torch_flash", TorchFlashAttnBackend(req_to_token_pool, kv_pool,
                                                sliding_window=max(sliding_windows, default=None))


@register_backend("auto")
def _auto(
    req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_q_heads: int,
    sliding_windows: tuple[int, ...]
) -> tuple[str, AttentionBackend]:
    # A leaf builds one backend: the decode half of the device's auto pair (what a draft model, which
    # defaults to the decode half, would get). Engine pairs resolve ``auto`` in attention_backends().
    name = auto_backends(kv_pool.k_buffer[0].device.type)[1]
    return _REGISTRY[name](req_to_token_pool, kv_pool, num_q_heads, sliding_windows)


# Backends whose kernels have no attention-sink term.
SINKLESS_BACKENDS = ("torch_flash",)


def build_backend(name: str, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool,
                  num_q_heads: int | None = None, *, sliding_windows: tuple[int, ...] = ()) -> AttentionBackend:
    """``num_q_heads``: query heads per rank (default: as many as KV heads); ``sliding_windows``: the
    distinct windows of the model's windowed layers (empty: every layer is full)."""
    if name not in _REGISTRY:
        raise ValueError(f"unknown attention backend {name!r}; registered: {registered_backends()}")
    effective, backend = _REGISTRY[name](req_to_token_pool, kv_pool, num_q_heads or kv_pool.num_kv_heads,
                                         sliding_windows)
    backend.name = effective
    return backend


def create_attention_backend(
    pair: tuple[str, str], req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool, num_q_heads: int,
    speculative_attention_mode: str = "prefill", *, sliding_windows: tuple[int, ...] = (), has_sinks: bool = False,
) -> AttentionBackend:
    """``has_sinks``: the model's layers carry attention sinks, which only some backends serve."""
    prefill_name, decode_name = pair
    refusing = [name for name in dict.fromkeys(pair) if name in SINKLESS_BACKENDS]
    if has_sinks and refusing:
        raise ValueError(f"attention backend {refusing[0]!r} does not support attention sinks (this model has "
                         "them, as gpt-oss does); use --attention-backend triton or torch_native")
    prefill = build_backend(prefill_name, req_to_token_pool, kv_pool, num_q_heads, sliding_windows=sliding_windows)
    if decode_name == prefill_name:
        return prefill
    from plait.attention.hybrid import HybridAttnBackend

    decode = build_backend(decode_name, req_to_token_pool, kv_pool, num_q_heads, sliding_windows=sliding_windows)
    return HybridAttnBackend(prefill, decode, speculative_attention_mode)
