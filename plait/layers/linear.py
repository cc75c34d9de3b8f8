"""Linear layers shaped for tensor parallelism (Megatron style).

ColumnParallelLinear splits the output dimension across ranks, RowParallelLinear the input
dimension (its partial sums are all-reduced). Fused projections (qkv, gate_up) load each
checkpoint shard into its slice through ``weight_loader(param, loaded, shard_id)``.

A quantized layer holds a ``LinearMethod`` (plait.layers.quantization) in ``quant_method``: it owns the
layer's weight storage (FP8 weight, scales) and its matmul; None is the plain ``F.linear``, or, on CUDA
for decode batches of <= 16 tokens, plait's GEMV (``PLAIT_BF16_GEMV``, on by default, read when the
layer is built; 0 keeps cuBLAS).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from plait import envs
from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.layers.quantization.gemv import dense_linear


class LinearMethod(Protocol):
    """A quantized layer's matmul: ``x [..., in] -> [..., out]`` from the weight storage the method
    placed on ``layer`` (plait.layers.quantization.fp8.Fp8LinearMethod)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


def _divide(n: int, d: int, what: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by tensor parallel size {d}")
    return n // d


class ColumnParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.in_features = in_features
        self.out_features_per_rank = _divide(out_features, tp.size, "output features")
        self.weight = nn.Parameter(torch.empty(self.out_features_per_rank, in_features, dtype=dtype),
                                   requires_grad=False)
        self.bias = (nn.Parameter(torch.empty(self.out_features_per_rank, dtype=dtype), requires_grad=False)
                     if bias else None)
        self.quant_method: LinearMethod | None = None
        self.small_m_gemv = envs.BF16_GEMV.get()

    def shard_ids(self) -> list[str | int | None]:
        """The checkpoint shards fused into this layer, in output order (None: not fused)."""
        return [None]

    def shard_rows(self, shard_id: str | int | None) -> tuple[int, int, int]:
        """``(offset, size, source_rank)``: shard ``shard_id`` fills output rows ``[offset, offset +
        size)`` of this rank from rows ``[source_rank * size, (source_rank + 1) * size)`` of the
        checkpoint tensor."""
        return 0, self.out_features_per_rank, self.tp.rank

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        offset, size, rank = self.shard_rows(shard_id)
        param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, self.bias)
        return dense_linear(x, self.weight, self.bias, self.small_m_gemv)


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one matmul (gate_up): shard ``i`` lands in slice ``i``."""

    def __init__(self, in_features: int, output_sizes: list[int], bias: bool = False,
                 tp: TPGroup = SINGLE, dtype: torch.dtype | None = None) -> None:
        super().__init__(in_features, sum(output_sizes), bias, tp, dtype)
        self.output_sizes_per_rank = [_divide(s, tp.size, "merged output") for s in output_sizes]

    def shard_ids(self) -> list[str | int | None]:
        return list(range(len(self.output_sizes_per_rank)))

    def shard_rows(self, shard_id: str | int | None) -> tuple[int, int, int]:
        assert isinstance(shard_id, int), "merged linear shards are numbered"
        size = self.output_sizes_per_rank[shard_id]
        return sum(self.output_sizes_per_rank[:shard_id]), size, self.tp.rank


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections in one matmul. KV heads are replicated when tp_size > num_kv_heads."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int,
                 bias: bool = False, tp: TPGroup = SINGLE, dtype: torch.dtype | None = None) -> None:
        self.num_heads = _divide(num_heads, tp.size, "attention heads")
        self.num_kv_heads = max(1, num_kv_heads // tp.size)
        if num_kv_heads >= tp.size:
            _divide(num_kv_heads, tp.size, "KV heads")
        self.kv_replicas = max(1, tp.size // num_kv_heads)
        self.head_dim = head_dim
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp.size
        super().__init__(hidden_size, out, bias, tp, dtype)

    def shard_ids(self) -> list[str | int | None]:
        return ["q", "k", "v"]

    def shard_rows(self, shard_id: str | int | None) -> tuple[int, int, int]:
        q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        if shard_id == "q":
            return 0, q_size, self.tp.rank
        if shard_id in ("k", "v"):
            offset = q_size if shard_id == "k" else q_size + kv_size
            return offset, kv_size, self.tp.rank // self.kv_replicas
        raise ValueError(f"qkv shard id must be 'q', 'k' or 'v', got {shard_id!r}")


class RowParallelLinear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False,
                 tp: TPGroup = SINGLE, dtype: torch.dtype | None = None, reduce_results: bool = True) -> None:
        super().__init__()
        self.tp = tp
        self.reduce_results = reduce_results
        self.in_features_per_rank = _divide(in_features, tp.size, "input features")
        self.weight = nn.Parameter(torch.empty(out_features, self.in_features_per_rank, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.quant_method: LinearMethod | None = None
        self.small_m_gemv = envs.BF16_GEMV.get()

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param.dim() == 1:  # bias is added once, after the reduction
            param.data.copy_(loaded)
            return
        n = param.shape[1]
        param.data.copy_(loaded.narrow(1, self.tp.rank * n, n))

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return dense_linear(x, self.weight, bias, self.small_m_gemv)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:  # nothing to reduce: the bias goes into the matmul (the GEMV's epilogue)
            return self._matmul(x, self.bias)
        out = self._matmul(x)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
        return self.add_bias(out)

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's partial sums (no reduction, no bias): for callers that reduce another way
        (DP attention reduce-scatters) and then call ``add_bias``."""
        return self._matmul(x)

    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced if self.bias is None else reduced + self.bias
