"""Read only this rank's shard of a checkpoint tensor.

``LazySlice`` stands in for a safetensors tensor during ``load_weights`` under tensor parallelism:
the weight loaders call ``narrow`` / ``[a:b]`` on it, which reads just that slice from the file
(safetensors ``get_slice``), so a rank never materialises the full matrix it shards. Anything else
torch does with it (``param.data.copy_(lazy)`` for replicated weights such as norms) goes through
``__torch_function__`` and reads the whole tensor, which is what a replicated weight needs anyway.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

# safetensors' dtype names -> torch (the ones checkpoints plait reads hold).
_SAFETENSORS_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "BF16": torch.bfloat16, "F16": torch.float16,
                       "F32": torch.float32, "I64": torch.int64, "I32": torch.int32, "U8": torch.uint8}


class LazySlice:
    def __init__(self, source: Any, dtype: torch.dtype | None = None) -> None:
        self._source = source  # a safetensors PySafeSlice (get_shape(), __getitem__ with slices)
        self._dtype = dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._source.get_shape())

    def dim(self) -> int:
        return len(self.shape)

    @property
    def dtype(self) -> torch.dtype | None:
        """The dtype a read returns (None: one safetensors holds that torch has no name for here)."""
        return self._dtype or _SAFETENSORS_DTYPES.get(self._source.get_dtype())

    def to(self, dtype: torch.dtype) -> LazySlice:
        """Conversion happens on the slice when it is read, not on the whole tensor."""
        return LazySlice(self._source, dtype)

    def _read(self, index: Any) -> torch.Tensor:
        t = self._source[index]
        return t if self._dtype is None else t.to(self._dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        index = (slice(None),) * dim + (slice(start, start + length),)
        return self._read(index)

    def __getitem__(self, index: Any) -> torch.Tensor:
        if isinstance(index, slice) and index.stop is not None:
            # Python semantics (clamp at the end), which a padded vocabulary shard relies on.
            index = slice(index.start, min(index.stop, self.shape[0]), index.step)
        return self._read(index)

    def materialize(self) -> torch.Tensor:
        return self._read(slice(None))

    @classmethod
    def __torch_function__(cls, func: Callable[..., Any], types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        def real(x: Any) -> Any:
            return x.materialize() if isinstance(x, LazySlice) else x

        return func(*(real(a) for a in args), **{k: real(v) for k, v in (kwargs or {}).items()})
