"""Block-FP8 experts: how a ``FusedMoE`` layer stores float8_e4m3fn expert weights and loads them.

Run-time layout (every source ends in it, one code path at run time), ``W = q * s`` per 128 x 128
block (``reference.EXPERT_FP8_BLOCK``):
  ``w13_weight`` float8_e4m3fn [E, 2I, H]  ``w13_weight_scale_inv`` fp32 [E, ceil(2I/128), ceil(H/128)]
  ``w2_weight``  float8_e4m3fn [E, H, I]   ``w2_weight_scale_inv``  fp32 [E, ceil(H/128), ceil(I/128)]
(I the intermediate size per rank; the scales are multipliers, named as the published checkpoints
name them.)

Sources:
  serialized  a ``quant_method: fp8`` checkpoint with ``weight_block_size [128, 128]`` (the
              Qwen3-30B-A3B-FP8 layout): each expert's ``gate_proj/up_proj/down_proj.weight`` FP8
              and ``.weight_scale_inv`` [ceil(N/128), ceil(K/128)]. gate and up are stacked in w13,
              so each must start on the 128-row grid of its scales: I per rank a multiple of 128
              (under tensor parallelism also what makes each rank's slice start on the grid).
  online      ``--quantization fp8`` on a bf16/fp16 checkpoint: the experts load as stored and are
              quantized per 128 x 128 block of the stored (per-rank) w13 / w2 after loading.

Expert parallelism places whole experts, their scales with them (``FusedMoE.local_expert``).
"""

from __future__ import annotations

import torch
from torch import nn

from plait.layers.moe.layer import FusedMoE
from plait.layers.moe.reference import EXPERT_FP8_BLOCK
from plait.layers.quantization.fp8 import Fp8Config
from plait.layers.quantization.fp8_kernels import FP8_DTYPE, FP8_MAX, MIN_SCALE

_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def block_scale_shape(rows: int, cols: int) -> tuple[int, int]:
    b = EXPERT_FP8_BLOCK
    return -(-rows // b), -(-cols // b)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One matrix ``w`` [N, K] -> float8_e4m3fn ``q`` [N, K] and multipliers ``s`` [ceil(N/128),
    ceil(K/128)] with ``w ~= q * s`` per block (a block's absmax maps to the e4m3 maximum)."""
    b = EXPERT_FP8_BLOCK
    n, k = w.shape
    nb, kb = block_scale_shape(n, k)
    padded = torch.nn.functional.pad(w.float(), (0, kb * b - k, 0, nb * b - n)).view(nb, b, kb, b)
    scale = (padded.abs().amax(dim=(1, 3)) / FP8_MAX).clamp(min=MIN_SCALE)
    q = (padded / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(nb * b, kb * b)[:n, :k].contiguous(), scale


def quantize_expert_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] experts -> FP8 [E, N, K] and scales [E, ceil(N/128), ceil(K/128)], one expert at a
    time (the fp32 temporaries stay one expert large)."""
    q = torch.empty(w.shape, dtype=FP8_DTYPE, device=w.device)
    scale = torch.empty(w.shape[0], *block_scale_shape(*w.shape[1:]), dtype=torch.float32, device=w.device)
    for e in range(w.shape[0]):
        q[e], scale[e] = quantize_blocks(w[e])
    return q, scale


class Fp8MoEMethod:
    """Owns one ``FusedMoE`` layer's FP8 storage: ``create_weights`` (before loading: FP8 experts
    and their scales, for a serialized checkpoint), ``load_expert_scale`` (a checkpoint scale into
    its expert's rows), ``process_weights_after_loading`` (online: quantize the loaded experts)."""

    def __init__(self, config: Fp8Config, name: str) -> None:
        self.config = config
        self.name = name

    def create_weights(self, layer: FusedMoE) -> None:
        cfg = self.config
        if cfg.serialized and cfg.weight_scheme != "block":
            raise ValueError(f"{self.name}: FP8 experts are supported in the block layout (weight_block_size "
                             f"[128, 128]); this checkpoint's experts have {cfg.weight_scheme} scales")
        if cfg.serialized and cfg.block_size != (EXPERT_FP8_BLOCK, EXPERT_FP8_BLOCK):
            raise ValueError(f"{self.name}: FP8 experts need weight_block_size [128, 128], got "
                             f"{list(cfg.block_size or ())} (the fused MoE kernels read 128 x 128 scale blocks)")
        layer.quant_method = self
        if not cfg.serialized:
            return  # the experts load as stored; process_weights_after_loading quantizes them
        e, two_i, h = layer.w13_weight.shape
        i = two_i // 2
        if i % EXPERT_FP8_BLOCK:
            raise ValueError(
                f"{self.name}: the gate_proj and up_proj shards of each expert hold {i} rows on this rank "
                f"(expert intermediate {i * layer.moe_tp_size} / {layer.moe_tp_size} ranks), not a multiple of "
                f"the {EXPERT_FP8_BLOCK}-row scale block, so their block scales cannot be stacked"
                + (" or sliced; choose a tp_size / ep_size that keeps each rank's slice on the 128 grid"
                   if layer.moe_tp_size > 1 else ""))
        device = layer.w13_weight.device
        layer.w13_weight = nn.Parameter(torch.empty(e, two_i, h, dtype=FP8_DTYPE, device=device), requires_grad=False)
        layer.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=FP8_DTYPE, device=device), requires_grad=False)
        f32 = dict(dtype=torch.float32, device=device)
        layer.w13_weight_scale_inv = nn.Parameter(torch.empty(e, *block_scale_shape(two_i, h), **f32),
                                                  requires_grad=False)
        layer.w2_weight_scale_inv = nn.Parameter(torch.empty(e, *block_scale_shape(h, i), **f32),
                                                 requires_grad=False)

    def load_expert_scale(self, layer: FusedMoE, expert_id: int, which: str, loaded: torch.Tensor,
                          tensor_name: str) -> None:
        """One expert's checkpoint ``weight_scale_inv``: gate/up [ceil(I/128), ceil(H/128)], down
        [ceil(H/128), ceil(I/128)] (I the full intermediate size): this rank's block rows / columns."""
        if layer.w13_weight_scale_inv is None or layer.w2_weight_scale_inv is None:
            raise ValueError(f"checkpoint tensor {tensor_name!r} is an FP8 scale, but {self.name} is not "
                             "block-FP8 (the checkpoint's quantization_config does not declare it)")
        local = layer.local_expert(expert_id)
        if local is None:
            return
        if not isinstance(loaded, torch.Tensor):  # a tensor-parallel LazySlice: scales are small, read whole
            loaded = loaded.materialize()
        i = layer.intermediate_per_rank
        h = layer.w2_weight.shape[1]
        blocks = i // EXPERT_FP8_BLOCK  # create_weights checked that i is on the grid
        start = layer.moe_tp_rank * blocks
        full_i = i * layer.moe_tp_size
        if which in ("gate", "up"):
            want = block_scale_shape(full_i, h)
            self._check(tensor_name, loaded, want)
            offset = 0 if which == "gate" else blocks
            layer.w13_weight_scale_inv.data[local, offset : offset + blocks].copy_(loaded.narrow(0, start, blocks))
        elif which == "down":
            want = block_scale_shape(h, full_i)
            self._check(tensor_name, loaded, want)
            layer.w2_weight_scale_inv.data[local].copy_(loaded.narrow(1, start, blocks))
        else:
            raise ValueError(f"expert projection must be 'gate', 'up' or 'down', got {which!r}")

    @staticmethod
    def _check(tensor_name: str, loaded: torch.Tensor, want: tuple[int, int]) -> None:
        if tuple(loaded.shape) != want:
            raise ValueError(f"checkpoint tensor {tensor_name!r} has shape {tuple(loaded.shape)}; 128 x 128 block "
                             f"scales of its weight are {want} (is the checkpoint's weight_block_size [128, 128]?)")

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        if self.config.serialized:
            return
        q13, s13 = quantize_expert_blocks(layer.w13_weight.data)
        q2, s2 = quantize_expert_blocks(layer.w2_weight.data)
        layer.w13_weight = nn.Parameter(q13, requires_grad=False)
        layer.w2_weight = nn.Parameter(q2, requires_grad=False)
        layer.w13_weight_scale_inv = nn.Parameter(s13, requires_grad=False)
        layer.w2_weight_scale_inv = nn.Parameter(s2, requires_grad=False)


def _is_ignored(config: Fp8Config, name: str, layer: FusedMoE) -> bool:
    """Whether the checkpoint keeps ``name``'s experts unquantized (``ignored_layers`` /
    ``modules_to_not_convert``): all of them or none (a mix raises)."""
    flags = {config.is_ignored(f"{name}.{e}.{p}") for e in range(layer.num_experts) for p in _PROJECTIONS}
    if len(flags) > 1:
        raise ValueError(f"{name}: the checkpoint quantizes some experts' projections and not others")
    return flags == {True}


def quantize_moe_layers(model: nn.Module, config: Fp8Config) -> list[FusedMoE]:
    """Give every ``FusedMoE`` of ``model`` not in the checkpoint's ignored list an ``Fp8MoEMethod``
    (and, serialized, its FP8 parameters); returns the layers, for ``fp8.finish_quantization``."""
    layers: list[FusedMoE] = []
    for name, module in model.named_modules():
        if isinstance(module, FusedMoE) and not _is_ignored(config, name, module):
            Fp8MoEMethod(config, name).create_weights(module)
            layers.append(module)
    return layers

