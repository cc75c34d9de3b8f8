"""Request-to-token map, the paged KV pool and its slot allocator (page size 1).

Reserved entries: KV slot 0 and request row 0 are never handed out. Padded rows of a CUDA graph
write their KV into slot 0 and read row 0, so they can never touch a live request's data.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

DUMMY_KV_SLOT = 0
DUMMY_REQ_ROW = 0


def log_device_memory(stage: str, device: torch.device | str) -> None:
    """One line of where device memory stands after ``stage`` of engine start (CUDA only), so a
    start that runs out of memory shows which stage took it."""
    if torch.device(device).type != "cuda":
        return
    free, total = torch.cuda.mem_get_info()
    logger.info("device memory after %s: %.2f GiB allocated by torch, %.2f GiB reserved, %.2f of %.2f GiB free",
                stage, torch.cuda.memory_allocated() / 2**30, torch.cuda.memory_reserved() / 2**30,
                free / 2**30, total / 2**30)


class ReqToTokenPool:
    """``req_to_token[row, pos]`` is the KV slot holding position ``pos`` of the request in ``row``.

    Owns: the int32 map [size + 1, max_context_len] on the device and the free-row list (host).
    """

    def __init__(self, size: int, max_context_len: int, device: torch.device | str) -> None:
        self.size = size
        self.max_context_len = max_context_len
        self.device = torch.device(device)
        self.req_to_token = torch.zeros((size + 1, max_context_len), dtype=torch.int32, device=device)
        self._free_rows: list[int] = list(range(1, size + 1))

    def available_size(self) -> int:
        return len(self._free_rows)

    def alloc(self) -> int | None:
        return self._free_rows.pop() if self._free_rows else None

    def free(self, row: int) -> None:
        if not 1 <= row <= self.size:
            raise ValueError(f"request row {row} is not a pool row (1..{self.size})")
        self._free_rows.append(row)

    def write(self, row: int, start: int, slots: torch.Tensor) -> None:
        self.req_to_token[row, start : start + slots.numel()] = slots.to(torch.int32)

    def scatter(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """``req_to_token[rows, positions] = slots`` (broadcast like tensor indexing; one scatter)."""
        self.req_to_token[rows, positions] = slots.to(torch.int32)

    def clear(self) -> None:
        """Every row free again, in the order of a new pool (the map's contents are left: a row is
        written before it is read)."""
        self._free_rows = list(range(1, self.size + 1))


KV_CACHE_FP8_DTYPES: dict[str, torch.dtype] = {
    "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The storage dtype of ``--kv-cache-dtype name``: ``auto`` is the model's dtype."""
    return model_dtype if name == "auto" else KV_CACHE_FP8_DTYPES[name]


class MHATokenToKVPool:
    """Per-layer K and V buffers ``[size + 1, num_kv_heads, head_dim]`` (slot 0 is the dummy).

    An FP8 pool (``dtype`` float8_e4m3fn / float8_e5m2) stores ``k / k_scales[layer]`` and
    ``v / v_scales[layer]`` saturated to the format's range; readers multiply back (``k_scale_of``,
    ``dequantize``). The scales are host floats, fixed for the pool's life, so graphs capture them as
    constants. Pools in the model's dtype keep scales of 1.0 and ignore any a checkpoint carries."""

    def __init__(
        self,
        size: int,
        dtype: torch.dtype,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        k_scales: list[float] | None = None,
        v_scales: list[float] | None = None,
    ) -> None:
        self.size = size
        self.dtype = dtype
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.is_fp8 = dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        self.fp8_max = float(torch.finfo(dtype).max) if self.is_fp8 else 0.0
        ones = [1.0] * num_layers
        self.k_scales = list(k_scales or ones) if self.is_fp8 else ones
        self.v_scales = list(v_scales or ones) if self.is_fp8 else ones
        if len(self.k_scales) != num_layers or len(self.v_scales) != num_layers:
            raise ValueError(f"KV scales for {len(self.k_scales)}/{len(self.v_scales)} layers, pool has {num_layers}")
        shape = (size + 1, num_kv_heads, head_dim)
        self.k_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_buffer = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @staticmethod
    def bytes_per_token(dtype: torch.dtype, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        return 2 * num_layers * num_kv_heads * head_dim * torch.finfo(dtype).bits // 8

    def get_key_buffer(self, layer_id: int) -> torch.Tensor:
        return self.k_buffer[layer_id]

    def get_value_buffer(self, layer_id: int) -> torch.Tensor:
        return self.v_buffer[layer_id]

    def kv_scales_of(self, layer_id: int) -> tuple[float, float]:
        """``(k_scale, v_scale)``: what a stored value of ``layer_id`` is multiplied by when read."""
        return self.k_scales[layer_id], self.v_scales[layer_id]

    def _encode(self, x: torch.Tensor, scale: float) -> torch.Tensor:
        if not self.is_fp8:
            return x.to(self.dtype)
        return (x.float() * (1.0 / scale)).clamp(-self.fp8_max, self.fp8_max).to(self.dtype)

    def dequantize(self, stored: torch.Tensor, scale: float, dtype: torch.dtype) -> torch.Tensor:
        """Values read from the buffers (any rows) in ``dtype``."""
        if not self.is_fp8:
            return stored.to(dtype)
        return (stored.float() * scale).to(dtype)

    def as_stored(self, layer_id: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """New tokens' K/V as a reader of the cache sees them (an FP8 round trip; unchanged otherwise).
        Extends attend to their own tokens through this, so a token's attention reads the same K/V
        whether it comes from this batch or from the cache: chunking a prompt, reusing a cached
        prefix or recomputing a retracted request changes no value."""
        if not self.is_fp8:
            return k, v
        k_scale, v_scale = self.kv_scales_of(layer_id)
        return (self.dequantize(self._encode(k, k_scale), k_scale, k.dtype),
                self.dequantize(self._encode(v, v_scale), v_scale, v.dtype))

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store new tokens' K/V ([T, num_kv_heads, head_dim]) at slots ``loc`` ([T])."""
        k_scale, v_scale = self.kv_scales_of(layer_id)
        self.k_buffer[layer_id][loc] = self._encode(k, k_scale)
        self.v_buffer[layer_id][loc] = self._encode(v, v_scale)


class TokenToKVPoolAllocator:
    """Hands out KV slots 1..size. Free slots live in a device tensor so allocation yields
    ``out_cache_loc`` on the device without a copy; sizes are host-known (tensor lengths)."""

    def __init__(self, size: int, device: torch.device | str) -> None:
        self.size = size
        self.device = torch.device(device)
        self.clear()

    def clear(self) -> None:
        self._free = torch.arange(1, self.size + 1, dtype=torch.int64, device=self.device)
        # Frees are batched: concatenating on every free is the cost that matters at high bs.
        self._pending: list[torch.Tensor] = []
        self._pending_count = 0

    def available_size(self) -> int:
        return int(self._free.numel()) + self._pending_count

    def alloc(self, n: int) -> torch.Tensor | None:
        if n > self._free.numel() and self._pending:
            self._merge()
        if n > self._free.numel():
            return None
        out, self._free = self._free[:n], self._free[n:]
        return out

    def free(self, indices: torch.Tensor) -> None:
        if indices.numel() == 0:
            return
        self._pending.append(indices.to(device=self.device, dtype=torch.int64))
        self._pending_count += int(indices.numel())

    def _merge(self) -> None:
        self._free = torch.cat([self._free, *self._pending])
        self._pending = []
        self._pending_count = 0
