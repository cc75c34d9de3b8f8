"""The mixture-of-experts MLP: a router, the routed experts (``FusedMoE``) and an optional shared
expert, shaped for tensor and expert parallelism.

Parallel layout over the MLP group (``tp``, all ranks; under DP attention the tokens of every rank
meet here, gathered by ``plait.distributed.dp_mlp``): with ``ep_size`` E_p, the group's ``tp.size``
ranks form E_p expert groups of ``moe_tp = tp.size / E_p`` ranks. Rank ``r`` holds the experts
``[ep_rank * E / E_p, (ep_rank + 1) * E / E_p)`` (ep_rank = r // moe_tp), each sliced along its
intermediate dimension into shard ``r % moe_tp``. Every rank sees every token of the step (the
attention output is replicated under TP, all-gathered under DP attention), computes the
contributions of the experts it holds, and the partial sums of all ranks are combined by one
reduction: the all-reduce of ``forward`` or DP attention's reduce-scatter. Token ids routed to an
expert another rank holds map to an out-of-range local id and contribute nothing here.

The per-expert down-projection bias (gpt-oss) is added by one rank per expert group only, since
the combination sums the ranks' results.

With ``all_to_all`` (``--moe-a2a-backend``, whole experts per rank: ep_size == tp.size) each rank
routes only its own tokens and dispatches each (token, expert) pair to the rank holding the expert
(plait.layers.moe.all_to_all). A shared expert is then replicated on every rank (each computes it
for its own tokens, as SGLang does under DeepEP); on the gather path, which the steps CUDA graphs
are captured for keep, rank 0 alone adds it to its partial sums, so the reduction counts it once.
"""

from __future__ import annotations

import torch
from torch import nn

from plait import envs
from plait.distributed.parallel_state import SINGLE, TPGroup
from plait.forward_batch import DPPaddingMode, ForwardBatch, ShardedMLP
from plait.layers.moe.all_to_all import dispatch_combine, split_rows
from plait.layers.moe.reference import ACTIVATIONS, fused_experts_reference
from plait.layers.moe.router import RouterConfig, select_experts
from plait.layers.moe.routing_stats import RoutedExpertCounter
from plait.layers.quantization.gemv import dense_linear


def fused_experts(hidden_states: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                  topk_ids: torch.Tensor, activation: str = "silu", b13: torch.Tensor | None = None,
                  b2: torch.Tensor | None = None, fused: bool | None = None,
                  w13_scale: torch.Tensor | None = None, w2_scale: torch.Tensor | None = None) -> torch.Tensor:
    """The routed experts' weighted sum (plait.layers.moe.reference for the semantics): the fused
    Triton kernels (``fused``, by default on CUDA), else the reference loop. ``w13_scale`` /
    ``w2_scale``: block-FP8 experts (plait.layers.moe.fp8)."""
    if hidden_states.device.type == "cuda" if fused is None else fused:
        try:
            from plait.layers.moe.fused_moe_triton import fused_experts_triton
        except ModuleNotFoundError as e:  # the kernel module is not in this tree
            if e.name != "plait.layers.moe.fused_moe_triton":
                raise
        else:
            return fused_experts_triton(hidden_states, w13, w2, topk_weights, topk_ids, activation, b13, b2,
                                        w13_scale=w13_scale, w2_scale=w2_scale)
    return fused_experts_reference(hidden_states, w13, w2, topk_weights, topk_ids, activation, b13, b2,
                                   w13_scale, w2_scale)


def all_to_all_step(fb: ForwardBatch, on_cuda: bool, capturing: bool) -> bool:
    """``SparseMoeBlock.dispatches_all_to_all``'s rule for a layer configured for all-to-all."""
    if not on_cuda:
        return True
    if capturing:
        return False
    if fb.mlp_sync.padding_mode is not None:
        return fb.mlp_sync.padding_mode == DPPaddingMode.SUM_LEN
    return not fb.forward_mode.is_cuda_graph()


def _divide(n: int, d: int, what: str, fix: str) -> int:
    if n % d:
        raise ValueError(f"{what} ({n}) is not divisible by {d}; {fix}")
    return n // d


class FusedMoE(nn.Module):
    """This rank's experts: ``w13_weight`` [E_local, 2*I_shard, H] (gate rows, then up rows),
    ``w2_weight`` [E_local, H, I_shard], with ``bias``: ``w13_bias`` [E_local, 2*I_shard] and
    ``w2_bias`` [E_local, H]. Block-FP8 experts (plait.layers.moe.fp8, set up by its
    ``Fp8MoEMethod``) hold float8_e4m3fn weights and ``w13_weight_scale_inv`` / ``w2_weight_scale_inv``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, tp: TPGroup = SINGLE,
                 ep_size: int = 1, activation: str = "silu", bias: bool = False,
                 dtype: torch.dtype | None = None, fused_kernels: bool | None = None) -> None:
        """``fused_kernels``: route and compute with the Triton kernels (True), the torch router and
        the reference loop (False), or by the device of each call (None: Triton on CUDA)."""
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"MoE activation must be one of {ACTIVATIONS}, got {activation!r}")
        self.num_experts = num_experts
        self.activation = activation
        self.fused_kernels = fused_kernels
        self.moe_tp_size = _divide(tp.size, ep_size, "tensor parallel size", "choose ep_size dividing tp_size")
        self.moe_tp_rank = tp.rank % self.moe_tp_size
        self.ep_size = ep_size
        self.ep_rank = tp.rank // self.moe_tp_size
        self.num_local_experts = _divide(num_experts, ep_size, "number of experts",
                                         "choose an ep_size that divides the model's number of experts")
        self.first_expert = self.ep_rank * self.num_local_experts
        self.intermediate_per_rank = _divide(intermediate_size, self.moe_tp_size, "expert intermediate size",
                                             "choose a tp_size / ep_size that divides it")
        e, i, h = self.num_local_experts, self.intermediate_per_rank, hidden_size
        self.w13_weight = nn.Parameter(torch.empty(e, 2 * i, h, dtype=dtype), requires_grad=False)
        self.w2_weight = nn.Parameter(torch.empty(e, h, i, dtype=dtype), requires_grad=False)
        self.w13_bias = nn.Parameter(torch.empty(e, 2 * i, dtype=dtype), requires_grad=False) if bias else None
        self.w2_bias = nn.Parameter(torch.empty(e, h, dtype=dtype), requires_grad=False) if bias else None
        # Block scales of FP8 experts (None: the weights are in the model dtype) and their owner.
        self.w13_weight_scale_inv: nn.Parameter | None
        self.w2_weight_scale_inv: nn.Parameter | None
        self.register_parameter("w13_weight_scale_inv", None)
        self.register_parameter("w2_weight_scale_inv", None)
        self.quant_method: object | None = None
        # Global expert id -> local id; experts of other ranks map to num_local_experts (contribute nothing).
        local = torch.full((num_experts,), e, dtype=torch.int32)
        local[self.first_expert : self.first_expert + e] = torch.arange(e, dtype=torch.int32)
        self.register_buffer("expert_map", local, persistent=False)

    def local_expert(self, expert_id: int) -> int | None:
        """This rank's index of global expert ``expert_id``, or None when another rank holds it."""
        if not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} is outside [0, {self.num_experts})")
        local = expert_id - self.first_expert
        return local if 0 <= local < self.num_local_experts else None

    def load_expert_weight(self, expert_id: int, which: str, loaded: torch.Tensor) -> None:
        """One expert's projection in nn.Linear layout: gate/up ``[I, H]``, down ``[H, I]``
        (a tensor or a lazily read checkpoint slice: only this rank's shard is read)."""
        local = self.local_expert(expert_id)
        if local is None:
            return
        i = self.intermediate_per_rank
        start = self.moe_tp_rank * i
        if which in ("gate", "up"):
            offset = 0 if which == "gate" else i
            self.w13_weight.data[local, offset : offset + i].copy_(loaded.narrow(0, start, i))
        elif which == "down":
            self.w2_weight.data[local].copy_(loaded.narrow(1, start, i))
        else:
            raise ValueError(f"expert projection must be 'gate', 'up' or 'down', got {which!r}")

    def load_expert_bias(self, expert_id: int, which: str, loaded: torch.Tensor) -> None:
        """One expert's bias: gate/up ``[I]``, down ``[H]``."""
        local = self.local_expert(expert_id)
        if local is None:
            return
        if self.w13_bias is None or self.w2_bias is None:
            raise ValueError("checkpoint has expert biases but the layer was built without them")
        i = self.intermediate_per_rank
        if which in ("gate", "up"):
            offset = 0 if which == "gate" else i
            self.w13_bias.data[local, offset : offset + i].copy_(loaded.narrow(0, self.moe_tp_rank * i, i))
        elif which == "down":
            self.w2_bias.data[local].copy_(loaded)
        else:
            raise ValueError(f"expert bias must be 'gate', 'up' or 'down', got {which!r}")

    def forward(self, hidden_states: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial sum [T, H] over the experts it holds (global ``topk_ids``)."""
        local_ids = self.expert_map[topk_ids.long()] if self.ep_size > 1 else topk_ids
        b2 = self.w2_bias if self.moe_tp_rank == 0 else None
        return fused_experts(hidden_states, self.w13_weight, self.w2_weight, topk_weights, local_ids,
                             self.activation, self.w13_bias, b2, self.fused_kernels,
                             self.w13_weight_scale_inv, self.w2_weight_scale_inv)

    def forward_received(self, rows: torch.Tensor, weights: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """The all-to-all dispatch's pairs: ``rows`` [N, H], each for one of this rank's experts
        (``local_ids`` [N, 1] int32) with its routing weight (``weights`` [N, 1] float32) -> the
        weighted outputs [N, H]. Whole experts only (moe_tp_size 1), so the down bias is added here."""
        return fused_experts(rows, self.w13_weight, self.w2_weight, weights, local_ids, self.activation,
                             self.w13_bias, self.w2_bias, self.fused_kernels,
                             self.w13_weight_scale_inv, self.w2_weight_scale_inv)


class Router(nn.Module):
    """The replicated router projection ``[E, H]`` (gpt-oss adds a bias). Logits come back in x's
    dtype either way (``select_experts`` upcasts them to fp32 itself)."""

    def __init__(self, num_experts: int, hidden_size: int, bias: bool = False,
                 dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(num_experts, dtype=dtype), requires_grad=False) if bias else None
        # Decode batches on CUDA through the small-M GEMV, as the dense linear layers: one launch where
        # cuBLAS picks a split-K GEMM plus its reduce for this thin [E, H] matrix (``PLAIT_BF16_GEMV``).
        self.small_m_gemv = envs.BF16_GEMV.get()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return dense_linear(x, self.weight, self.bias, self.small_m_gemv)


class SparseMoeBlock(nn.Module):
    """Router + routed experts (+ a shared expert scaled by ``sigmoid(shared_expert_gate(x))``, as
    Qwen2-MoE has). Satisfies ``ShardedMLP``, so DP attention's row exchange drives it like a dense MLP."""

    def __init__(self, router: RouterConfig, experts: FusedMoE, hidden_size: int, tp: TPGroup = SINGLE,
                 router_bias: bool = False, shared_expert: ShardedMLP | None = None,
                 all_to_all: bool = False) -> None:
        """``all_to_all``: dispatch by all-to-all where it can run (see ``dispatches_all_to_all``);
        needs whole experts per rank, and ``shared_expert`` then replicated (built over one rank)."""
        super().__init__()
        if all_to_all and (experts.moe_tp_size != 1 or tp.size < 2):
            raise ValueError(f"the all-to-all MoE dispatch needs whole experts on every rank: ep_size equal to "
                             f"tp_size > 1 (got ep_size {experts.ep_size}, tp_size {tp.size})")
        self.tp = tp
        self.all_to_all = all_to_all
        self.router_config = router
        self.gate = Router(router.num_experts, hidden_size, router_bias)
        self.experts = experts
        self.shared_expert = shared_expert
        # Qwen2-MoE's scalar gate of the shared expert, replicated.
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False) if shared_expert is not None else None)
        if self.shared_expert_gate is not None:
            self.shared_expert_gate.weight.requires_grad_(False)
        # Benchmarks only (plait.layers.moe.routing_stats): None keeps the hot path free of counting.
        self.routing_counter: RoutedExpertCounter | None = None

    def forward_partial(self, x: torch.Tensor) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(self.gate(x), self.router_config, self.experts.fused_kernels)
        if self.routing_counter is not None:
            self.routing_counter.record(topk_ids)
        out = self.experts(x, topk_weights, topk_ids)
        # A replicated shared expert (all-to-all layout) joins one rank's partial sums only.
        if not self.all_to_all or self.tp.rank == 0:
            out = self._add_shared(x, out)
        return out

    def _add_shared(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        if self.shared_expert is None:
            return out
        assert self.shared_expert_gate is not None
        # The sigmoid scales each token's row, so it commutes with summing the ranks' partials.
        return out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert.forward_partial(x)

    def dispatches_all_to_all(self, x: torch.Tensor, fb: ForwardBatch) -> bool:
        """Whether the step ``fb`` takes the all-to-all path (its split sizes are host ints of each
        step, so no CUDA graph can hold it). On CUDA, steps of the kinds graphs are captured for keep
        the gather path whether they replay or not, so a graph's warm-up runs and its capture take
        one path (kernels compile and lazy state initialises before the capture): under DP attention
        the MAX_LEN steps (captures and replays are MAX_LEN), under plain TP the decode and verify
        steps. The rule reads the step's global layout, so every rank decides alike. Off CUDA
        (no graphs) every step dispatches."""
        if not self.all_to_all:
            return False
        return all_to_all_step(fb, x.is_cuda, x.is_cuda and torch.cuda.is_current_stream_capturing())

    def forward_own_tokens(self, x: torch.Tensor) -> torch.Tensor:
        """The MLP output [n, H] of this rank's own tokens ``x`` [n, H] (DP attention: its requests'
        rows; n = 0 on an IDLE rank), the routed experts reached by all-to-all. Every rank calls it
        together."""
        topk_weights, topk_ids = select_experts(self.gate(x), self.router_config, self.experts.fused_kernels)
        if self.routing_counter is not None:
            self.routing_counter.record(topk_ids)
        out = dispatch_combine(x, topk_weights, topk_ids, self.tp, self.experts.num_local_experts,
                               self.experts.forward_received)
        return self._add_shared(x, out)

    def forward_scattered(self, x: torch.Tensor) -> torch.Tensor:
        """Plain tensor parallelism with all-to-all: ``x`` [T, H] is replicated; each rank takes its
        slice of rows (``split_rows``), runs ``forward_own_tokens`` on it and the slices' outputs are
        all-gathered back, so every rank ends with the whole [T, H]."""
        rows = split_rows(x.shape[0], self.tp.size)
        start = sum(rows[: self.tp.rank])
        own = self.forward_own_tokens(x[start : start + rows[self.tp.rank]])
        return self.tp.all_gather_rows(own, rows)

    def add_bias(self, reduced: torch.Tensor) -> torch.Tensor:
        return reduced  # expert biases are inside the partial sums (one rank per expert group)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The gather path under tensor parallelism (the decoder layer picks ``forward_scattered``
        for the steps that dispatch by all-to-all)."""
        return self.tp.all_reduce(self.forward_partial(x))
