"""DP attention (``enable_dp_attention``, dp_size == tp_size): every rank schedules its own requests.

Each rank has its own Scheduler, KV cache and sampler and runs attention (and the embedding and
LM head, unsharded) over its own requests only; the MLP is sharded over all ranks, and its tokens
are gathered and reduced around it (``plait.distributed.dp_mlp``). Rank 0, the engine's process,
is also the front end: ``DPAttentionScheduler`` balances new requests over the ranks (shortest
queue: fewest live requests) and keeps a stand-in Req for every request another rank serves.

One engine step is one lockstep round on every rank, with two control collectives (gloo):

  1. the round exchange (one all-gather): rank 0 sends a ``DPControl`` (new requests with their
     rank, aborts, or shut down), every other rank the progress of its previous round (new tokens,
     finishes), which rank 0 applies to its stand-ins
  2. every rank runs ``Scheduler.step()``; its forward first all-gathers the per-rank counts
     (decode and speculative batches: requests, extend: new tokens), picks the padding mode and
     fills the batch's MLP-sync metadata (``ForwardBatch.init_mlp_sync_metadata``). A rank that
     launched nothing runs an IDLE batch, which joins the same collectives with zero rows, unless no
     rank has any work. With two-batch overlap the same exchange carries each rank's proposed
     halves, from which every rank decides alike whether the forward runs as two micro-batches.

With speculative decoding each rank drafts and verifies its own requests (its own worker, a
replicated draft model or head), and a round has two phases (``RoundPhase``): SPEC, the verify
forward, then MAIN, the scheduler's own batch. Each phase has its own count exchange and every rank
joins it, with an IDLE batch when it has nothing there. In SPEC the ranks exchange request counts,
which ``init_mlp_sync_metadata`` scales by the request width (verify blocks are padded to
``speculative_num_draft_tokens`` on every rank, and an IDLE batch of the phase carries that width).

Overlap scheduling works as on one rank: a round launches its forward and then processes the one
launched in the previous round, so the host work of a round (the control collectives above
included) runs while the device computes, and the progress a rank reports is that of the previous
forward. A finish on another rank reaches rank 0 in the exchange of the round after the one that
processed it (rank 0 steps while a stand-in is live, so the last report always arrives).
"""

from __future__ import annotations

import enum
import logging
import pickle
from collections import Counter, deque
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from plait.config import EngineConfig
from plait.distributed.copy_engine_rows import CopyEngineRows, copy_engine_rows
from plait.distributed.dp_mlp import dp_mlp_ops
from plait.distributed.parallel_state import TPGroup
from plait.executor.model_runner import ModelRunner
from plait.executor.sizing import use_rank_device
from plait.forward_batch import DPPaddingMode, ForwardBatch, ForwardMode, MLPSyncMetadata, spec_request_width
from plait.layers.overlap import run_overlapped
from plait.mem.radix_cache import RadixCache
from plait.models.llama import LogitsOutput
from plait.models.loader import ModelConfig
from plait.parallel.ranks import DistGroups, RankProcesses, SpawnedRanks, TensorParallelError
from plait.parallel.roles import LogitsObserver
from plait.sampling.params import SamplingParams
from plait.scheduler.interface import SpecWorker
from plait.scheduler.req import FinishReason, Req
from plait.scheduler.scheduler import Scheduler
from plait.scheduler.stats import SchedulerStats
from plait.speculative.factory import create_spec_worker
from plait.two_batch_overlap import TboSplit, dp_local_split, dp_split_pays, split_forward_batch

if TYPE_CHECKING:
    from plait.sampling.grammar import GrammarBackend

logger = logging.getLogger(__name__)


# --- objects over a gloo group ---------------------------------------------------------------------
# A round message travels in one fixed-size all-gather: a gloo collective costs about half a
# millisecond whatever its size up to tens of KiB, so a size exchange before the data would double
# the control plane's cost. Longer messages (many new prompts) send the rest in a second all-gather.
EXCHANGE_BYTES = 1 << 16
_LEN = 8  # bytes of the little-endian length header


def exchange_objects(group: TPGroup, obj: Any, timeout: timedelta | None = None) -> list[Any]:
    """Every rank's ``obj`` (pickled), in rank order. ``timeout`` bounds only the first collective
    (the wait for the other ranks to arrive, which may last as long as the engine sits idle)."""
    data = pickle.dumps(obj)
    buf = torch.zeros(_LEN + EXCHANGE_BYTES, dtype=torch.uint8)
    head = len(data).to_bytes(_LEN, "little") + data[:EXCHANGE_BYTES]
    buf[: len(head)] = torch.frombuffer(bytearray(head), dtype=torch.uint8)
    parts = [p.numpy().tobytes() for p in group.all_gather(buf, timeout=timeout)]
    sizes = [int.from_bytes(p[:_LEN], "little") for p in parts]
    overflow = max(sizes) - EXCHANGE_BYTES
    rests = [b""] * len(parts)
    if overflow > 0:
        extra = torch.zeros(overflow, dtype=torch.uint8)
        rest = data[EXCHANGE_BYTES:]
        if rest:
            extra[: len(rest)] = torch.frombuffer(bytearray(rest), dtype=torch.uint8)
        rests = [p.numpy().tobytes() for p in group.all_gather(extra)]
    return [pickle.loads((p[_LEN:] + r)[:n]) for p, r, n in zip(parts, rests, sizes, strict=True)]


# --- messages ---------------------------------------------------------------------------------------
@dataclass
class NewRequest:
    rid: str
    input_ids: list[int]
    sampling_params: SamplingParams
    seed: int


@dataclass
class DPControl:
    adds: list[tuple[int, NewRequest]] = field(default_factory=list)  # (rank, request)
    aborts: list[str] = field(default_factory=list)
    shutdown: bool = False


@dataclass
class Progress:
    """What one request served by a rank > 0 produced in a round."""

    rid: str
    token_ids: list[int]
    logprobs: list[float]
    top_logprobs: list[Any]
    cached_tokens: int
    num_retractions: int
    finish_reason: str | None = None
    finish_message: str | None = None
    # Prompt-token logprobs, in the request's first report (they are complete once it samples).
    input_token_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[Any] = field(default_factory=list)


@dataclass
class RankReport:
    """What a rank > 0 sends in a round exchange: its requests' progress since the last report, and
    how many KV slots its scheduler holds outside the prefix cache (leak checks read it on rank 0)."""

    progress: list[Progress]
    kv_tokens_in_use: int


@dataclass
class MLPSync:
    """The per-step global counts, in the shape ``ForwardBatch.init_mlp_sync_metadata`` reads: request
    counts in a speculative phase (it scales them by the per-request width), token counts otherwise."""

    global_num_tokens: list[int]
    global_num_tokens_for_logprob: list[int]
    can_run_dp_cuda_graph: bool


class RoundPhase(enum.IntEnum):
    """The forwards of one DP-attention round, in order. Every rank joins every phase of a round (with
    an IDLE batch when it has nothing to run there), so the MLP collectives of the ranks pair up
    although one rank verifies drafts and another prefills in the same engine step."""

    SPEC = 0  # the speculative worker's TARGET_VERIFY (engines with speculation only)
    MAIN = 1  # the scheduler's own batch (prefill chunk, decode, mixed)


@dataclass(frozen=True)
class RankCounts:
    """One rank's side of a phase's count exchange, named by unit."""

    num_requests: int
    num_tokens: int
    # Tokens per request of a speculative phase's batch (the verify width, the same on every rank);
    # 0 outside a speculative phase.
    request_width: int
    # Rows of varying length per request (a prefill chunk, a mixed batch): the round pads SUM_LEN. A
    # verify batch runs the extend kernels but its blocks have one width: it pads like a decode.
    is_prefill: bool
    # Two-batch overlap: this rank's proposed halves (requests of child A, tokens of child A, requests
    # of child B, tokens of child B; ``plait.two_batch_overlap.dp_local_split``). None: overlap is
    # off, or this rank's batch cannot be split (then no rank splits).
    micro_batches: Halves | None = None

    def to_tensor(self) -> torch.Tensor:
        halves = self.micro_batches if self.micro_batches is not None else (-1, -1, -1, -1)
        return torch.tensor([self.num_requests, self.num_tokens, self.request_width, int(self.is_prefill), *halves],
                            dtype=torch.int64)

    @classmethod
    def from_tensor(cls, t: torch.Tensor) -> RankCounts:
        r, n, w, e, *halves = (int(x) for x in t.tolist())
        return cls(r, n, w, bool(e), None if halves[0] < 0 else (halves[0], halves[1], halves[2], halves[3]))


@dataclass(frozen=True)
class TboSettings:
    """Two-batch overlap under DP attention (``enable_two_batch_overlap``): the config's bar and
    two-chunk threshold."""

    min_tokens: int
    threshold: float


Halves = tuple[int, int, int, int]  # requests and tokens of child A, requests and tokens of child B


def proposed_halves(fb: ForwardBatch, tbo: TboSettings | None) -> Halves | None:
    """This rank's split of ``fb`` as the count exchange carries it (None: no overlap, or no split)."""
    split = dp_local_split(fb, tbo.threshold) if tbo is not None else None
    if split is None:
        return None
    return split.seq_end_a, split.token_index, fb.batch_size - split.seq_index, fb.num_tokens - split.token_index


def rank_counts(fb: ForwardBatch, tbo: TboSettings | None = None) -> RankCounts:
    halves = proposed_halves(fb, tbo)
    if fb.spec_info is None:
        return RankCounts(fb.batch_size, fb.num_tokens, 0, fb.forward_mode.is_extend(), halves)  # IDLE: False
    width = spec_request_width(fb.spec_info)
    if fb.num_tokens != fb.batch_size * width:
        raise RuntimeError(f"a speculative DP-attention batch has {fb.batch_size} requests of width {width} "
                           f"but {fb.num_tokens} tokens: its rows must be padded to one width")
    return RankCounts(fb.batch_size, fb.num_tokens, width, False, halves)


# --- the runner of every rank -------------------------------------------------------------------------
Round = tuple[tuple[int, ...], tuple[bool, ...], DPPaddingMode]  # counts per rank, extends per rank, mode


class MLPCountSync:
    """One rank's side of the count exchange before every DP-attention forward: all-gather each
    rank's counts (``RankCounts``), pick the padding mode, and fill the batch's MLP-sync metadata.
    Every rank calls it once per phase of a round (an IDLE batch included), so the collectives pair."""

    def __init__(self, control: TPGroup, device: str, row_exchange: CopyEngineRows | None,
                 tbo: TboSettings | None = None) -> None:
        self.control = control
        self.device = device
        self.row_exchange = row_exchange
        self.tbo = tbo
        # Recent rounds as every rank saw them (tests, debugging), the request counts per rank of
        # the recent speculative phases any rank verified in, and the tokens per rank of child A and
        # child B of the recent rounds that ran as two micro-batches.
        self.rounds: deque[Round] = deque(maxlen=4096)
        self.spec_rounds: deque[tuple[int, ...]] = deque(maxlen=4096)
        self.split_rounds: deque[tuple[tuple[int, ...], tuple[int, ...]]] = deque(maxlen=4096)

    def sync(self, fb: ForwardBatch) -> None:
        own = rank_counts(fb, self.tbo)
        ranks = [RankCounts.from_tensor(p) for p in self.control.all_gather(own.to_tensor())]
        widths = {r.request_width for r in ranks}
        if len(widths) > 1:
            raise RuntimeError(f"the ranks' batches of one DP-attention phase have request widths "
                               f"{[r.request_width for r in ranks]}: a phase is speculative on every rank or on none")
        # init_mlp_sync_metadata scales request counts by the width of a speculative batch (an IDLE
        # batch of a speculative phase carries the width too) and takes token counts otherwise.
        speculative = fb.spec_info is not None
        counts = [r.num_requests if speculative else r.num_tokens for r in ranks]
        extend_flags = tuple(r.is_prefill for r in ranks)
        tokens = [r.num_tokens for r in ranks]
        mode = DPPaddingMode.choose(tokens, any(extend_flags))
        if any(tokens):
            self.rounds.append((tuple(counts), extend_flags, mode))
            if speculative:
                self.spec_rounds.append(tuple(counts))
        self._fill(fb, counts, mode)
        if fb.mlp_sync.global_num_tokens_cpu != tokens:
            raise RuntimeError(f"DP-attention token counts {fb.mlp_sync.global_num_tokens_cpu} differ from the "
                               f"ranks' own {tokens}")
        if self._split_if_it_pays(fb, [r.micro_batches for r in ranks], speculative, any(extend_flags)) and any(tokens):
            a, b = fb.mlp_sync.micro_batches  # type: ignore[misc]  # set by the split
            self.split_rounds.append((tuple(a.global_num_tokens_cpu or []), tuple(b.global_num_tokens_cpu or [])))

    def capture(self, fb: ForwardBatch) -> None:
        """A captured decode or verify step: a MAX_LEN step with the bucket's requests on every rank (a
        verify's static batch carries its width, which scales them to tokens); at replay each rank pads
        its requests to the bucket of the largest count, so the shapes match the capture.
        With two-batch overlap the capture splits as every rank's replay of the bucket will: each rank
        holds the same padded batch, so each proposes the same halves."""
        size = self.control.size
        self._fill(fb, [fb.batch_size] * size, DPPaddingMode.MAX_LEN)
        self._split_if_it_pays(fb, [proposed_halves(fb, self.tbo)] * size, fb.spec_info is not None, False)

    def _fill(self, fb: ForwardBatch, counts: list[int], mode: DPPaddingMode) -> None:
        # A round may replay graphs (decode graphs in MAIN, verify graphs in SPEC) only as MAX_LEN.
        fb.init_mlp_sync_metadata(MLPSync(counts, counts, mode == DPPaddingMode.MAX_LEN), self.device)
        fb.mlp_sync.padding_mode = mode
        fb.dp_row_exchange = self.row_exchange

    def _split_if_it_pays(self, fb: ForwardBatch, proposals: list[Halves | None], speculative: bool,
                          any_extend: bool) -> bool:
        """Decide from every rank's proposed halves (the same on every rank) whether the step runs as
        two micro-batches; if so fill their MLP sync (``fb.mlp_sync.micro_batches``): each half
        exchanges its own rows, in the padding mode its own counts call for."""
        if self.tbo is None or any(p is None for p in proposals):
            return False
        halves = [(p[0:2], p[2:4]) for p in proposals if p is not None]
        tokens = [[half[i][1] for half in halves] for i in (0, 1)]
        if not dp_split_pays(tokens[0], tokens[1], self.tbo.min_tokens):
            return False
        syncs = []
        for i in (0, 1):
            sync = MLPSyncMetadata()
            original = [half[i][0] for half in halves] if speculative else tokens[i]
            sync.fill(tokens[i], tokens[i], original, False, self.device)
            sync.padding_mode = DPPaddingMode.choose(tokens[i], any_extend)
            syncs.append(sync)
        fb.mlp_sync.micro_batches = (syncs[0], syncs[1])
        return True


@dataclass
class IdleSpecInput:
    """``spec_info`` of a rank's IDLE batch in a speculative phase: no rows, but the phase's request
    width, so its count exchange scales the other ranks' request counts as they do."""

    num_tokens_per_req: int
    custom_mask: torch.Tensor


class DPAttentionRunner(ModelRunner):
    """A rank's ModelRunner under DP attention: exchanges counts before every forward, and joins every
    phase of a round (``RoundPhase``) it launched nothing in with an IDLE batch."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, groups: DistGroups) -> None:
        # The count sync and its row exchange exist before the graphs are captured
        # (ModelRunner.__init__), which record the exchange's copies and signals. A SUM_LEN round holds
        # at most a prefill chunk plus a decode token per running request (a verify round at most
        # num_draft_tokens per running request).
        device = use_rank_device(config, groups.tp)
        rows = max(config.prefill_token_budget(mc.context_length) + config.max_running_requests,
                   config.max_running_requests * (config.speculative_num_draft_tokens or 1))
        row_exchange = None if config.disable_copy_engine_rows else copy_engine_rows(
            groups.tp, groups.store, rows, mc.hidden_size, mc.dtype, device, timedelta(seconds=config.dist_timeout))
        # Decode graphs are captured as MAX_LEN steps of their bucket on every rank (init_capture_sync):
        # every rank captures the same buckets in the same order, so the recorded collectives pair up.
        tbo = (TboSettings(config.tbo_min_split_tokens, config.tbo_token_distribution_threshold)
               if config.enable_two_batch_overlap else None)
        self.count_sync = MLPCountSync(groups.control, device, row_exchange, tbo)
        super().__init__(config, mc, groups.tp)
        self.groups = groups
        # The phases of a round: a speculative engine verifies before the scheduler's own batch.
        self.phases = [RoundPhase.SPEC, RoundPhase.MAIN] if config.speculative_algorithm else [RoundPhase.MAIN]
        # Verify batches are padded to this width on every rank (the speculative workers pad them).
        self.spec_width = config.speculative_num_draft_tokens or 0
        self.joined: set[RoundPhase] = set()  # the phases of this round this rank has joined
        self.forwarded = False  # this round launched a forward
        self.padding_modes: Counter[str] = Counter()  # rounds per padding mode (tests, debugging)
        self.idle_rounds = 0  # rounds this rank joined with an IDLE batch
        self.phase_forwards: Counter[str] = Counter()  # forwards per round phase (tests, debugging)

    @property
    def rounds(self) -> deque[Round]:
        return self.count_sync.rounds

    @property
    def row_exchange(self) -> CopyEngineRows | None:
        """The symmetric-memory row exchange of the MLP rounds (None: NCCL collectives)."""
        return self.count_sync.row_exchange

    def init_capture_sync(self, fb: ForwardBatch) -> None:
        self.count_sync.capture(fb)

    def forward(self, fb: ForwardBatch, skip_attn_backend_init: bool | None = None) -> LogitsOutput:
        phase = RoundPhase.SPEC if fb.forward_mode.is_target_verify() else RoundPhase.MAIN
        if phase not in self.phases or phase in self.joined:
            raise RuntimeError(f"a second {phase.name} forward in one DP-attention round (phases joined: "
                               f"{sorted(p.name for p in self.joined)}): the ranks' collectives would not pair")
        for earlier in self.phases[: self.phases.index(phase)]:
            if earlier not in self.joined:
                self._join_idle(earlier)
        self.joined.add(phase)
        self.forwarded = True
        self.phase_forwards[phase.name] += 1
        self.count_sync.sync(fb)
        assert fb.mlp_sync.padding_mode is not None
        self.padding_modes[fb.mlp_sync.padding_mode.name] += 1
        return super().forward(fb, skip_attn_backend_init)

    def finish_round(self) -> None:
        """After the scheduler's step: every phase this rank launched nothing in is joined with an
        IDLE batch."""
        for phase in self.phases:
            if phase not in self.joined:
                self._join_idle(phase)
        self.joined.clear()
        self.forwarded = False

    def _join_idle(self, phase: RoundPhase) -> None:
        self.joined.add(phase)
        empty = torch.empty(0, dtype=torch.int64, device=self.device)
        spec = None
        if phase == RoundPhase.SPEC:
            spec = IdleSpecInput(self.spec_width, torch.empty(0, dtype=torch.bool, device=self.device))
        fb = ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=empty, req_pool_indices=empty,
                          seq_lens=empty, out_cache_loc=empty, positions=empty, spec_info=spec)
        self.count_sync.sync(fb)
        if not any(fb.mlp_sync.global_num_tokens_cpu or []):
            return  # no rank has work in this phase: nothing to join
        self.idle_rounds += 1
        self.forward_idle(fb)
    def close(self) -> None:
        self.count_sync.row_exchange = None  # its symmetric buffers go with the rest of the device memory
        super().close()

    @torch.inference_mode()
    def forward_idle(self, fb: ForwardBatch) -> LogitsOutput:
        verify_graphs = self.verify_graph_runner
        if fb.spec_info is not None and verify_graphs is not None and verify_graphs.can_run(fb):
            # The other ranks replay a verify graph: join it with a bucket of padding requests.
            fb.attn_backend = self.attn_backend
            return verify_graphs.replay(fb)
        if self.graph_runner is not None and self.graph_runner.can_run(fb):
            # The other ranks replay a decode graph: join it with a bucket of padding rows only.
            fb.attn_backend = self.attn_backend
            return self.graph_runner.replay(fb)
        # No attention work on this rank: only the MLP collectives of every layer, on zero rows; in a
        # step the others run as two micro-batches, those of each (two IDLE children), interleaved
        # as theirs are.
        hidden = torch.empty(0, self.model_config.hidden_size, dtype=self.model_config.dtype, device=self.device)
        halves = split_forward_batch(fb, TboSplit(0, 0, False)) if fb.mlp_sync.micro_batches is not None else None
        for layer in self.model.model.layers:
            if halves is None:
                layer.run_mlp(hidden, fb)  # the layer's own MLP path (gathered, or all-to-all MoE)
            else:
                run_overlapped(*(dp_mlp_ops(layer.mlp, hidden, half, self.tp) for half in halves))
        return LogitsOutput(next_token_logits=torch.empty(0, self.model_config.vocab_size, device=self.device))


class DPAttentionLeader(DPAttentionRunner):
    """Rank 0's runner: also watches the spawned ranks and tells them to stop."""

    def __init__(self, config: EngineConfig, mc: ModelConfig, groups: DistGroups, store: dist.Store,
                 procs: RankProcesses) -> None:
        super().__init__(config, mc, groups)
        self.store = store
        self.ranks = SpawnedRanks("DP-attention", procs, store)
        self.procs = procs  # rank -> process, for the ranks this process spawned

    @property
    def failure(self) -> str | None:
        return self.ranks.failure

    def check_ranks(self) -> None:
        self.ranks.check()

    def fail(self, e: Exception) -> TensorParallelError:
        return self.ranks.fail(e, self.config.dist_timeout)

    def close(self) -> None:
        if self.failure is None and not self.closed:
            try:
                exchange_objects(self.groups.control, DPControl(shutdown=True))
            except Exception:  # noqa: BLE001 (a dead rank cannot be told; it is killed below)
                logger.warning("could not tell the DP-attention ranks to shut down", exc_info=True)
        self.ranks.stop()
        super().close()


# --- rank 0: front end and balancer ------------------------------------------------------------------
class DPAttentionScheduler:
    """The Engine's scheduler under DP attention: rank 0's own Scheduler plus the other ranks'."""

    def __init__(self, config: EngineConfig, runner: DPAttentionLeader,
                 grammar_backend: GrammarBackend | None = None) -> None:
        self.config = config
        self.runner = runner
        self.dp_size = config.dp_size
        self.local = Scheduler(config, runner, create_spec_worker(config, runner), grammar_backend=grammar_backend)
        self.remote: dict[str, tuple[int, Req]] = {}  # rid -> (rank, stand-in Req)
        self._adds: list[tuple[int, NewRequest]] = []
        self._aborts: list[str] = []
        self.assigned: Counter[int] = Counter()  # requests sent to each rank (tests, metrics)
        # rank > 0 -> KV slots its scheduler held at its latest report (a round behind)
        self.remote_kv_tokens_in_use: dict[int, int] = {}

    @property
    def spec_worker(self) -> SpecWorker | None:
        return self.local.spec_worker  # rank 0's (each rank drafts and verifies its own requests)

    # --- the Scheduler interface the Engine uses ---------------------------------------------------
    def loads(self) -> list[int]:
        """Live requests per rank: the balancer's queue lengths."""
        loads = [0] * self.dp_size
        loads[0] = len(self.local.waiting) + self.local.num_running()
        for rank, _ in self.remote.values():
            loads[rank] += 1
        return loads

    def add_request(self, req: Req) -> None:
        loads = self.loads()
        rank = loads.index(min(loads))  # shortest queue; ties go to the lowest rank
        self.assigned[rank] += 1
        if rank == 0:
            self.local.add_request(req)
            return
        self.remote[req.rid] = (rank, req)
        self._adds.append((rank, NewRequest(req.rid, req.origin_input_ids, req.sampling_params, req.seed)))

    def abort(self, rid: str) -> bool:
        if self.local.abort(rid):
            return True
        if rid in self.remote:
            if self.runner.failure is not None:  # its rank cannot be reached: finish it here
                _, req = self.remote.pop(rid)
                self._adds = [(rank, new) for rank, new in self._adds if new.rid != rid]
                req.finish_reason, req.finish_message = FinishReason.ABORT, "aborted by the client"
                if req.detokenizer is not None:
                    req.detokenizer.finish()
            else:
                self._aborts.append(rid)
            return True
        return False

    def has_work(self) -> bool:
        return self.local.has_work() or bool(self.remote)  # every pending add is in self.remote too

    @property
    def waiting(self) -> list[Req]:
        return list(self.local.waiting)

    @property
    def prefilling(self) -> list[Req]:
        return list(self.local.prefilling)

    @property
    def running(self) -> list[Req]:
        return list(self.local.running) + [req for _, req in self.remote.values()]

    @property
    def stats(self) -> SchedulerStats:
        return self.local.stats  # rank 0's scheduler only

    @property
    def tree_cache(self) -> RadixCache:
        return self.local.tree_cache  # rank 0's prefix cache only

    @property
    def max_request_tokens(self) -> int:
        return self.local.max_request_tokens  # every rank's pool is sized alike

    @property
    def on_logits(self) -> LogitsObserver | None:
        return self.local.on_logits  # rank 0's sampled steps only

    @on_logits.setter
    def on_logits(self, hook: LogitsObserver | None) -> None:
        self.local.on_logits = hook

    def kv_tokens_in_use(self) -> int:
        return self.local.kv_tokens_in_use()  # rank 0's KV pool only

    def num_running(self) -> int:
        return self.local.num_running() + len(self.remote)

    def step(self) -> list[Req]:
        if self.runner.failure is not None and self._only_aborts_left():
            # No collective can run after a failure: wind the aborted requests down locally (the
            # scheduler retires them without a forward). Anything else raises below.
            return self.local.step()
        self.runner.check_ranks()
        msg = DPControl(self._adds, self._aborts)
        self._adds, self._aborts = [], []
        try:
            reports = exchange_objects(self.runner.groups.control, msg)
            for rank, report in enumerate(reports[1:], start=1):
                self.remote_kv_tokens_in_use[rank] = report.kv_tokens_in_use
            updated = [self._apply(p) for report in reports[1:] for p in report.progress]
            updated += self.local.step()
            self.runner.finish_round()
        except Exception as e:
            raise self.runner.fail(e) from e
        return updated

    def _only_aborts_left(self) -> bool:
        local = list(self.local.waiting) + self.local.prefilling + self.local.running
        return not self.remote and all(r.to_abort or r.finished for r in local)

    def flush(self) -> list[Req]:
        return self.local.flush()

    def close(self) -> None:
        self.local.close()

    def _apply(self, p: Progress) -> Req:
        _, req = self.remote[p.rid]
        detok = req.detokenizer
        req.output_ids.extend(p.token_ids)
        if detok is not None:
            detok.add_tokens(p.token_ids)
        req.output_logprobs += p.logprobs
        req.output_top_logprobs += p.top_logprobs
        req.cached_tokens, req.num_retractions = p.cached_tokens, p.num_retractions
        req.input_token_logprobs += p.input_token_logprobs
        req.input_top_logprobs += p.input_top_logprobs
        if p.finish_reason is not None:
            if detok is not None and p.finish_message == "stop string":
                detok.find_stop()
            req.finish_reason = FinishReason(p.finish_reason)
            req.finish_message = p.finish_message
            if detok is not None:
                detok.finish()
            del self.remote[p.rid]
        return req


# --- ranks > 0 ----------------------------------------------------------------------------------------
def dp_worker_loop(config: EngineConfig, runner: DPAttentionRunner) -> None:
    """Serve the requests rank 0 assigns to this rank, one lockstep round per engine step."""
    from plait.models.loader import load_config_tokenizer
    from plait.parallel.step_sync import IDLE_WAIT
    from plait.sampling.grammar import grammar_backend_for
    from plait.scheduler.detokenizer import IncrementalDetokenizer, prepare_tokenizer

    tokenizer = load_config_tokenizer(config)
    prepare_tokenizer(tokenizer)
    # Each rank compiles and applies the grammars of the requests it schedules.
    scheduler = Scheduler(config, runner, create_spec_worker(config, runner),
                          grammar_backend=grammar_backend_for(tokenizer, runner.model_config))
    control = runner.groups.control
    live: dict[str, tuple[Req, int]] = {}  # rid -> (request, tokens reported)
    while True:
        report = RankReport(_progress(live), scheduler.kv_tokens_in_use())
        msg: DPControl = exchange_objects(control, report, timeout=IDLE_WAIT)[0]
        if msg.shutdown:
            return
        for rank, new in msg.adds:
            if rank != control.rank:
                continue
            sp = new.sampling_params
            # Rank 0 makes the text from the progress reports: this rank decodes only to match stop strings.
            detok = IncrementalDetokenizer.for_request(tokenizer, new.input_ids, sp) if sp.stop else None
            req = Req(rid=new.rid, origin_input_ids=new.input_ids, sampling_params=sp, seed=new.seed,
                      detokenizer=detok)
            live[new.rid] = (req, 0)
            scheduler.add_request(req)
        for rid in msg.aborts:
            scheduler.abort(rid)
        scheduler.step()
        runner.finish_round()


def _progress(live: dict[str, tuple[Req, int]]) -> list[Progress]:
    out: list[Progress] = []
    for rid, (req, sent) in list(live.items()):
        n = len(req.output_ids)
        if n == sent and not req.finished:
            continue
        out.append(Progress(rid, req.output_ids[sent:n], req.output_logprobs[sent:n],
                            req.output_top_logprobs[sent:n], req.cached_tokens, req.num_retractions,
                            req.finish_reason.value if req.finish_reason else None, req.finish_message,
                            req.input_token_logprobs if sent == 0 else [], req.input_top_logprobs if sent == 0 else []))
        if req.finished:
            del live[rid]
        else:
            live[rid] = (req, n)
    return out
