"""The speculative step: draft trees for the running requests, verify them in one TARGET_VERIFY
forward, accept, and commit (``BaseSpecWorker``; drafting is the subclass's ``propose``).

Flow per scheduler step (called before the scheduler builds its own batch, overlap drained):
  1. eligible requests (greedy or plain temperature/top-k/top-p/min-p sampling; no penalties,
     logprobs or pending min_new_tokens, which need the full sampler) get a draft tree from the
     drafter; eligible requests with no proposal, or no room for a guess (one token left), ride
     along as root-only trees (their verify row is their decode row: one forward per step, not a
     verify plus a decode of the rest);
     ineligible requests are left to the scheduler's normal decode;
  2. one KV slot per tree node, tree tokens at ``prefix_len + depth``, custom ancestor mask
     (``plait.speculative.verify_batch``); the forward runs through ``ModelRunner.forward`` (eager:
     the backend plans inside ``forward_extend``, after the batch has its final shape);
  3. acceptance per request (``plait.speculative.accept``), on logits masked per tree node for
     constrained requests (``mask_tree_logits``);
  4. the accepted nodes' slots are mapped to consecutive positions (tree order is not path order, so
     entries are rewritten rather than KV moved); every other node's slot is freed at once; the
     accepted tokens and the bonus token are committed through the scheduler
     (``SchedulerAPI.commit_tokens``, with its stop checks).
The scheduler is reached only through ``plait.scheduler.interface.SchedulerAPI``.
"""

from __future__ import annotations

import contextlib
import logging
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

import torch

from plait import envs
from plait.config import EngineConfig
from plait.forward_batch import ForwardBatch
from plait.sampling import Sampler
from plait.scheduler.interface import SchedulerAPI
from plait.scheduler.req import Req
from plait.speculative.accept import accept_trees, mask_tree_logits
from plait.speculative.tree import DraftTree
from plait.speculative.verify_batch import TreeRow, build_verify_batch, chain_verify_batch_after
from plait.transfer import PendingHostCopy, ints_to_device

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner
    from plait.models.llama import LogitsOutput

logger = logging.getLogger(__name__)

LOG_HISTOGRAM_EVERY = 256  # verify steps between acceptance-histogram log lines
EMA_DECAY = 0.5  # weight of the past in the per-request acceptance average
MISS_BACKOFF_MAX = 8  # longest run of plain decode steps after repeated misses (see BaseSpecWorker)
# A step verifies only when at least this fraction of the candidate requests has a draft (the rest
# ride along as root-only rows); below it the step is a miss (plain, overlapped decoding).
MIN_DRAFTING_FRACTION = 0.25
# Most verify forwards one scheduler step chains (see BaseSpecWorker.verify): the scheduler streams
# outputs, admits and aborts between its steps, so a longer chain delays those.
MAX_CHAINED_VERIFIES = 8
# A verify is launched ahead of its predecessor's result (BaseSpecWorker.launch_ahead) only when at
# least this fraction of its requests accepted their whole chain in their latest verify: the drafts
# it bets on are then the likely ones. Below it (at bs 1: the request left the drafted text) the host
# reads the outcome first and may end the chain, where ahead the batch would verify filler guesses.
AHEAD_MIN_WHOLE_FRACTION = 0.5

AcceptResult = tuple[list[int], int]  # (accepted path from the root, bonus token)
T = TypeVar("T")


@dataclass
class SpecStats:
    verify_steps: int = 0  # TARGET_VERIFY forwards
    verified_requests: int = 0  # request-steps verified
    launched_ahead: int = 0  # verifies launched before the previous verify's result was read
    # why a chained verify was not launched ahead (``BaseSpecWorker.ahead_refusal``) -> count
    ahead_declined: Counter[str] = field(default_factory=Counter)
    # verifies staged for their guessed outcome (``BaseSpecWorker.stage_guess``): "hit" (launched as
    # staged), "miss" (another outcome arrived: dropped)
    staged: Counter[str] = field(default_factory=Counter)
    # scheduler steps that verified nothing, by cause: "miss" (too few requests had a draft), "back-off"
    # (a miss's back-off sat the step out without asking the drafter), "no drafter" (no request had
    # room for a guess), "no KV" (too few free slots for the drafts)
    plain_steps: Counter[str] = field(default_factory=Counter)
    # accepted draft tokens per request-step -> count (the step gained that many + 1 tokens)
    accept_histogram: Counter[int] = field(default_factory=Counter)

    def mean_accept_length(self) -> float:
        n = sum(self.accept_histogram.values())
        return sum((k + 1) * c for k, c in self.accept_histogram.items()) / n if n else 0.0


def reads_argmax_only(req: Req) -> bool:
    """Whether acceptance reads only the argmax of ``req``'s rows: greedy (the sampler's rule) and
    unconstrained (a grammar masks the rows first)."""
    return req.grammar is None and req.sampling_params.samples_argmax


def _argmax_copy(reqs: Sequence[Req], greedy: torch.Tensor | None) -> PendingHostCopy | None:
    """The verify's argmax copy to the host, started now, where acceptance reads nothing else."""
    return PendingHostCopy.start(greedy) if greedy is not None and all(map(reads_argmax_only, reqs)) else None


@dataclass
class VerifyStep:
    """A launched verify forward whose result the host has not read yet."""

    reqs: list[Req]
    trees: list[DraftTree]
    slots: torch.Tensor  # int64 [sum(widths)]: the nodes' KV slots, tree order
    row_widths: list[int]  # logits rows per request (its padded width)
    logits: torch.Tensor  # float32 [rows, V]
    greedy: torch.Tensor | None  # the logits' argmax when the forward computed it (verify graphs)
    premapped: bool = False  # every node's slot mapped at its position at the launch (chains)
    # The argmax's copy to the host, started at the launch where acceptance reads nothing else (every
    # request greedy and unconstrained, ``_argmax_copy``); then acceptance reads only this, and a verify
    # launched ahead past this one may overwrite ``logits`` and ``greedy`` (the graphs' shared buffers).
    greedy_host: PendingHostCopy | None = None
    # [start, end) ranges of ``slots`` that acceptance rejected and ``commit_tokens`` frees (a premapped
    # batch's: off the path to the next launch, since nothing maps them and no one else holds them).
    rejected: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class AheadVerify:
    """A verify of chains launched before the previous verify's result was read
    (``BaseSpecWorker.launch_ahead``): the device chose its tokens from that result, so the host
    learns its trees only once it reads the result (``resolve_ahead``)."""

    slots: torch.Tensor  # int64 [bs * W], every node's KV slot (mapped at the launch)
    width: int
    next_drafts: list[list[list[int]]]  # [request][drafts accepted before] -> the W - 1 drafts verified
    logits: torch.Tensor
    greedy: torch.Tensor | None
    greedy_host: PendingHostCopy | None  # ``greedy``'s copy to the host, started at the launch


@dataclass
class StagedVerify:
    """The verify after a running one, built and staged for one outcome of it before its result was read
    (``BaseSpecWorker.stage_guess``): launched if that outcome arrives, else its slots are freed."""

    results: list[AcceptResult | None]  # the outcome it was built for, per request (no None)
    reqs: list[Req]
    trees: list[DraftTree]
    slots: torch.Tensor
    fb: ForwardBatch
    pad_width: int | None
    launch: Callable[[], LogitsOutput]  # the graph's launch (ModelRunner.stage)
    undo: Callable[[], None]  # puts the drafter's bookkeeping back as before the staging (a miss)


def _restore(table: dict[str, T], key: str, value: T | None) -> None:
    """``table[key] = value``, or no entry when ``value`` is None."""
    if value is None:
        table.pop(key, None)
    else:
        table[key] = value


class BaseSpecWorker(ABC):
    """Drafting is the subclass's ``propose``; verification and bookkeeping live here. Satisfies
    ``plait.scheduler.interface.SpecWorker``."""

    # Whether admitted requests with a cached prompt join verify steps (see decode_step). Not for
    # draft models: they must see the prompt themselves (after_target_forward) before drafting.
    joins_admissions = False
    # Whether the next verify can launch from a verify's outcome before its tokens are committed
    # (``propose_after``): a drafter that needs the committed state or a draft model's forward first
    # leaves it off. Chains run on one rank only (TP and DP attention ranks follow a step's forwards).
    chains_verify = False

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        assert config.speculative_num_steps and config.speculative_eagle_topk and config.speculative_num_draft_tokens
        self.config = config
        self.runner = runner
        self.num_steps = config.speculative_num_steps
        self.topk = config.speculative_eagle_topk
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.stats = SpecStats()
        self.sampler = Sampler()
        self.eos_token_ids = runner.model_config.eos_token_ids
        self.chains_verify = (self.chains_verify and envs.SPEC_CHAIN_VERIFIES.get() and config.tp_size == 1
                              and not config.enable_dp_attention)
        # Launching a chain's next verify before the current one's result is read (``launch_ahead``):
        # chains without a mask, whole batches (no two-batch split, which plans from the host lists).
        self.launches_ahead = (self.chains_verify and envs.SPEC_LAUNCH_AHEAD.get() and config.causal_chain_verify
                               and not config.enable_two_batch_overlap)
        # Staging a chain's next verify for its guessed outcome while the current one runs (``stage_guess``).
        self.stages_next = (self.chains_verify and envs.SPEC_STAGE_NEXT.get() and config.causal_chain_verify
                            and not config.enable_two_batch_overlap)
        # Adaptive draft depth: per request, a moving average of accepted drafts per step. Depth is
        # that average + 1 (at most num_steps), so a request whose guesses keep failing verifies
        # short drafts, and one whose guesses land goes back to full depth.
        self.accept_ema: dict[str, float] = {}
        # Per request, whether its latest verify accepted every draft (AHEAD_MIN_WHOLE_FRACTION).
        self.accepted_all: dict[str, bool] = {}
        # Miss back-off: a speculative step drains the overlapped batch first (drafting needs every
        # token on the host). After a step where requests could speculate but nothing was proposed
        # (an n-gram miss), the next ``_skip`` steps decode normally, overlapped; the pause doubles
        # on each further miss up to MISS_BACKOFF_MAX steps and resets on a proposal.
        self._skip = 0
        self._backoff = 1

    # --- hooks the scheduler calls ----------------------------------------------------------------
    def on_finish(self, req: Req) -> None:
        """A request finished (any reason). Subclasses call this too."""
        self.accept_ema.pop(req.rid, None)
        self.accepted_all.pop(req.rid, None)

    def after_target_forward(self, fb: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """The scheduler ran a plain (non-speculative) target forward."""

    @abstractmethod
    def propose(self, sched: SchedulerAPI, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        """One draft tree per request (None: it decodes normally this step), at most max_depths deep."""

    def on_idle(self, sched: SchedulerAPI) -> None:
        """The scheduler ran out of work: run the deferred work (nothing is left to hide it behind)
        and forget the miss back-off (the next requests deserve their own first try)."""
        self._skip, self._backoff = 0, 1
        self.deferred_work(sched)

    def deferred_work(self, sched: SchedulerAPI) -> None:  # noqa: B027 (optional hook)
        """Host work the next launch does not need. Runs where it costs the GPU nothing: between a
        verify launch and its acceptance (the forward is queued), after a step that launched no
        verify (plain, overlapped decode steps follow), and when the scheduler runs out of work."""

    def reset(self) -> None:
        """Back to a new worker's state (after the engine's warm-up). Subclasses call this too."""
        self.stats = SpecStats()
        self.accept_ema.clear()
        self.accepted_all.clear()
        self._skip, self._backoff = 0, 1

    def close(self) -> None:  # noqa: B027 (optional hook)
        """The engine is shutting down: drop device memory (statistics stay readable)."""

    # --- the step ---------------------------------------------------------------------------------
    def _max_depth(self, req: Req) -> int | None:
        """How deep a tree may go for ``req`` now. None: it cannot take part in a verify step (it
        needs the full sampler, or has no pending decode); 0: it may ride along as a root-only row
        (no room for a guess, e.g. one token left) but draft nothing."""
        sp = req.sampling_params
        if (req.pending or req.finished or req.to_abort or sp.has_penalties or sp.logit_bias or sp.logprobs
                or sp.top_logprobs or len(req.output_ids) < sp.min_new_tokens or req.kv_len != req.fill_len - 1):
            return None
        return max(0, self._depth_limit(req, 0))

    def joins_next_verify(self, req: Req) -> bool:
        return self.joins_admissions and req.fill_len - req.kv_len == 1 and self._max_depth(req) is not None

    def should_speculate(self) -> bool:
        """Whether this scheduler step speculates (False: a plain, overlapped decode step)."""
        if self._skip > 0:
            self._skip -= 1
            self.stats.plain_steps["back-off"] += 1
            return False
        return True

    def decode_step(self, sched: SchedulerAPI) -> set[int]:
        """Speculate for the running requests; returns ``id()`` of the requests that advanced."""
        joining: list[Req] = []
        if self.joins_admissions:
            # Admitted requests whose prompt is cached but for its last token need one forward row,
            # like a decode: they join this verify (drafting from their prompt) instead of costing
            # the step a separate prefill forward after it.
            sched.admit()
            joining = [r for r in sched.prefilling if r.fill_len - r.kv_len == 1]
        cands, depths = [], []
        for r in [*sched.running, *joining]:
            d = self._max_depth(r)
            if d is not None:
                cands.append(r)
                depths.append(d)
        drafters = [i for i, d in enumerate(depths) if d > 0]
        if not drafters:
            if cands:
                self.stats.plain_steps["no drafter"] += 1
            self.deferred_work(sched)
            return set()
        # Requests without room for a guess ride along (their verify row is their decode row) rather
        # than costing the step a second forward; they are not asked to draft.
        proposed: list[DraftTree | None] = [None] * len(cands)
        drafted = self.propose(sched, [cands[i] for i in drafters], [depths[i] for i in drafters])
        for i, tree in zip(drafters, drafted, strict=True):
            proposed[i] = tree
        # A verify step costs every candidate a verify row and the step its overlap; when only a few
        # requests have guesses (sporadic matches among misses) plain overlapped decoding is cheaper:
        # such a step counts as a miss.
        drafting = sum(t is not None for t in proposed)
        if drafting == 0 or drafting < MIN_DRAFTING_FRACTION * len(drafters):
            self._skip, self._backoff = self._backoff, min(2 * self._backoff, MISS_BACKOFF_MAX)
            self.stats.plain_steps["miss"] += 1
            self.deferred_work(sched)
            return set()
        self._backoff = 1
        trees = [t if t is not None else DraftTree([r.last_token], [-1])
                 for r, t in zip(cands, proposed, strict=True)]
        need = sum(t.width for t in trees)
        # Leave room for the normal decode of everyone else; when short, skip speculation this step
        # and let the scheduler's decode path evict or retract as it always does.
        others = len(sched.running) + len(joining) - len(cands)
        slots = sched.alloc_kv_slots(need) if sched.available_kv_tokens() >= need + others else None
        if slots is None:
            self.stats.plain_steps["no KV"] += 1
            return set()
        return self.verify(sched, cands, trees, slots)  # joiners now have their first token: they decode

    def build_verify_batch(self, rows: Sequence[TreeRow], trees: list[DraftTree], slots: torch.Tensor,
                           pad_width: int | None = None) -> ForwardBatch:
        """The TARGET_VERIFY batch of ``trees`` on this worker's device (``verify_batch.build_verify_batch``)."""
        return build_verify_batch(rows, trees, slots, self.runner.device, pad_width=pad_width,
                                  causal_chains=self.config.causal_chain_verify)

    def graph_pad_width(self, trees: list[DraftTree]) -> int | None:
        """The width to pad a verify batch of mixed widths to, when a captured graph then runs it
        (the adaptive depth gives requests different widths; eager verify costs several graph
        replays). None: the widths are uniform already, or no graph would take the batch."""
        graphs = self.runner.verify_graph_runner
        widths = {t.width for t in trees}
        if graphs is None or len(widths) == 1 or len(trees) > graphs.max_bs or max(widths) not in graphs.widths:
            return None
        return max(widths)

    def verify_pad_width(self, trees: list[DraftTree]) -> int | None:
        """The width every request's verify block is padded to (None: unpadded). Under DP attention
        every rank pads to ``num_draft_tokens``, the widest tree the config allows: a verify round's
        rows then have one width on every rank, so the ranks' request counts scale to their token
        counts (``ForwardBatch.init_mlp_sync_metadata``) whatever depths the adaptive drafts took."""
        if self.config.enable_dp_attention:
            assert max(t.width for t in trees) <= self.num_draft_tokens
            return self.num_draft_tokens
        return self.graph_pad_width(trees)

    def verify(self, sched: SchedulerAPI, reqs: list[Req], trees: list[DraftTree], slots: torch.Tensor) -> set[int]:
        """Verify ``trees`` and, while nothing else needs the scheduler, the steps after it (a chain,
        see ``next_verify``); returns ``id()`` of every request that advanced.

        Per verify, the host work splits at its result. Before the next launch: acceptance, the
        accepted nodes' KV mapping (``commit_kv``; after the launch of a verify staged for this outcome)
        and the next step's batch from the proposals prepared for the outcome that arrived. After it,
        hidden behind the queued forward: the tokens' commit (stop checks, detokenization, retiring;
        ``commit_tokens``), the deferred work and the pre-drafting of the step just launched."""
        step = self.launch_verify(sched, reqs, trees, slots)
        advanced: set[int] = set()
        done: tuple[VerifyStep, list[AcceptResult | None]] | None = None  # accepted, tokens not committed
        chained = 0
        while True:
            # The forward of ``step`` is queued: host work done now is hidden behind it.
            if done is not None:
                self.commit_tokens(sched, *done)
            self.deferred_work(sched)
            live = [i for i, r in enumerate(step.reqs) if not r.finished]  # a commit may have finished some
            self.predraft([step.reqs[i] for i in live], [step.trees[i] for i in live])
            ahead = self.launch_ahead(sched, step) if chained < MAX_CHAINED_VERIFIES else None
            staged = self.stage_guess(sched, step) if ahead is None and chained < MAX_CHAINED_VERIFIES else None
            results = self.accept_step(step)
            advanced.update(id(r) for r in step.reqs)
            if staged is not None and results == staged.results:
                # Built from the state this outcome leaves: launch it as is. A premapped step's commit_kv
                # is host bookkeeping only, which the staged batch already applied, so it follows the
                # launch; the new step's premap reads the KV lengths it leaves.
                self.stats.staged["hit"] += 1
                out = staged.launch()
                self.commit_kv(sched, step, results)
                done = (step, results)
                step = self._launched(sched, staged.reqs, staged.trees, staged.slots, staged.fb, staged.pad_width, out)
                chained += 1
                continue
            self.commit_kv(sched, step, results)
            if ahead is not None:  # queued behind ``step`` already: the GPU did not wait for this host work
                done = (step, results)
                step = self.resolve_ahead(step, results, ahead)
                chained += 1
                continue
            if staged is not None:
                self.stats.staged["miss"] += 1
                staged.undo()
                sched.free_kv_slots(staged.slots)
            nxt = self.next_verify(sched, step, results) if chained < MAX_CHAINED_VERIFIES else None
            if nxt is None:
                self.commit_tokens(sched, step, results)
                return advanced
            done = (step, results)
            step = self.launch_verify(sched, *nxt)
            chained += 1

    def launch_verify(self, sched: SchedulerAPI, reqs: list[Req], trees: list[DraftTree], slots: torch.Tensor
                      ) -> VerifyStep:
        """Queue the verify forward of ``trees`` (no host sync)."""
        pad_width = self.verify_pad_width(trees)
        fb = self.build_verify_batch(reqs, trees, slots, pad_width=pad_width)
        return self._launched(sched, reqs, trees, slots, fb, pad_width, self.runner.forward(fb))

    def _launched(self, sched: SchedulerAPI, reqs: list[Req], trees: list[DraftTree], slots: torch.Tensor,
                  fb: ForwardBatch, pad_width: int | None, out: LogitsOutput) -> VerifyStep:
        """The ``VerifyStep`` of a verify batch whose forward was just queued (``out``: logits
        [sum(num_tokens_per_req), V] float32)."""
        # The argmax's copy to the host goes first, right behind the forward: the host work queued after
        # it (the KV premap, the previous step's commit, the next verify's staging) then runs on the
        # device while the host reads the result, not before the result is there.
        greedy_host = _argmax_copy(reqs, out.greedy_ids)
        # Queued behind the forward, which reads only the prefix's map (the nodes' KV it takes from
        # out_cache_loc): off the path to the launch.
        premapped = self.premap_chains(sched, fb, trees, pad_width)
        self.after_verify_forward(fb)
        sched.stats.forward_steps += 1
        return VerifyStep(reqs, trees, slots, fb.spec_info.num_tokens_per_req, out.next_token_logits, out.greedy_ids,
                          premapped, greedy_host)

    def stage_guess(self, sched: SchedulerAPI, step: VerifyStep) -> StagedVerify | None:
        """Build and stage the verify after ``step`` for its guessed outcome, before ``step``'s result is
        read, or None. The guess: every request accepts its whole chain and gets the bonus its drafter
        guessed (``guessed_bonus``). The next verify is what ``next_verify`` gives once that outcome is
        committed (its KV lengths and acceptance averages applied for the call, then restored); its slots
        are allocated and its graph's buffers filled and planned (``ModelRunner.stage``), queued behind
        ``step``. If the outcome arrives, the verify launches with no host work left before it; otherwise
        its slots are freed and the next verify is built as without a guess: a wrong guess costs host time
        spent while the GPU was busy, never acceptance."""
        if not self.stages_next or not step.premapped or step.greedy is None or self.runner.verify_graph_runner is None:
            return None
        if any(w != t.width for w, t in zip(step.row_widths, step.trees, strict=True)):
            return None
        guessed: list[AcceptResult | None] = []
        for req, tree in zip(step.reqs, step.trees, strict=True):
            if not tree.is_chain or tree.width < 2 or not self._verifies_ahead(req, tree.width):
                return None
            bonus = self.guessed_bonus(req, tree)
            if bonus is None:
                return None
            guessed.append((list(range(tree.width)), bonus))
        undo = self.undo_point()
        with self._as_accepted(step, guessed):
            nxt = self.next_verify(sched, step, guessed)
            if nxt is None:
                undo()
                return None
            reqs, trees, slots = nxt
            pad_width = self.verify_pad_width(trees)
            fb = self.build_verify_batch(reqs, trees, slots, pad_width=pad_width)
        launch = self.runner.stage(fb)
        if launch is None:  # no graph replays it: nothing to gain from building it early
            undo()
            sched.free_kv_slots(slots)
            return None
        return StagedVerify(guessed, reqs, trees, slots, fb, pad_width, launch, undo)

    @contextlib.contextmanager
    def _as_accepted(self, step: VerifyStep, results: list[AcceptResult | None]) -> Iterator[None]:
        """The requests of ``step`` as ``commit_kv`` leaves them after ``results`` (their KV lengths and
        acceptance averages), for the block only."""
        saved = [(r.kv_len, self.accept_ema.get(r.rid), self.accepted_all.get(r.rid)) for r in step.reqs]
        try:
            for req, tree, res in zip(step.reqs, step.trees, results, strict=True):
                assert res is not None
                req.kv_len += len(res[0])
                self._note_acceptance(req, tree.width, len(res[0]))
            yield
        finally:
            for req, (kv_len, ema, whole) in zip(step.reqs, saved, strict=True):
                req.kv_len = kv_len
                _restore(self.accept_ema, req.rid, ema)
                _restore(self.accepted_all, req.rid, whole)

    def guessed_bonus(self, req: Req, tree: DraftTree) -> int | None:
        """The bonus token the drafter guesses after ``req`` accepts every node of ``tree`` (a chain just
        pre-drafted), or None (no guess: ``stage_guess`` stages nothing)."""
        return None

    def undo_point(self) -> Callable[[], None]:
        """A call that puts back what ``propose_after`` changes in the drafter's bookkeeping (counters,
        cooling), as it is now: a staged guess that missed then leaves no trace (``stage_guess``)."""
        return lambda: None

    def launch_ahead(self, sched: SchedulerAPI, step: VerifyStep) -> AheadVerify | None:
        """Queue the verify after ``step`` before its result is read, or None (the host reads it first).

        For a batch of greedy chains padded to ``W`` rows each, every outcome of ``step`` (``a`` drafts
        accepted, then the argmax after them as the bonus) has its next ``W - 1`` drafts prepared
        (``ahead_drafts``: those drafted while ``step`` ran, for the bonus the drafter guessed); the
        device picks the outcome that arrived (``chain_verify_batch_after``), so the GPU goes from one
        verify to the next without waiting for the host. Every request's next chain is ``W`` wide: a
        request whose acceptance average asked for a shorter one verifies the batch's padding rows as
        drafts instead. A request that a stop token ends is found when the tokens are committed, and
        its rows of the verify launched ahead are dropped (``accept_step``). Where not (``ahead_refusal``)
        the host reads the result first."""
        if not self.launches_ahead:
            return None
        reqs, trees = step.reqs, step.trees
        width = step.row_widths[0]
        refusal = self.ahead_refusal(sched, step)
        next_drafts = self.ahead_drafts(reqs, trees, width) if refusal is None else None
        if next_drafts is None:
            self.stats.ahead_declined[refusal or "drafts not prepared"] += 1
            return None
        slots = sched.alloc_kv_slots(len(reqs) * width)
        if slots is None:
            self.stats.ahead_declined["no KV slots"] += 1
            return None
        # The graphs share one output buffer, which this launch overwrites: the step's argmax, all that
        # greedy acceptance reads, has its copy to the host started (at its launch, ``_argmax_copy``) before
        # this one, and the device reads it below before the launch.
        assert step.greedy_host is not None, "a chain launched ahead is greedy and unconstrained"
        # One asynchronous copy (a synchronous one would wait for the queued verify).
        kv_lens_cpu = [r.kv_len for r in reqs]
        # A padding row's guess is -1, which no argmax equals: acceptance stops at a chain's real end.
        guesses, kv_lens, pool_rows, table = ints_to_device(
            [[g for t in trees for g in t.tokens[1:] + [-1] * (width - t.width)], kv_lens_cpu, [r.row for r in reqs],
             [g for per_req in next_drafts for drafts in per_req for g in drafts]], step.logits.device)
        bs = len(reqs)
        fb = chain_verify_batch_after(step.greedy.view(bs, width), guesses.view(bs, width - 1),
                                      table.view(bs, width, width - 1), kv_lens, kv_lens_cpu, pool_rows, slots)
        out = self.runner.forward(fb)
        # Queued behind the forward, as premap_chains: node i at the position the device chose.
        sched.map_kv_slots(pool_rows[:, None].expand(bs, width).reshape(-1), fb.positions, slots)
        self.after_verify_forward(fb)
        sched.stats.forward_steps += 1
        self.stats.launched_ahead += 1
        return AheadVerify(slots, width, next_drafts, out.next_token_logits, out.greedy_ids,
                           _argmax_copy(reqs, out.greedy_ids))

    def ahead_refusal(self, sched: SchedulerAPI, step: VerifyStep) -> str | None:
        """Why the verify after ``step`` may not be launched ahead (``launch_ahead``), or None."""
        reqs, trees = step.reqs, step.trees
        width = step.row_widths[0]
        graphs = self.runner.verify_graph_runner
        if not step.premapped or step.greedy is None or width < 2 or not all(t.is_chain for t in trees):
            return "not a premapped greedy chain"
        if any(w != width for w in step.row_widths):
            return "unpadded mixed widths"
        if graphs is None or not graphs.replays(len(reqs), width, masked=False):
            return "no verify graph"
        if not self._holds_only(sched, reqs):
            return "other requests held"
        if not all(self._verifies_ahead(r, width) for r in reqs):
            return "a request may leave the chain"
        if sum(self.accepted_all.get(r.rid, False) for r in reqs) < AHEAD_MIN_WHOLE_FRACTION * len(reqs):
            return "under half accepted whole chains"
        return None

    def resolve_ahead(self, step: VerifyStep, results: list[AcceptResult | None], ahead: AheadVerify) -> VerifyStep:
        """The ``VerifyStep`` of ``ahead`` once ``step``'s outcome is known on the host: each request's
        chain is its bonus and the drafts prepared for its outcome, as the device chose."""
        trees = []
        for res, per_outcome in zip(results, ahead.next_drafts, strict=True):
            assert res is not None, "launch_ahead runs only while no request of the step has finished"
            path, bonus = res
            trees.append(DraftTree.chain(bonus, per_outcome[len(path) - 1]))
        return VerifyStep(step.reqs, trees, ahead.slots, [ahead.width] * len(trees), ahead.logits, ahead.greedy,
                          premapped=True, greedy_host=ahead.greedy_host)

    def _holds_only(self, sched: SchedulerAPI, reqs: list[Req]) -> bool:
        """Whether ``reqs`` are all the scheduler holds (nothing else to decode, prefill or admit), none
        to abort: a chain may go on."""
        ids = {id(r) for r in reqs}
        return (len(sched.running) + len(sched.prefilling) == len(reqs)
                and all(id(r) in ids and not r.to_abort for r in (*sched.running, *sched.prefilling)))

    def _verifies_ahead(self, req: Req, width: int) -> bool:
        """Whether ``req`` may verify a chain ``width`` wide whatever its current verify (at most ``width``
        wide) gains: greedy and unconstrained, not finished, and after the most that verify can add,
        still ``width - 1`` drafts of room in its lengths (its acceptance average aside: the batch's
        rows are ``width`` wide anyway)."""
        sp = req.sampling_params
        if req.finished or not reads_argmax_only(req):
            return False
        if req.kv_len != req.fill_len - 1 or len(req.output_ids) + 1 < sp.min_new_tokens:
            return False
        return self._room_limit(req, width) >= width - 1  # after the most the current verify adds

    def ahead_drafts(self, reqs: list[Req], trees: list[DraftTree], width: int) -> list[list[list[int]]] | None:
        """Per request of a verify of ``trees`` (chains at most ``width`` wide), and per number ``a`` of its
        drafts accepted, the ``width - 1`` drafts to verify next (``launch_ahead``); None: not prepared."""
        return None

    def premap_chains(self, sched: SchedulerAPI, fb: ForwardBatch, trees: list[DraftTree], pad_width: int | None
                      ) -> bool:
        """Map every node of a batch of chains to its position once its forward is queued, from the
        batch's own device tensors (no copy). Node i of a chain sits at ``kv_len + i``, so whatever the
        verify accepts (nodes 0..n-1) is mapped already; the rest lies past the new ``kv_len``, where
        nothing reads (the next verify maps its own nodes there). Acceptance then only frees the
        rejected slots (``commit_kv``). Only where every row's nodes have distinct positions: requests at the
        padded width, or root-only rows (their dummy nodes land past the new ``kv_len`` too). Off for
        workers that do not chain (a draft model reads the target's map its own way)."""
        if not self.chains_verify or fb.extend is None:
            return False
        width = pad_width or trees[0].width
        # Padding after each chain (a batch without a mask) puts the dummy nodes one position past
        # the real ones (mapped to the dummy slot, where nothing reads).
        chain_padded = fb.spec_info.custom_mask is None
        if not all(t.is_chain and (chain_padded or t.width == width or t.width == 1) for t in trees):
            return False
        if pad_width is None and any(t.width != width for t in trees):
            return False
        rows = fb.req_pool_indices[:, None].expand(len(trees), width).reshape(-1)
        sched.map_kv_slots(rows, fb.positions, fb.out_cache_loc)
        return True

    def accept_step(self, step: VerifyStep) -> list[AcceptResult | None]:
        """``(path, bonus)`` per request of a launched verify (waits for its result); None for a request
        that finished since the launch (a stop the previous step's commit found): its nodes are dropped."""
        reqs, trees = step.reqs, step.trees
        logits, greedy = step.logits, step.greedy
        if any(r.grammar is not None for r in reqs):
            # Constrained requests: every node's row is masked by the grammar state after the path
            # to it, so acceptance picks what non-speculative constrained decoding would.
            logits, greedy = mask_tree_logits(reqs, trees, logits, step.row_widths), None
        results = self.accept(reqs, trees, logits, row_widths=step.row_widths, greedy=greedy,
                              greedy_host=step.greedy_host)
        return [None if r.finished else res for r, res in zip(reqs, results, strict=True)]

    def accept(self, reqs: Sequence[Req], trees: list[DraftTree], logits: torch.Tensor,
               row_widths: list[int] | None = None, greedy: torch.Tensor | None = None,
               greedy_host: PendingHostCopy | None = None) -> list[AcceptResult]:
        """``(path, bonus)`` per request (``plait.speculative.accept.accept_trees``)."""
        return accept_trees(reqs, trees, logits, self.sampler.use_triton, self.topk + 2, row_widths, greedy,
                            greedy_host)

    def commit_kv(self, sched: SchedulerAPI, step: VerifyStep, results: list[AcceptResult | None]) -> None:
        """The accepted nodes' KV in place (``req_to_token``, ``kv_len``), every other node's slot freed,
        the acceptance averages updated: what the next verify launch needs. Tokens are not appended."""
        reqs, trees, slots = step.reqs, step.trees, step.slots
        if step.premapped:
            self._commit_premapped(sched, step, results)
            return
        old_kv_lens = [r.kv_len for r in reqs]
        # Accepted nodes go to consecutive positions after the prefix, in path order: one scatter
        # into req_to_token for the whole batch (pool row, position), and every other node's slot
        # is freed. Both slot lists come from one gather of node indices built on the host (a
        # boolean-mask gather on the device would wait for the GPU queue, nonzero, mid-step).
        nodes: list[int] = []  # accepted node indices in ``slots``, then the rejected ones
        rejected: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        start = 0
        for req, tree, res in zip(reqs, trees, results, strict=True):
            w = tree.width
            if res is None:  # finished since the launch: nothing of this verify is kept
                rejected.extend(range(start, start + w))
                start += w
                continue
            path = res[0]
            n, kv = len(path), req.kv_len
            if path[-1] == n - 1:  # a path is increasing from 0: this one is 0..n-1 (chains always)
                nodes.extend(range(start, start + n))
                rejected.extend(range(start + n, start + w))
            else:
                nodes.extend(start + i for i in path)
                kept = set(path)
                rejected.extend(start + i for i in range(w) if i not in kept)
            rows.extend([req.row] * n)
            cols.extend(range(kv, kv + n))
            req.kv_len = kv + n
            self._note_acceptance(req, w, n)
            start += w
        num_accepted = len(nodes)
        nodes.extend(rejected)
        nodes_t, rows_t, cols_t = ints_to_device([nodes, rows, cols], slots.device)
        chosen = slots[nodes_t]
        if num_accepted:
            sched.map_kv_slots(rows_t, cols_t, chosen[:num_accepted])
        sched.free_kv_slots(chosen[num_accepted:])  # rejected nodes: freed at once
        live = [i for i, res in enumerate(results) if res is not None]
        self.after_accept([reqs[i] for i in live], [trees[i] for i in live],
                          [results[i] for i in live], [old_kv_lens[i] for i in live])  # type: ignore[misc]

    def _commit_premapped(self, sched: SchedulerAPI, step: VerifyStep, results: list[AcceptResult | None]) -> None:
        """``commit_kv`` of a premapped batch of chains: the accepted nodes 0..n-1 are in place, so only
        ``kv_len`` moves; the rejected slots are noted for ``commit_tokens`` to free (a slice per request
        costs a dispatch each, which the next launch need not wait for)."""
        old_kv_lens = [r.kv_len for r in step.reqs]
        start = 0
        for req, tree, res in zip(step.reqs, step.trees, results, strict=True):
            w = tree.width
            n = 0 if res is None else len(res[0])  # finished since the launch: nothing is kept
            if n < w:
                step.rejected.append((start + n, start + w))
            if res is not None:
                req.kv_len += n
                self._note_acceptance(req, w, n)
            start += w
        live = [i for i, res in enumerate(results) if res is not None]
        self.after_accept([step.reqs[i] for i in live], [step.trees[i] for i in live],
                          [results[i] for i in live], [old_kv_lens[i] for i in live])  # type: ignore[misc]

    def _note_acceptance(self, req: Req, width: int, accepted: int) -> None:
        """Fold a verify's accepted nodes (root included) into ``req``'s acceptance average."""
        if width > 1:  # a root-only tree is a plain decode row: no guess to count
            prev = self.accept_ema.get(req.rid, float(self.num_steps))
            self.accept_ema[req.rid] = EMA_DECAY * prev + (1 - EMA_DECAY) * (accepted - 1)
            self.accepted_all[req.rid] = accepted == width

    def commit_tokens(self, sched: SchedulerAPI, step: VerifyStep, results: list[AcceptResult | None]) -> None:
        """Free the slots acceptance rejected (``_commit_premapped``), append each request's accepted
        tokens and its bonus through the scheduler (stop checks, retiring), and count the step."""
        if step.rejected:
            parts = [step.slots[a:b] for a, b in step.rejected]
            sched.free_kv_slots(parts[0] if len(parts) == 1 else torch.cat(parts))
            step.rejected = []
        for req, tree, res in zip(step.reqs, step.trees, results, strict=True):
            if res is None:
                continue
            path, bonus = res
            if tree.width > 1:  # a root-only tree is a plain decode row: no guess to count
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += len(path)  # accepted drafts + the bonus token
                self.stats.accept_histogram[len(path) - 1] += 1
            sched.commit_tokens(req, tree.path_tokens(path[1:]) + [bonus])
        self.stats.verify_steps += 1
        self.stats.verified_requests += len(step.reqs)
        if self.stats.verify_steps % LOG_HISTOGRAM_EVERY == 0:
            self.log_stats()

    def next_verify(self, sched: SchedulerAPI, step: VerifyStep, results: list[AcceptResult | None]
                    ) -> tuple[list[Req], list[DraftTree], torch.Tensor] | None:
        """The verify to launch right after ``step``'s acceptance, before its tokens are committed, or
        None (the chain ends: the scheduler takes over). A chain goes on only while the step's requests
        are all the scheduler has (nothing else to decode, prefill or admit), each stays eligible, and
        the drafter has their next proposals from the outcome alone (``chains_verify``). A request
        the outcome finishes (its length, a stop token) leaves the chain; one that a stop string
        finishes is found by the commit, after the launch, and its rows are dropped then."""
        if not self.chains_verify or any(r is None for r in results):
            return None
        reqs = step.reqs
        if not self._holds_only(sched, reqs):
            return None
        cands: list[Req] = []
        depths: list[int] = []
        gained: list[list[int]] = []
        for req, tree, res in zip(reqs, step.trees, results, strict=True):
            assert res is not None
            path, bonus = res
            tokens = tree.path_tokens(path[1:]) + [bonus]
            depth = self.depth_after(req, tokens)
            if depth is None:
                if sched.waiting:
                    return None  # a finished request leaves room: the scheduler admits
                continue
            cands.append(req)
            depths.append(depth)
            gained.append(tokens)
        drafters = [i for i, d in enumerate(depths) if d > 0]
        if not drafters:
            return None
        proposed: list[DraftTree | None] = [None] * len(cands)
        drafted = self.propose_after(sched, [cands[i] for i in drafters], [depths[i] for i in drafters],
                                     [gained[i] for i in drafters])
        if drafted is None:
            return None
        for i, tree in zip(drafters, drafted, strict=True):
            proposed[i] = tree
        drafting = sum(t is not None for t in proposed)
        if drafting == 0 or drafting < MIN_DRAFTING_FRACTION * len(drafters):
            return None  # a miss: decode_step's back-off decides what follows
        trees = [t if t is not None else DraftTree([g[-1]], [-1]) for g, t in zip(gained, proposed, strict=True)]
        need = sum(t.width for t in trees)
        if sched.available_kv_tokens() < need:
            return None
        slots = sched.alloc_kv_slots(need)
        if slots is None:
            return None
        return cands, trees, slots

    def depth_after(self, req: Req, tokens: Sequence[int]) -> int | None:
        """``_max_depth`` of ``req`` once ``tokens`` are committed (its KV mapped already), or None when
        they finish it (the length limits, a stop token) or it may not verify then."""
        sp = req.sampling_params
        n0 = len(req.output_ids)
        if n0 + len(tokens) < sp.min_new_tokens:
            return None
        if sp.stop_token_ids or not sp.ignore_eos:
            first = max(0, sp.min_new_tokens - n0 - 1)  # stop tokens count from min_new_tokens on
            if any(t in sp.stop_token_ids or (not sp.ignore_eos and t in self.eos_token_ids) for t in tokens[first:]):
                return None
        if req.kv_len != req.fill_len + len(tokens) - 1 or req.to_abort:
            return None
        depth = self._depth_limit(req, len(tokens))
        return None if depth < 0 else depth

    def _depth_limit(self, req: Req, gained: int) -> int:
        """The deepest draft ``req`` may verify once it has gained ``gained`` tokens: its acceptance
        average, ``num_steps`` and room in its lengths (a guess and the bonus after it); negative when
        the gain reaches ``max_new_tokens`` or the context length."""
        adaptive = int(self.accept_ema.get(req.rid, float(self.num_steps)) + 0.5) + 1
        return min(adaptive, self._room_limit(req, gained))

    def _room_limit(self, req: Req, gained: int) -> int:
        """``_depth_limit`` without the acceptance average: ``num_steps`` and the room in ``req``'s
        lengths once it has gained ``gained`` tokens."""
        n = len(req.output_ids) + gained
        fill = req.fill_len + gained
        return min(self.num_steps, req.sampling_params.max_new_tokens - n - 1, self.runner.max_context_len - 1 - fill)

    def propose_after(self, sched: SchedulerAPI, reqs: list[Req], max_depths: list[int],
                      gained: list[list[int]]) -> list[DraftTree | None] | None:
        """``propose`` for requests whose last verify gained ``gained`` (not committed yet); None when
        the drafter needs the committed state (then no chain: see ``chains_verify``)."""
        return None

    def after_verify_forward(self, fb: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """The verify forward is queued (nothing read back yet)."""

    def predraft(self, reqs: Sequence[Req], trees: list[DraftTree]) -> None:  # noqa: B027 (optional hook)
        """The verify forward of ``trees`` is queued: prepare the next step's drafts for the outcomes
        it may have, so that ``propose`` after it only picks the one that arrived (a drafter whose
        next draft needs the verify's result, such as a draft model's KV, leaves this empty)."""

    def after_accept(self, reqs: list[Req], trees: list[DraftTree], results: list[AcceptResult],  # noqa: B027
                     old_kv_lens: list[int]) -> None:
        """The accepted nodes are in place (req_to_token, kv_len); tokens not appended yet. A draft
        model extends its KV over the accepted tokens here."""

    def log_stats(self) -> None:
        hist = dict(sorted(self.stats.accept_histogram.items()))
        logger.info("speculative: %d verify steps, mean accept length %.2f, accepted-draft histogram %s",
                    self.stats.verify_steps, self.stats.mean_accept_length(), hist)
