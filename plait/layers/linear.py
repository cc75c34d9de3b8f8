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
from plait.layers.activation import SiluAndMul
from plait.layers.quantization.gemv import GemvOperands, dense_gemv_operands, dense_linear, gemv_silu_mul
from plait.layers.quantization.gemv_config import GEMV_MAX_TOKENS


class LinearMethod(Protocol):
    """A quantized layer's matmul: ``x [..., in] -> [..., out]`` from the weight storage the method
    placed on ``layer`` (plait.layers.quantization.fp8.Fp8LinearMethod)."""

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...

    def gemv_operands(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> GemvOperands | None:
        """The layer's weight as the GEMV takes it, where ``apply`` of a decode-sized ``x`` runs the GEMV."""
        ...


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

    def gemv_operands(self, x: torch.Tensor) -> GemvOperands | None:
        """Where ``forward`` of a decode-sized ``x`` runs the GEMV: its operands (plait.layers.norm_linear)."""
        if self.quant_method is not None:
            return self.quant_method.gemv_operands(self, x, self.bias)
        return dense_gemv_operands(x, self.weight, self.bias, self.small_m_gemv)


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

    def _matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None, silu_mul_input: bool = False) -> torch.Tensor:
        if silu_mul_input:
            operands = self._silu_mul_operands(x)
            if operands is None:
                x = SiluAndMul()(x)
            else:  # the SiLU-and-mul inside the GEMV's loads (PLAIT_FUSED_ACT_GEMV)
                x2 = x.reshape(-1, x.shape[-1])
                out = gemv_silu_mul(x2, operands.weight, operands.scale, operands.block, bias=bias)
                return out.view(*x.shape[:-1], out.shape[-1])
        if self.quant_method is not None:
            return self.quant_method.apply(self, x, bias)
        return dense_linear(x, self.weight, bias, self.small_m_gemv)

    def _silu_mul_operands(self, gate_up: torch.Tensor) -> GemvOperands | None:
        """Where the GEMV would run this layer on ``silu_and_mul(gate_up)``: its operands (bias aside)."""
        rows = gate_up.numel() // gate_up.shape[-1] if gate_up.dim() else 0
        if not (1 <= rows <= GEMV_MAX_TOKENS and envs.FUSED_ACT_GEMV.get()):
            return None
        if self.quant_method is not None:
            return self.quant_method.gemv_operands(self, gate_up, None)
        return dense_gemv_operands(gate_up, self.weight, None, self.small_m_gemv)

    def forward(self, x: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
        """``x @ W.T`` reduced over the TP group, plus the bias; ``silu_mul_input``: x is a gate_up output
        ``[..., 2 * in]`` and the layer multiplies ``silu_and_mul(x)`` (inside the GEMV where it runs)."""
        if self.tp.size == 1:  # nothing to reduce: the bias goes into the matmul (the GEMV's epilogue)
            return self._matmul(x, self.bias, silu_mul_input)
        out = self._matmul(x, None, silu_mul_input)
        if self.reduce_results:
            out = self.tp.all_reduce(out)
        return self.add_bias(out)

    def partial(self, x: torch.Tensor, silu_mul_input: bool = False) -> torch.Tensor:
        """This rank's partial sums (no reduction, no bias): for callers that reduce another way
        (DP attention reduce-scatters) and then call ``add_bias``."""
        return self._matmul(x, None, silu_mul_input)

    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced if self.bias is None else reduced + self.bias
