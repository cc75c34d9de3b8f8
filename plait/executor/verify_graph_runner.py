"""VerifyGraphRunner: TARGET_VERIFY forwards captured per draft width and batch-size bucket.

A verify batch has ``W`` tokens per request (``spec_info.num_tokens_per_req``, root included). One
graph is captured per (W, bucket) for W in ``widths``; a batch runs through a graph only when every
request has the same captured width (the width is read from the batch, never a global constant),
otherwise it runs eagerly.

Static buffers (shared by every graph, prefixes read): tokens ``[max_bs * max_W]`` (ids, positions,
KV write slots), requests ``[max_bs]`` (pool rows, seq lens, prefix lens, extend lens) and the custom
tree mask, flat, sized for the longest context (request i's block is ``W x (prefix_i + W)``). Where
every draft is a chain (``CaptureTarget.causal_chain_verify``) the graphs are captured without a mask
(causal attention) and replay only chain batches; a tree batch then runs eagerly, and the other way
round for masked graphs.
Capture goes through the three-method contract like the decode runner: ``out_graph`` on the static
batch outside the capture, the batch marked planned, ``in_graph`` as the first recorded step.

Replay is the verify pre-planning site: it copies the live batch into the buffers, pads to the
bucket (padded requests read the reserved request row with prefix 0, write their W tokens into the
reserved dummy KV slot, and see a W x W mask of ones), plans on the padded view and marks it,
replays, and slices the logits (and their argmax, computed in the graph) back to the live ``bs * W``
rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from plait.executor.graph_utils import (
    CaptureTarget,
    CudaGraph,
    Graph,
    GraphFactory,
    bucket_for,
    dp_graph_batch_size,
    holds,
    stage,
    warm_and_capture,
)
from plait.forward_batch import ExtendInfo, ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT, DUMMY_REQ_ROW
from plait.models.llama import LogitsOutput
from plait.sampling.sampler import greedy_ids

logger = logging.getLogger(__name__)


@dataclass
class StaticVerifyInfo:
    """``spec_info`` of the static batches: the mask is the runner's static buffer (None: causal chains)."""

    custom_mask: torch.Tensor | None
    num_tokens_per_req: int


@dataclass(frozen=True)
class StaticViews:
    """The static buffers' views that a batch of one shape (requests, width) reads or fills."""

    input_ids: torch.Tensor  # [bs * W]
    positions: torch.Tensor  # [bs * W]
    out_cache_loc: torch.Tensor  # [bs * W]
    req_pool_indices: torch.Tensor  # [bs]
    seq_lens: torch.Tensor  # [bs]
    prefix_lens: torch.Tensor  # [bs]
    extend_lens: torch.Tensor  # [bs]
    start_loc: torch.Tensor  # [bs]: b * W (its own tensor, not a buffer view)


def uniform_width(fb: ForwardBatch) -> int | None:
    """The one per-request width of a verify batch, or None when requests differ."""
    width = getattr(fb.spec_info, "num_tokens_per_req", None)
    if isinstance(width, int):
        return width
    if not width:
        return None
    first = width[0]
    return first if all(w == first for w in width) else None


class VerifyGraphRunner:
    def __init__(self, target: CaptureTarget, batch_sizes: Sequence[int], widths: Sequence[int],
                 graph_factory: GraphFactory = CudaGraph, pad: bool = True) -> None:
        if not widths or min(widths) < 2:
            raise ValueError(f"verify widths count the root and a guess, so each is >= 2: got {list(widths)}")
        self.target = target
        self.backend = target.backend
        self.batch_sizes = list(batch_sizes)  # ascending (graph_utils.graph_batch_sizes)
        self.max_bs = max_bs = self.batch_sizes[-1]
        self.pad = pad  # False: only a captured batch size replays (graph_utils.holds)
        # True: the graphs are captured without a tree mask and replay chain batches only (those
        # build_verify_batch makes with causal_chains, which carry no mask); False: masked batches only.
        self.causal_chains = causal_chains = target.causal_chain_verify
        self.widths = sorted(set(widths))
        max_w = self.widths[-1]
        device = target.device
        i64 = dict(dtype=torch.int64, device=device)
        self.input_ids = torch.zeros(max_bs * max_w, **i64)
        self.positions = torch.zeros(max_bs * max_w, **i64)
        self.out_cache_loc = torch.full((max_bs * max_w,), DUMMY_KV_SLOT, **i64)
        self.req_pool_indices = torch.full((max_bs,), DUMMY_REQ_ROW, **i64)
        self.seq_lens = torch.zeros(max_bs, **i64)
        self.prefix_lens = torch.zeros(max_bs, **i64)
        self.extend_lens = torch.zeros(max_bs, **i64)
        # A request's block is W x (prefix + W) and prefix + W <= the context length.
        self.custom_mask = (None if causal_chains else
                            torch.ones(max_bs * max_w * target.max_context_len, dtype=torch.bool, device=device))
        self.logits_buffer = target.logits_buffer(max_bs * max_w)  # shared by every (width, bucket) graph
        self.backend.init_cuda_graph_state(max_bs, max_bs * max_w)
        self.graphs: dict[tuple[int, int], Graph] = {}
        self.capture_batches: dict[tuple[int, int], ForwardBatch] = {}
        self.outputs: dict[tuple[int, int], LogitsOutput] = {}
        self._static_views: dict[tuple[int, int], StaticViews] = {}
        self._output_views: dict[tuple[int, int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._extend_lens_width: tuple[int, int] | None = None  # what extend_lens holds now (width, rows)
        self.last_view: ForwardBatch | None = None  # the padded view of the latest replay (tests read it)
        self._graph_factory = graph_factory
        self.capture()

    # --- static batches ---------------------------------------------------------------------------
    def _views(self, width: int, bs: int) -> StaticViews:
        """The buffers' views for ``bs`` requests ``width`` wide (made once per shape: a view costs the
        host a dispatch, and a replay sits between two verifies)."""
        views = self._static_views.get((width, bs))
        if views is None:
            n = bs * width
            views = self._static_views[(width, bs)] = StaticViews(
                input_ids=self.input_ids[:n], positions=self.positions[:n], out_cache_loc=self.out_cache_loc[:n],
                req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
                prefix_lens=self.prefix_lens[:bs], extend_lens=self.extend_lens[:bs],
                start_loc=torch.arange(bs, device=self.input_ids.device) * width)
        return views

    def _static_batch(self, width: int, bs: int, seq_lens_cpu: list[int], prefix_cpu: list[int]) -> ForwardBatch:
        v = self._views(width, bs)
        return ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=bs, input_ids=v.input_ids,
            req_pool_indices=v.req_pool_indices, seq_lens=v.seq_lens,
            out_cache_loc=v.out_cache_loc, positions=v.positions, seq_lens_cpu=seq_lens_cpu,
            seq_lens_sum=sum(seq_lens_cpu),
            extend=ExtendInfo(num_tokens=bs * width, seq_lens=v.extend_lens, prefix_lens=v.prefix_lens,
                              start_loc=v.start_loc, seq_lens_cpu=[width] * bs, prefix_lens_cpu=prefix_cpu),
            attn_backend=self.backend,
            spec_info=StaticVerifyInfo(self.custom_mask, width), next_token_logits_buffer=self.logits_buffer,
            hidden_capture=self.target.hidden_capture,
        )

    def capture(self) -> None:
        pool = None
        model = self.target.model
        for width in reversed(self.widths):
            for bs in reversed(self.batch_sizes):
                # Capture on padding-like rows: dummy request row, prefix 0, mask of ones.
                self.extend_lens[:bs].fill_(width)
                self.seq_lens[:bs].fill_(width)
                fb = self._static_batch(width, bs, [width] * bs, [0] * bs)
                self.target.prepare_capture(fb)  # DP attention: a MAX_LEN verify of the bucket on every rank
                self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
                fb.mark_forward_metadata_ready()
                self.capture_batches[(width, bs)] = fb

                def run(fb: ForwardBatch = fb) -> LogitsOutput:
                    self.backend.init_forward_metadata_in_graph(fb)
                    out = model(fb.input_ids, fb.positions, fb)
                    out.greedy_ids = greedy_ids(out.next_token_logits)  # greedy acceptance reads it
                    return out

                graph = self._graph_factory()
                self.outputs[(width, bs)] = warm_and_capture(graph, run, pool, self.input_ids.is_cuda)
                pool = graph.pool()
                self.graphs[(width, bs)] = graph
        self._extend_lens_width = None  # the captures filled it for each width and bucket
        logger.info("captured TARGET_VERIFY graphs for widths %s x batch sizes %s", self.widths, self.batch_sizes)

    # --- replay -----------------------------------------------------------------------------------
    def can_run(self, fb: ForwardBatch) -> bool:
        if fb.mlp_sync.global_num_tokens_cpu is not None:
            return self._can_run_dp(fb)
        if not fb.forward_mode.is_target_verify():
            return False
        if fb.logits_indices is not None:
            return False
        masked = fb.spec_info is not None and fb.spec_info.custom_mask is not None
        width = uniform_width(fb)
        return (width is not None and self.replays(fb.batch_size, width, masked)
                and fb.num_tokens == width * fb.batch_size)

    def replays(self, bs: int, width: int, masked: bool) -> bool:
        """Whether a verify batch of ``bs`` requests ``width`` tokens wide, with or without a tree mask,
        replays a graph (a tree batch of a chain-only runner, or the reverse, runs eagerly)."""
        return masked != self.causal_chains and width in self.widths and holds(self.batch_sizes, bs, self.pad)

    def _can_run_dp(self, fb: ForwardBatch) -> bool:
        """DP attention: the graphs hold the MLP collectives, so every rank decides alike, from the
        round's global counts only (MAX_LEN, the largest rank's request count within a bucket). A
        rank with nothing to verify (an IDLE batch carrying the round's width) replays the bucket on
        padding rows."""
        if not (fb.forward_mode.is_target_verify() or fb.forward_mode.is_idle()) or fb.spec_info is None:
            return False
        width = uniform_width(fb)
        if not (fb.mlp_sync.can_run_dp_cuda_graph and width in self.widths
                and holds(self.batch_sizes, dp_graph_batch_size(fb), self.pad)):
            return False
        # What every rank's batch of such a round is (one padded width, all logits rows): a rank whose
        # batch were not would leave the others waiting in the collectives, so it fails loudly here.
        if fb.logits_indices is not None or fb.num_tokens != (width or 0) * fb.batch_size:
            raise RuntimeError("a DP-attention verify batch must have one width and every logits row")
        return True

    def bucket(self, bs: int) -> int:
        return bucket_for(self.batch_sizes, bs)

    def replay(self, fb: ForwardBatch) -> LogitsOutput:
        return self.stage(fb)()

    def stage(self, fb: ForwardBatch) -> Callable[[], LogitsOutput]:
        """``replay`` in two halves: the batch copied into the buffers and planned now (the copies queued
        behind whatever the stream runs), the graph launched by the returned call. Between the two no
        other batch may be staged or replayed (they share the buffers and the backend's plan)."""
        width = uniform_width(fb)
        assert width is not None and (fb.extend is not None or fb.forward_mode.is_idle())
        bs = fb.batch_size
        dp = fb.mlp_sync.global_num_tokens_cpu is not None
        padded = self.bucket(dp_graph_batch_size(fb) if dp else bs)
        n, n_pad = bs * width, padded * width
        prefix_lens = fb.extend.prefix_lens if fb.extend is not None else self.prefix_lens[:0]
        prefix_cpu = fb.extend.prefix_lens_cpu if fb.extend is not None else []
        # The integer inputs in one multi-tensor copy (one launch on the critical path between two
        # verify steps, not one per buffer), then the padding rows, when the bucket has any.
        live = self._views(width, bs)
        torch._foreach_copy_([live.input_ids, live.positions, live.out_cache_loc, live.req_pool_indices,
                              live.seq_lens, live.prefix_lens],
                             [fb.input_ids, fb.positions, fb.out_cache_loc, fb.req_pool_indices, fb.seq_lens,
                              prefix_lens])
        if padded > bs:
            for buf, start, end, pad_value in (
                    (self.input_ids, n, n_pad, 0), (self.positions, n, n_pad, 0),
                    (self.out_cache_loc, n, n_pad, DUMMY_KV_SLOT), (self.req_pool_indices, bs, padded, DUMMY_REQ_ROW),
                    (self.seq_lens, bs, padded, width), (self.prefix_lens, bs, padded, 0)):
                buf[start:end].fill_(pad_value)
        if self._extend_lens_width != (width, padded):  # every graph reads extend_lens[:padded] == width
            self.extend_lens[:padded].fill_(width)
            self._extend_lens_width = (width, padded)
        mask = fb.spec_info.custom_mask
        if self.custom_mask is not None and mask is not None:
            # A padded request's mask block is W x (0 + W), all ones.
            stage(self.custom_mask, mask, mask.numel() + (padded - bs) * width * width, True)
        pad = padded - bs
        view = self._static_batch(width, padded, list(fb.seq_lens_cpu) + [width] * pad,
                                  list(prefix_cpu) + [0] * pad)
        view.actual_forward_mode = fb.forward_mode
        view.lens_on_device = fb.lens_on_device
        if fb.needs_forward_metadata_init():
            self.backend.init_forward_metadata_out_graph(view)
            view.mark_forward_metadata_ready()  # the verify pre-planning site marks what it planned
        self.last_view = view
        graph = self.graphs[(width, padded)]
        logits, greedy = self._live_outputs(width, padded, n)

        def launch() -> LogitsOutput:
            graph.replay()
            return LogitsOutput(next_token_logits=logits, greedy_ids=greedy)
        return launch

    def _live_outputs(self, width: int, padded: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The graph's logits and argmax rows of the ``n`` live tokens (views made once per shape)."""
        key = (width, padded, n)
        live = self._output_views.get(key)
        if live is None:
            out = self.outputs[(width, padded)]
            assert out.greedy_ids is not None
            live = self._output_views[key] = (out.next_token_logits[:n], out.greedy_ids[:n])
        return live
