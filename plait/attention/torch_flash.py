"""torch_flash: attention over PyTorch's own fused kernels (SDPA's flash kernel, FlashAttention-2 varlen).

Extend (EXTEND, MIXED, DRAFT_EXTEND, TARGET_VERIFY) is planned into kernel calls by ``plan_extend``:
  packed  requests with no cached prefix and no custom mask, grouped by extend length: one batched
          ``scaled_dot_product_attention(is_causal=True, enable_gqa=True)`` per length. ``is_causal``
          aligns the mask top-left, which is right only when queries == keys, i.e. with no prefix.
  rest    everything else (a cached prefix, a speculative tree mask). Its K/V are gathered from the
          paged cache into one contiguous tensor (prefix, then the new tokens, per request), then
          either one ``varlen_attn`` call (causal is bottom-right aligned there, so a prefix is right)
          or one SDPA call per request with an explicit lower-right (tree, window) boolean mask.
Kernel path (``KERNEL_PATHS``; the backend's ``kernel_path`` argument, default ``DEFAULT_KERNEL_PATH``):
  "auto"    packed -> batched SDPA, rest -> varlen_attn when present; sliding-window layers -> varlen_attn
            for the whole batch. Batched SDPA takes packed requests because on Hopper it beats
            varlen_attn on equal-length causal batches; ``benchmarks/attention_backends_bench.py``
            compares the two.
  "sdpa"    SDPA only (packed batched, rest per request with a mask). The path that runs on the CPU.
  "varlen"  varlen_attn for every request without a custom mask.
Tree masks always take the masked SDPA path (varlen_attn has no arbitrary mask); layers with a tanh
logit cap run the torch_native math (SDPA has no soft cap).

Decode: one SDPA call over K/V gathered into a [bs, max_len] padding with a validity mask; the query
heads of one KV head are folded into the query length, so GQA needs no repeated K/V. The gather is
sized by the longest sequence on the host, so decode is not CUDA-graph safe:
``init_cuda_graph_state`` refuses with the fix (pair it with ``--decode-attention-backend triton``).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from plait import envs
from plait.attention.base import AttentionBackend, AttentionLayer, custom_mask_of
from plait.attention.torch_native import TorchNativeAttnBackend
from plait.forward_batch import ForwardBatch
from plait.mem.pools import MHATokenToKVPool, ReqToTokenPool

KERNEL_PATHS: tuple[str, ...] = ("auto", "sdpa", "varlen")
# The kernels the batched causal SDPA call may take on CUDA. Left to itself, torch picks cuDNN's attention
# on Hopper, which builds an execution plan for every new (batch, length) shape on first use (tens of ms,
# on the request path of each new prompt length, which a warm-up cannot enumerate); FlashAttention-2
# plans nothing. PLAIT_SDPA_CUDNN=1 puts cuDNN back in front, for A/B runs.
PACKED_SDPA_BACKENDS: tuple[SDPBackend, ...] = (
    ((SDPBackend.CUDNN_ATTENTION,) if envs.SDPA_CUDNN.get() else ()) + (SDPBackend.FLASH_ATTENTION,))
DEFAULT_KERNEL_PATH = "auto"
BACKENDS_THAT_RUN_ON_CPU = "torch_native, or triton under TRITON_INTERPRET=1 (tests only)"


# --- kernel detection ------------------------------------------------------------------------------


@dataclass(frozen=True)
class VarlenKernel:
    """``torch.nn.attention.varlen.varlen_attn`` as this torch spells it (its signature changed between
    releases: older ones take ``is_causal`` and no window or GQA, newer ones ``window_size``/``enable_gqa``)."""

    fn: Callable[..., torch.Tensor]
    has_window: bool
    has_gqa: bool
    has_scale: bool

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                 max_q: int, max_k: int, scale: float, window: int | None) -> torch.Tensor:
        if not self.has_gqa and k.shape[1] != q.shape[1]:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        kwargs: dict = {}
        if self.has_scale:
            kwargs["scale"] = scale
        else:  # the kernel's default is d**-0.5: fold the difference into q
            q = q * (scale * q.shape[-1] ** 0.5)
        if self.has_window:
            # Ours: query i sees keys j > i - W, i.e. W keys including itself -> FA's left = W - 1.
            kwargs["window_size"] = (window - 1 if window else -1, 0)
            if self.has_gqa:
                kwargs["enable_gqa"] = True
        else:
            assert window is None, "this varlen_attn has no window; windowed layers take the SDPA path"
            kwargs["is_causal"] = True
        return self.fn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


@functools.cache
def detect_varlen_kernel() -> VarlenKernel | None:
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    try:
        params = inspect.signature(varlen_attn).parameters
    except (TypeError, ValueError):
        return None
    if "window_size" not in params and "is_causal" not in params:
        return None  # a signature we do not know: do not guess how to ask for causal attention
    return VarlenKernel(varlen_attn, "window_size" in params, "enable_gqa" in params, "scale" in params)


@functools.cache
def sdpa_has_gqa() -> bool:
    """SDPA took ``enable_gqa`` in torch 2.5; a builtin has no signature, so ask it on a tiny input."""
    x = torch.zeros(1, 2, 1, 8)
    try:
        F.scaled_dot_product_attention(x, x[:, :1], x[:, :1], enable_gqa=True)
    except TypeError:
        return False
    return True


# SDPA's FlashAttention-2 kernel: compute capability 8.0 and newer, head dims up to 256 in multiples of 8.
FLASH_MIN_CAPABILITY = (8, 0)
FLASH_MAX_HEAD_DIM = 256


def flash_attention_fits(capability: tuple[int, int], head_dim: int | None = None) -> bool:
    """Whether SDPA's FlashAttention-2 kernel runs on a device of compute ``capability`` and, given
    ``head_dim``, at that head dim. Where it does not, the packed call has no kernel it may take
    (PACKED_SDPA_BACKENDS), so the Triton backend leaves fresh prompts to its extend kernel."""
    return tuple(capability) >= FLASH_MIN_CAPABILITY and (
        head_dim is None or (head_dim <= FLASH_MAX_HEAD_DIM and head_dim % 8 == 0))


def unavailable_reason(device: torch.device) -> str | None:
    """Why torch_flash cannot run on ``device``, or None when it can."""
    if device.type != "cuda":
        return f"it runs PyTorch's CUDA attention kernels and the KV cache is on {device.type!r}"
    capability = torch.cuda.get_device_capability(device)
    if not flash_attention_fits(capability):
        need = ".".join(map(str, FLASH_MIN_CAPABILITY))
        return (f"its FlashAttention-2 kernels need compute capability {need} or newer, and this GPU has "
                f"{capability[0]}.{capability[1]}")
    if not sdpa_has_gqa():
        return f"torch {torch.__version__} has no scaled_dot_product_attention(enable_gqa=...) (needs torch >= 2.5)"
    return None


def check_available(device: torch.device) -> None:
    reason = unavailable_reason(device)
    if reason is not None:
        raise ValueError(f"attention backend 'torch_flash' cannot run here: {reason}. "
                         f"Backends that run on the CPU: {BACKENDS_THAT_RUN_ON_CPU}; on a CUDA GPU also triton.")


# --- masked SDPA with GQA folded into the query length ---------------------------------------------


def grouped_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None,
                 scale: float) -> torch.Tensor:
    """q [B, n, Hq, D], k/v [B, m, Hkv, D], allowed bool [n, m] or [B, n, m] (None: all) -> [B, n, Hq, D].

    The ``g = Hq / Hkv`` query heads sharing a KV head become ``g * n`` query rows of that head, so K/V
    are never repeated (masked SDPA cannot use the flash kernel's native GQA)."""
    b, n, hq, d = q.shape
    hkv = k.shape[2]
    g = hq // hkv
    qg = q.reshape(b, n, hkv, g, d).permute(0, 2, 3, 1, 4).reshape(b, hkv, g * n, d)
    mask = None
    if allowed is not None:
        # Row gi * n + i of a head is query i of group member gi: repeat the [n, m] rows g times.
        mask = allowed.repeat(1, g, 1).unsqueeze(1) if allowed.dim() == 3 else allowed.repeat(g, 1)
    out = F.scaled_dot_product_attention(qg, k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask, scale=scale)
    return out.reshape(b, hkv, g, n, d).permute(0, 3, 1, 2, 4).reshape(b, n, hq, d)


def extend_allowed(ext: int, pre: int, window: int | None, device: torch.device,
                   tree: torch.Tensor | None = None) -> torch.Tensor:
    """[ext, pre + ext] bool: lower-right causal (query i sits at position pre + i), or the tree mask,
    and with a window only keys j > pos - W."""
    qpos = torch.arange(ext, device=device).unsqueeze(1) + pre
    kpos = torch.arange(pre + ext, device=device).unsqueeze(0)
    allowed = tree.view(ext, pre + ext).bool() if tree is not None else kpos <= qpos
    if window:
        allowed = allowed & (kpos > qpos - window)
    return allowed


# --- extend planning ---------------------------------------------------------------------------------


@dataclass
class PackedGroup:
    """Requests with no prefix and the same extend length: one batched causal SDPA call."""

    length: int
    count: int
    token_start: int | None  # the group's tokens are q[token_start : token_start + count * length]
    q_src: torch.Tensor | None  # else their token indices, request-major


@dataclass
class Segments:
    """Some requests with their K/V laid out contiguously: per request its cached prefix, then its new
    tokens. ``q_src`` None means the segments are every token of the batch, in order."""

    q_src: torch.Tensor | None
    ext: list[int]
    pre: list[int]
    rows: torch.Tensor  # req_to_token rows of the prefix tokens (one per prefix token)
    cols: torch.Tensor  # their positions in the row
    prefix_dst: torch.Tensor  # where each prefix token lands in the contiguous K/V
    new_dst: torch.Tensor  # where each new token (q_src order) lands
    cu_q: torch.Tensor  # int32 [n + 1]
    cu_k: torch.Tensor  # int32 [n + 1]
    masks: list[torch.Tensor | None]  # per request tree mask, flattened
    prefix_slots: torch.Tensor | None = None  # KV slots of the prefix tokens: filled by in_graph

    @property
    def kv_total(self) -> int:
        return sum(self.pre) + sum(self.ext)

    @property
    def num_prefix(self) -> int:
        return sum(self.pre)


@dataclass
class ExtendPlan:
    packed: list[PackedGroup] = field(default_factory=list)
    rest: Segments | None = None
    everything: Segments | None = None  # every request, for the varlen path of a whole batch
    has_tree: bool = False


def _token_index(starts: list[int], lengths: list[int], device: torch.device) -> torch.Tensor:
    return torch.cat([torch.arange(s, s + n) for s, n in zip(starts, lengths, strict=True)]).to(device)


def _segments(members: list[int], starts: list[int], ext: list[int], pre: list[int], rows: list[int],
              tree: torch.Tensor | None, mask_starts: list[int], total_tokens: int,
              device: torch.device) -> Segments:
    e = [ext[i] for i in members]
    p = [pre[i] for i in members]
    in_order = members == list(range(len(ext))) and sum(e) == total_tokens
    q_src = None if in_order else _token_index([starts[i] for i in members], e, device)
    kv_off = [0, *itertools.accumulate(pi + ei for pi, ei in zip(p, e, strict=True))]
    prefix_dst = [torch.arange(kv_off[j], kv_off[j] + p[j]) for j in range(len(members))]
    new_dst = [torch.arange(kv_off[j] + p[j], kv_off[j + 1]) for j in range(len(members))]
    row_of = [torch.full((p[j],), rows[i], dtype=torch.long) for j, i in enumerate(members)]
    col_of = [torch.arange(p[j]) for j in range(len(members))]
    cu_q = torch.tensor([0, *itertools.accumulate(e)], dtype=torch.int32)
    masks: list[torch.Tensor | None] = [None] * len(members)
    if tree is not None:
        masks = [tree[mask_starts[i] : mask_starts[i] + ext[i] * (pre[i] + ext[i])] for i in members]
    cat = torch.cat
    return Segments(q_src=q_src, ext=e, pre=p, rows=cat(row_of).to(device), cols=cat(col_of).to(device),
                    prefix_dst=cat(prefix_dst).to(device), new_dst=cat(new_dst).to(device), cu_q=cu_q.to(device),
                    cu_k=torch.tensor(kv_off, dtype=torch.int32, device=device), masks=masks)


def plan_extend(ext: list[int], pre: list[int], rows: list[int], tree: torch.Tensor | None, device: torch.device,
                *, pack: bool, want_everything: bool) -> ExtendPlan:
    """Host-side plan of one extend batch (see the module docstring). ``pack``: group no-prefix requests
    for batched SDPA; ``want_everything``: also lay out the whole batch for one varlen call."""
    starts = [0, *itertools.accumulate(ext[:-1])]
    mask_starts = [0, *itertools.accumulate(e * (e + p) for e, p in zip(ext[:-1], pre[:-1], strict=True))]
    total = sum(ext)
    plan = ExtendPlan(has_tree=tree is not None)
    packable = pack and tree is None
    by_len: dict[int, list[int]] = {}
    rest: list[int] = []
    for i, (e, p) in enumerate(zip(ext, pre, strict=True)):
        if packable and p == 0:
            by_len.setdefault(e, []).append(i)
        else:
            rest.append(i)
    for length, members in by_len.items():
        consecutive = members == list(range(members[0], members[0] + len(members)))
        plan.packed.append(PackedGroup(
            length=length, count=len(members), token_start=starts[members[0]] if consecutive else None,
            q_src=None if consecutive else _token_index([starts[i] for i in members], [length] * len(members),
                                                        device)))
    if rest:
        plan.rest = _segments(rest, starts, ext, pre, rows, tree, mask_starts, total, device)
    if want_everything and tree is None:
        plan.everything = _segments(list(range(len(ext))), starts, ext, pre, rows, None, mask_starts, total, device)
    return plan


def run_packed(g: PackedGroup, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
               window: int | None, out: torch.Tensor) -> None:
    """Causal attention of a group of no-prefix requests of one length, from q [T, Hq, D] and k/v [T, Hkv, D]
    (the batch's new tokens; token-strided views are fine) into ``out`` [T, Hq, D]: one batched SDPA call
    (``is_causal`` is right here because queries == keys), or a window mask for a windowed layer."""
    n, length = g.count, g.length
    if g.token_start is not None:
        sl = slice(g.token_start, g.token_start + n * length)
        qg, kg, vg = q[sl], k[sl], v[sl]
    else:
        qg, kg, vg = q[g.q_src], k[g.q_src], v[g.q_src]
    qg, kg, vg = (t.view(n, length, *t.shape[1:]) for t in (qg, kg, vg))
    if window:
        o = grouped_sdpa(qg, kg, vg, extend_allowed(length, 0, window, q.device), scale)
    else:
        # On the CPU (tests) torch's own choice; on CUDA only PACKED_SDPA_BACKENDS (no fallback to the
        # math kernel: an input FlashAttention-2 cannot take fails loudly instead of running slowly).
        with sdpa_kernel(list(PACKED_SDPA_BACKENDS), set_priority=True) if q.is_cuda else contextlib.nullcontext():
            o = F.scaled_dot_product_attention(qg.transpose(1, 2), kg.transpose(1, 2), vg.transpose(1, 2),
                                               is_causal=True, scale=scale,
                                               enable_gqa=kg.shape[2] != qg.shape[2]).transpose(1, 2)
    o = o.reshape(n * length, *o.shape[2:])
    if g.token_start is not None:
        out[g.token_start : g.token_start + n * length] = o
    else:
        out[g.q_src] = o


# --- the backend -----------------------------------------------------------------------------------


def _refuse_sinks(layer: AttentionLayer) -> None:
    if layer.sinks is not None:
        raise ValueError("attention backend 'torch_flash' does not support attention sinks (gpt-oss); use "
                         "--attention-backend triton or torch_native")


class TorchFlashAttnBackend(AttentionBackend):
    name = "torch_flash"

    def __init__(self, req_to_token_pool: ReqToTokenPool, kv_pool: MHATokenToKVPool,
                 kernel_path: str = DEFAULT_KERNEL_PATH, sliding_window: int | None = None) -> None:
        """Construction does not check the device (tests run the SDPA path on the CPU); the registry
        factory calls ``check_available`` first."""
        super().__init__(req_to_token_pool, kv_pool)
        if kernel_path not in KERNEL_PATHS:
            raise ValueError(f"torch_flash kernel_path must be one of {KERNEL_PATHS}, got {kernel_path!r}")
        self.device = kv_pool.k_buffer[0].device
        varlen = detect_varlen_kernel()
        # FlashAttention-2 runs on CUDA in fp16/bf16 only (an FP8 cache is dequantized to the model's
        # dtype, bf16/fp16 on GPUs, before it).
        usable = self.device.type == "cuda" and (kv_pool.dtype in (torch.float16, torch.bfloat16) or kv_pool.is_fp8)
        self.varlen = varlen if usable else None
        if kernel_path == "varlen" and self.varlen is None:
            raise ValueError("torch_flash kernel_path 'varlen' needs torch.nn.attention.varlen.varlen_attn on a CUDA "
                             f"device in fp16/bf16 (torch {torch.__version__}, {self.device.type}, {kv_pool.dtype})")
        self.kernel_path = kernel_path
        self.sliding_window = sliding_window
        self.reference = TorchNativeAttnBackend(req_to_token_pool, kv_pool)  # for logit-capped layers
        self.extend_md: ExtendPlan | None = None

    # --- graphs: decode gathers a host-sized padding, so it cannot be captured --------------------
    def init_cuda_graph_state(self, max_bs: int, max_num_tokens: int) -> None:
        raise RuntimeError(
            "attention backend 'torch_flash' decodes over a host-sized K/V gather and cannot run under CUDA "
            "graphs; use --decode-attention-backend triton (prefill stays on torch_flash) or --disable-cuda-graph")

    # --- planning -----------------------------------------------------------------------------------
    def _windowed_varlen(self) -> bool:
        """Whether windowed layers take varlen_attn (its window is native; SDPA's would be a mask)."""
        return self.varlen is not None and self.varlen.has_window and self.kernel_path != "sdpa"

    def init_forward_metadata_out_graph(self, fb: ForwardBatch, in_capture: bool = False) -> None:
        if not fb.forward_mode.is_extend():
            return None  # decode reads seq_lens at the call: nothing to plan
        assert fb.extend is not None
        want_everything = self.kernel_path == "varlen" or (bool(self.sliding_window) and self._windowed_varlen())
        self.extend_md = plan_extend(
            list(fb.extend.seq_lens_cpu), list(fb.extend.prefix_lens_cpu), fb.req_pool_indices.tolist(),
            custom_mask_of(fb), self.device, pack=self.kernel_path != "varlen",
            want_everything=want_everything and self.varlen is not None)

    def init_forward_metadata_in_graph(self, fb: ForwardBatch) -> None:
        if not fb.forward_mode.is_extend():
            return None
        md = self.extend_md
        assert md is not None, "out_graph plans before in_graph"
        req_to_token = self.req_to_token_pool.req_to_token
        for seg in (md.rest, md.everything):
            if seg is not None:
                seg.prefix_slots = req_to_token[seg.rows, seg.cols].long()

    # --- extend -------------------------------------------------------------------------------------
    def _gather(self, seg: Segments, new: torch.Tensor, cache: torch.Tensor, scale: float) -> torch.Tensor:
        """Contiguous K (or V) of ``seg``: cached prefix from the paged cache (an FP8 cache dequantized
        with ``scale``), new tokens from ``new``."""
        if seg.num_prefix == 0 and seg.q_src is None:
            return new
        out = new.new_empty(seg.kv_total, *new.shape[1:])
        assert seg.prefix_slots is not None, "in_graph gathers the prefix slots"
        out[seg.prefix_dst] = self.kv_pool.dequantize(cache[seg.prefix_slots], scale, new.dtype)
        out[seg.new_dst] = new if seg.q_src is None else new[seg.q_src]
        return out

    def _run_varlen(self, seg: Segments, q, k, v, k_buf, v_buf, layer: AttentionLayer, out: torch.Tensor) -> None:
        assert self.varlen is not None
        qs = q if seg.q_src is None else q[seg.q_src]
        # FlashAttention wants dense rows; k/v may be column slices of a fused qkv projection.
        k_scale, v_scale = self.kv_pool.kv_scales_of(layer.layer_id)
        ks = self._gather(seg, k, k_buf, k_scale).contiguous()
        vs = self._gather(seg, v, v_buf, v_scale).contiguous()
        o = self.varlen(qs.contiguous(), ks, vs, seg.cu_q, seg.cu_k,
                        max(seg.ext), max(p + e for p, e in zip(seg.pre, seg.ext, strict=True)), layer.scaling,
                        layer.sliding_window)
        if seg.q_src is None:
            out.copy_(o)
        else:
            out[seg.q_src] = o

    def _run_masked(self, seg: Segments, q, k, v, k_buf, v_buf, layer: AttentionLayer, out: torch.Tensor) -> None:
        qs = q if seg.q_src is None else q[seg.q_src]
        k_scale, v_scale = self.kv_pool.kv_scales_of(layer.layer_id)
        ks, vs = self._gather(seg, k, k_buf, k_scale), self._gather(seg, v, v_buf, v_scale)
        os_ = torch.empty_like(qs)
        q_off = kv_off = 0
        for e, p, tree in zip(seg.ext, seg.pre, seg.masks, strict=True):
            allowed = extend_allowed(e, p, layer.sliding_window, q.device, tree)
            os_[q_off : q_off + e] = grouped_sdpa(qs[None, q_off : q_off + e], ks[None, kv_off : kv_off + p + e],
                                                  vs[None, kv_off : kv_off + p + e], allowed, layer.scaling)[0]
            q_off += e
            kv_off += p + e
        if seg.q_src is None:
            out.copy_(os_)
        else:
            out[seg.q_src] = os_

    def forward_extend(self, q, k, v, layer, fb, save_kv_cache=True):
        _refuse_sinks(layer)
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q3, k3, v3 = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        if save_kv_cache:
            self.kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k3, v3)
        if layer.logit_cap > 0:
            return self.reference.forward_extend(q, k, v, layer, fb, save_kv_cache=False)
        k3, v3 = self.kv_pool.as_stored(layer.layer_id, k3, v3)
        md = self.extend_md
        assert md is not None, "plan the batch before the forward"
        k_buf, v_buf = self.kv_pool.get_key_buffer(layer.layer_id), self.kv_pool.get_value_buffer(layer.layer_id)
        out = torch.empty_like(q3)
        # A whole-batch layout exists only where varlen_attn does (plan_extend's want_everything).
        everything, varlen = md.everything, self.varlen
        whole = everything is not None and varlen is not None and (self.kernel_path == "varlen" or layer.sliding_window)
        if whole and (not layer.sliding_window or varlen.has_window):
            self._run_varlen(everything, q3, k3, v3, k_buf, v_buf, layer, out)
            return out.view(-1, hq * d)
        for g in md.packed:
            run_packed(g, q3, k3, v3, layer.scaling, layer.sliding_window, out)
        if md.rest is not None:
            use_varlen = (self.varlen is not None and self.kernel_path != "sdpa" and not md.has_tree
                          and (not layer.sliding_window or self.varlen.has_window))
            run = self._run_varlen if use_varlen else self._run_masked
            run(md.rest, q3, k3, v3, k_buf, v_buf, layer, out)
        return out.view(-1, hq * d)

    # --- decode -------------------------------------------------------------------------------------
    def forward_decode(self, q, k, v, layer, fb, save_kv_cache=True):
        _refuse_sinks(layer)
        hq, hkv, d = layer.num_heads, layer.num_kv_heads, layer.head_dim
        q3, k3, v3 = q.view(-1, hq, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        if save_kv_cache:
            self.kv_pool.set_kv_buffer(layer.layer_id, fb.out_cache_loc, k3, v3)
        if layer.logit_cap > 0:
            return self.reference.forward_decode(q, k, v, layer, fb, save_kv_cache=False)
        max_len = max(fb.seq_lens_cpu)
        seq_lens = fb.seq_lens.unsqueeze(1)
        start = 0
        if layer.sliding_window:  # read only the window: keys at j > seq_len - 1 - W
            max_len = min(max_len, layer.sliding_window)
            start = (seq_lens - layer.sliding_window).clamp(min=0)
        pos = torch.arange(max_len, device=q.device).unsqueeze(0) + start  # [bs, L] absolute positions
        valid = pos < seq_lens
        cols = pos.clamp(max=self.req_to_token_pool.req_to_token.shape[1] - 1)
        slots = self.req_to_token_pool.req_to_token[fb.req_pool_indices.unsqueeze(1), cols].long()
        pool = self.kv_pool
        k_scale, v_scale = pool.kv_scales_of(layer.layer_id)
        keys = pool.dequantize(pool.get_key_buffer(layer.layer_id)[slots], k_scale, q.dtype)  # [bs, L, Hkv, D]
        vals = pool.dequantize(pool.get_value_buffer(layer.layer_id)[slots], v_scale, q.dtype)
        o = grouped_sdpa(q3.unsqueeze(1), keys, vals, valid.unsqueeze(1), layer.scaling)  # [bs, 1, Hq, D]
        return o.reshape(-1, hq * d)
