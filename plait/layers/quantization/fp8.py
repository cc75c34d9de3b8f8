"""FP8 weights: the format a checkpoint declares, and the linear method that stores and multiplies them.

Schemes (``Fp8Config.weight_scheme``), all ``W = q * s`` with ``q`` float8_e4m3fn ``[N, K]``:
  channel  ``weight_scale [N, 1]`` (compressed-tensors FP8_DYNAMIC; and what online quantization of a
           bf16/fp16 checkpoint produces), activations quantized per token at run time
  block    ``[ceil(N/128), ceil(K/128)]`` scales (``weight_scale_inv`` in ``quant_method: fp8``
           releases such as Qwen3/DeepSeek, ``weight_scale`` in compressed-tensors FP8_BLOCK),
           activations quantized per token per 128-column group at run time
  tensor   one ``weight_scale`` per checkpoint tensor, with a static per-tensor ``input_scale``
           (compressed-tensors FP8) or dynamic per-token activations

After loading, every layer holds one of two layouts: ``channel`` (``weight_scale [N]``) or ``block``.
A fused layer (qkv_proj, gate_up_proj) of the tensor scheme keeps each shard's scale by writing it
into the rows of that shard (per-tensor becomes per-channel, exactly); its shards' ``input_scale``
become their largest (the activations are one tensor, quantized once).
"""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import nn

from plait.layers.linear import ColumnParallelLinear, RowParallelLinear
from plait.layers.quantization.fp8_kernels import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_SCALE,
    fp8_linear,
    quantize_static,
    quantize_weight_per_channel,
)

FP8_CHECKPOINT_METHODS = ("fp8", "compressed-tensors")


@dataclass(frozen=True)
class Fp8Config:
    """How a model's linear layers are stored in FP8. ``serialized``: the checkpoint holds FP8 tensors
    (else bf16/fp16 weights are quantized at load). ``ignored``: checkpoint module names (or ``re:``
    patterns) that stay unquantized; the LM head always does."""

    weight_scheme: str  # "channel" | "block" | "tensor"
    activation_scheme: str  # "dynamic" | "static"
    serialized: bool
    block_size: tuple[int, int] | None = None
    scale_name: str = "weight_scale"  # "weight_scale_inv" for quant_method fp8 block checkpoints
    ignored: tuple[str, ...] = ()
    source: str = "online"  # what declared it: "online", "fp8", "compressed-tensors"

    def __post_init__(self) -> None:
        if self.weight_scheme not in ("channel", "block", "tensor"):
            raise ValueError(f"FP8 weight scheme {self.weight_scheme!r} is not channel, block or tensor")
        if (self.weight_scheme == "block") != (self.block_size is not None):
            raise ValueError("FP8 block scales need weight_block_size (and only they do)")
        if self.activation_scheme == "static" and self.weight_scheme != "tensor":
            raise ValueError(f"static FP8 activation scales with {self.weight_scheme} weight scales are not "
                             "supported (plait reads static input_scale with per-tensor weight scales)")

    def is_ignored(self, checkpoint_prefix: str) -> bool:
        for pattern in self.ignored:
            if pattern.startswith("re:"):
                if re.match(pattern[3:], checkpoint_prefix):
                    return True
            elif checkpoint_prefix == pattern or checkpoint_prefix.endswith("." + pattern):
                return True
        return False


ONLINE = Fp8Config(weight_scheme="channel", activation_scheme="dynamic", serialized=False)


def _unsupported(what: str) -> ValueError:
    return ValueError(f"quantized checkpoint format {what} is not supported; plait runs FP8 checkpoints "
                      "(quant_method 'fp8' with weight_block_size [128, 128] or per-tensor scales; "
                      "compressed-tensors FP8, FP8_DYNAMIC and FP8_BLOCK), or quantizes bf16/fp16 "
                      "checkpoints at load with --quantization fp8")


def _block_size(raw: Any, what: str) -> tuple[int, int]:
    block = tuple(int(b) for b in raw)
    if len(block) != 2 or min(block) < 1:
        raise _unsupported(f"{what} with block size {list(raw)}")
    return block  # type: ignore[return-value]


def _from_fp8_method(q: dict[str, Any]) -> Fp8Config:
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _unsupported(f"'fp8' with fmt {fmt!r} (plait reads float8_e4m3fn)")
    act = q.get("activation_scheme", "dynamic")
    ignored = tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ())
    if q.get("weight_block_size"):
        if act != "dynamic":
            raise _unsupported(f"'fp8' block-quantized with activation_scheme {act!r}")
        return Fp8Config("block", "dynamic", True, _block_size(q["weight_block_size"], "'fp8'"),
                         scale_name="weight_scale_inv", ignored=ignored, source="fp8")
    return Fp8Config("tensor", act, True, ignored=ignored, source="fp8")


def _from_compressed_tensors(q: dict[str, Any]) -> Fp8Config:
    fmt = q.get("format", "")
    groups = q.get("config_groups") or {}
    linear = [g for g in groups.values() if any("Linear" in t for t in g.get("targets", []))]
    if fmt not in ("float-quantized", "naive-quantized") or len(linear) != 1:
        raise _unsupported(f"compressed-tensors (format {fmt!r}, {len(linear)} Linear config groups)")
    g = linear[0]
    w, a = g.get("weights") or {}, g.get("input_activations") or {}
    if w.get("type") != "float" or int(w.get("num_bits", 0)) != 8:
        raise _unsupported(f"compressed-tensors weights {w.get('type')} {w.get('num_bits')}-bit")
    if a and (a.get("type") != "float" or int(a.get("num_bits", 0)) != 8):
        raise _unsupported(f"compressed-tensors activations {a.get('type')} {a.get('num_bits')}-bit")
    if not a:
        raise _unsupported("compressed-tensors FP8 weight-only (no input_activations)")
    strategy = w.get("strategy", "tensor")
    dynamic = bool(a.get("dynamic", False))
    ignored = tuple(q.get("ignore") or ())
    if strategy == "tensor":
        return Fp8Config("tensor", "dynamic" if dynamic else "static", True, ignored=ignored,
                         source="compressed-tensors")
    if strategy == "channel" and dynamic:
        return Fp8Config("channel", "dynamic", True, ignored=ignored, source="compressed-tensors")
    if strategy == "block" and dynamic:
        block = _block_size(w.get("block_structure") or [128, 128], "compressed-tensors FP8_BLOCK")
        return Fp8Config("block", "dynamic", True, block, ignored=ignored, source="compressed-tensors")
    raise _unsupported(f"compressed-tensors FP8 with weight strategy {strategy!r} and "
                       f"{'dynamic' if dynamic else 'static'} activations")


def resolve_fp8_config(quant: dict[str, Any] | None, requested: str | None) -> Fp8Config | None:
    """The FP8 scheme of a model: from the checkpoint's ``quantization_config`` (any format plait does
    not implement raises, naming it), else online when ``requested == "fp8"``, else None."""
    if quant:
        method = str(quant.get("quant_method", "unknown"))
        if method == "fp8":
            return _from_fp8_method(quant)
        if method == "compressed-tensors":
            return _from_compressed_tensors(quant)
        raise _unsupported(repr(method))
    return ONLINE if requested == "fp8" else None


# --- the linear method -----------------------------------------------------------------------------
Linear = ColumnParallelLinear | RowParallelLinear


class Fp8LinearMethod:
    """Owns one linear layer's FP8 storage: ``create_weights`` (before loading: FP8 parameters and
    their scales under the checkpoint's names, each with its own ``weight_loader``),
    ``process_weights_after_loading`` (online quantization, or the loaded scales into the run-time
    layout) and ``apply`` (plait.layers.quantization.fp8_kernels.fp8_linear)."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.block: tuple[int, int] | None = config.block_size

    # --- before loading ------------------------------------------------------------------------
    def create_weights(self, layer: Linear) -> None:
        cfg = self.config
        layer.quant_method = self
        if not cfg.serialized:
            return  # bf16/fp16 weights load as usual and are quantized afterwards
        n, k = layer.weight.shape
        device = layer.weight.device
        layer.weight = nn.Parameter(torch.empty(n, k, dtype=FP8_DTYPE, device=device), requires_grad=False)
        f32 = dict(dtype=torch.float32, device=device)
        shards = _shard_ids(layer)
        if cfg.weight_scheme == "block":
            assert self.block is not None
            bn, bk = self.block
            scale = torch.empty(-(-n // bn), -(-k // bk), **f32)
            kind = "block"
        elif cfg.weight_scheme == "channel":
            scale, kind = torch.empty(n, 1, **f32), "channel"
        else:
            scale, kind = torch.ones(len(shards), **f32), "tensor"
        self._register(layer, cfg.scale_name, scale, kind)
        if cfg.activation_scheme == "static":
            self._register(layer, "input_scale", torch.ones(len(shards), **f32), "tensor")

    def _register(self, layer: Linear, name: str, value: torch.Tensor, kind: str) -> None:
        param = nn.Parameter(value, requires_grad=False)
        param.weight_loader = functools.partial(self._load_scale, layer, kind)  # type: ignore[attr-defined]
        layer.register_parameter(name, param)

    def _load_scale(self, layer: Linear, kind: str, param: nn.Parameter, loaded: torch.Tensor,
                    shard_id: str | int | None = None) -> None:
        if not isinstance(loaded, torch.Tensor):  # a tensor-parallel LazySlice: scales are small, read whole
            loaded = loaded.materialize()
        loaded = loaded.to(torch.float32)
        if kind == "tensor":
            param.data[_shard_ids(layer).index(shard_id)] = loaded.reshape(-1)[0]
            return
        if isinstance(layer, RowParallelLinear):
            if kind == "channel":  # [N, 1]: output rows are not split
                param.data.copy_(loaded.view(param.shape))
                return
            assert self.block is not None
            k_per_rank = layer.in_features_per_rank
            bk = self.block[1]
            if layer.tp.size > 1 and k_per_rank % bk:
                raise ValueError(f"block-quantized row-parallel layer: {k_per_rank} input features per rank "
                                 f"are not a multiple of the {bk}-column scale block")
            cols = param.shape[1]
            param.data.copy_(loaded.narrow(1, layer.tp.rank * (k_per_rank // bk), cols))
            return
        offset, size, rank = layer.shard_rows(shard_id)
        if kind == "channel":
            param.data.narrow(0, offset, size).copy_(loaded.narrow(0, rank * size, size))
            return
        assert self.block is not None
        bn = self.block[0]
        fused = len(_shard_ids(layer)) > 1
        if (fused or layer.tp.size > 1) and (offset % bn or size % bn):
            raise ValueError(f"block-quantized {type(layer).__name__}: shard {shard_id!r} (rows {offset}.."
                             f"{offset + size}) is not aligned to the {bn}-row scale block")
        blocks = -(-size // bn)
        param.data.narrow(0, offset // bn, blocks).copy_(loaded.narrow(0, rank * size // bn, blocks))

    # --- after loading -------------------------------------------------------------------------
    def process_weights_after_loading(self, layer: Linear) -> None:
        cfg = self.config
        if not cfg.serialized:
            w = layer.weight.data
            if isinstance(layer, RowParallelLinear) and layer.tp.size > 1:
                # A rank holds some input columns of each output row: the row's scale is its absmax
                # over all ranks' columns, so tp > 1 stores the weights one rank would.
                amax = layer.tp.all_reduce(w.abs().amax(dim=1).float(), op=dist.ReduceOp.MAX)
                scale = (amax / FP8_MAX).clamp(min=MIN_SCALE)
                q = quantize_static(w, scale[:, None])
            else:
                q, scale = quantize_weight_per_channel(w)
            self._set_runtime(layer, q, scale, None)
            return
        raw = getattr(layer, cfg.scale_name)
        input_scale = getattr(layer, "input_scale", None)
        if cfg.weight_scheme == "block":
            scale = raw.data.contiguous()
        elif cfg.weight_scheme == "channel":
            scale = raw.data.view(-1)
        else:  # each shard's scale over its rows: per-tensor becomes per-channel, exactly
            scale = torch.empty(layer.weight.shape[0], dtype=torch.float32, device=raw.device)
            for i, sid in enumerate(_shard_ids(layer)):
                offset, size = _rows_of(layer, sid)
                scale[offset : offset + size] = raw.data[i]
        if cfg.scale_name != "weight_scale":
            delattr(layer, cfg.scale_name)
        static = input_scale.data.max().reshape(()) if input_scale is not None else None
        self._set_runtime(layer, layer.weight.data, scale, static)

    def _set_runtime(self, layer: Linear, q: torch.Tensor, scale: torch.Tensor, input_scale: torch.Tensor | None
                     ) -> None:
        """The run-time state ``apply`` reads: ``weight`` FP8 ``[N, K]``, ``weight_scale`` (channel
        ``[N]`` or block), ``input_scale`` (a 0-d tensor, or None for dynamic activations)."""
        layer.weight = nn.Parameter(q.contiguous(), requires_grad=False)
        if "weight_scale" in layer._parameters:
            del layer._parameters["weight_scale"]
        layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
        if "input_scale" in layer._parameters:
            del layer._parameters["input_scale"]
        layer.input_scale = None if input_scale is None else nn.Parameter(input_scale.float(), requires_grad=False)

    # --- forward ---------------------------------------------------------------------------------
    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return fp8_linear(x, layer.weight, layer.weight_scale, self.block, layer.input_scale, bias)


def _shard_ids(layer: Linear) -> list[str | int | None]:
    return layer.shard_ids() if isinstance(layer, ColumnParallelLinear) else [None]


def _rows_of(layer: Linear, shard_id: str | int | None) -> tuple[int, int]:
    if isinstance(layer, ColumnParallelLinear):
        offset, size, _ = layer.shard_rows(shard_id)
        return offset, size
    return 0, layer.weight.shape[0]


def checkpoint_prefixes(module_name: str, packed: dict[str, tuple[str, str | int]]) -> list[str]:
    """The checkpoint module names a plait module was loaded from (its fused shards' names)."""
    leaf = module_name.rsplit(".", 1)[-1]
    parts = [ckpt for ckpt, (fused, _) in packed.items() if fused == leaf]
    if not parts:
        return [module_name]
    return [module_name[: -len(leaf)] + p for p in parts]


def quantize_linear_layers(model: nn.Module, config: Fp8Config,
                           packed: dict[str, tuple[str, str | int]]) -> list[Linear]:
    """Give every linear layer of ``model`` (not the LM head, not the ignored ones) an
    ``Fp8LinearMethod`` and its FP8 parameters; returns the layers, for the after-loading step."""
    layers: list[Linear] = []
    for name, module in model.named_modules():
        if not isinstance(module, ColumnParallelLinear | RowParallelLinear):
            continue
        ignored = [config.is_ignored(p) for p in checkpoint_prefixes(name, packed)]
        if all(ignored):
            continue
        if any(ignored):
            raise ValueError(f"{name}: the checkpoint quantizes some of its fused shards and not others")
        Fp8LinearMethod(config).create_weights(module)
        layers.append(module)
    return layers


class QuantizedLayer(Protocol):
    """A layer whose quantization method finishes it after loading (``Fp8LinearMethod`` for linear
    layers, ``plait.layers.moe.fp8.Fp8MoEMethod`` for experts)."""

    quant_method: Any


def finish_quantization(layers: Sequence[QuantizedLayer]) -> None:
    for layer in layers:
        layer.quant_method.process_weights_after_loading(layer)

