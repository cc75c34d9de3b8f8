"""The speculative step: draft trees for the running requests, verify them in one TARGET_VERIFY
forward, accept, and fix up the KV bookkeeping.

Flow per scheduler step (called before the scheduler builds its own batch, overlap drained):
  1. eligible requests (greedy or plain temperature/top-k/top-p/min-p sampling; no penalties,
     logprobs or pending min_new_tokens, which need the full sampler) get a draft tree from the
     drafter; eligible requests with no proposal, or no room for a guess (one token left), ride
     along as root-only trees (their verify row is their decode row: one forward per step, not a
     verify plus a decode of the rest);
     ineligible requests are left to the scheduler's normal decode;
  2. one KV slot per tree node, tree tokens at ``prefix_len + depth``, custom ancestor mask; the
     forward runs through ``ModelRunner.forward`` (eager: the backend plans inside
     ``forward_extend``, after the batch has its final shape, DESIGN 3.3);
  3. acceptance per request (``plait.speculative.accept``);
  4. the accepted nodes' slots are written into ``req_to_token`` at consecutive positions (tree order
     is not path order, so entries are rewritten rather than KV moved); every other node's slot is
     freed at once; the accepted tokens and the bonus token are appended with the scheduler's stop
     checks (tokens after a stop are dropped, and their KV is freed when the request is released).
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from plait.config import EngineConfig
from plait.forward_batch import ForwardBatch, ForwardMode
from plait.mem.pools import DUMMY_KV_SLOT
from plait.sampling import GREEDY_TEMPERATURE_EPS, Sampler, SamplingBatchInfo, counter_uniforms
from plait.sampling.sampler import greedy_ids
from plait.speculative.accept import (
    child_token_table,
    greedy_accept,
    one_hot_decisions,
    tree_accept_sampled,
    walk_decisions,
)
from plait.speculative.draft_tree import level_tree
from plait.speculative.tree import DraftTree, build_verify_mask, build_verify_mask_from_ancestors
from plait.transfer import ints_to_device, to_host

if TYPE_CHECKING:
    from plait.executor.model_runner import ModelRunner
    from plait.scheduler.req import Req
    from plait.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

# Counter-RNG stream of the acceptance draws (stream 0 is the sampler's Gumbel noise).
ACCEPT_STREAM = 1
LOG_HISTOGRAM_EVERY = 256  # verify steps between acceptance-histogram log lines
EMA_DECAY = 0.5  # weight of the past in the per-request acceptance average
MISS_BACKOFF_MAX = 8  # longest run of plain decode steps after repeated misses (see SpecWorker)
# NGRAM per-request cooling: a request whose acceptance average falls below COLD_ACCEPT drafts
# nothing for COLD_STEPS drafting opportunities, then probes again (depth 1, from the average).
COLD_ACCEPT = 0.3
COLD_STEPS = 8
# A step verifies only when at least this fraction of the candidate requests has a draft (the rest
# ride along as root-only rows); below it the step is a miss (plain, overlapped decoding).
MIN_DRAFTING_FRACTION = 0.25


@dataclass
class VerifyInput:
    """``ForwardBatch.spec_info`` of a TARGET_VERIFY batch."""

    trees: list[DraftTree]
    custom_mask: torch.Tensor  # flattened bool, layout of plait.attention.base.custom_mask_of
    # Tokens verified per request (root included). The executor reads widths from here, never from
    # a global draft width: widths differ between requests and between steps.
    num_tokens_per_req: list[int]


@dataclass
class SpecStats:
    verify_steps: int = 0  # TARGET_VERIFY forwards
    verified_requests: int = 0  # request-steps verified
    # accepted draft tokens per request-step -> count (the step gained that many + 1 tokens)
    accept_histogram: Counter[int] = field(default_factory=Counter)

    def mean_accept_length(self) -> float:
        n = sum(self.accept_histogram.values())
        return sum((k + 1) * c for k, c in self.accept_histogram.items()) / n if n else 0.0


class SpecWorker(ABC):
    """Base: drafting is the subclass's ``propose``; verification and bookkeeping live here."""

    # Whether admitted requests with a cached prompt join verify steps (see decode_step). Not for
    # draft models: they must see the prompt themselves (after_target_forward) before drafting.
    joins_admissions = False

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        assert config.speculative_num_steps and config.speculative_eagle_topk and config.speculative_num_draft_tokens
        self.config = config
        self.runner = runner
        self.num_steps = config.speculative_num_steps
        self.topk = config.speculative_eagle_topk
        self.num_draft_tokens = config.speculative_num_draft_tokens
        self.stats = SpecStats()
        self.sampler = Sampler()
        # Adaptive draft depth: per request, a moving average of accepted drafts per step. Depth is
        # that average + 1 (at most num_steps), so a request whose guesses keep failing verifies
        # short drafts, and one whose guesses land goes back to full depth.
        self.accept_ema: dict[str, float] = {}
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

    def after_target_forward(self, fb: ForwardBatch) -> None:  # noqa: B027 (optional hook)
        """The scheduler ran a plain (non-speculative) target forward."""

    @abstractmethod
    def propose(self, sched: Scheduler, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        """One draft tree per request (None: it decodes normally this step), at most max_depths deep."""

    def on_idle(self, sched: Scheduler) -> None:
        """The scheduler ran out of work: run the deferred work (nothing is left to hide it behind)
        and forget the miss back-off (the next requests deserve their own first try)."""
        self._skip, self._backoff = 0, 1
        self.deferred_work(sched)

    def deferred_work(self, sched: Scheduler) -> None:  # noqa: B027 (optional hook)
        """Host work the next launch does not need. Runs where it costs the GPU nothing: between a
        verify launch and its acceptance (the forward is queued), after a step that launched no
        verify (plain, overlapped decode steps follow), and when the scheduler runs out of work."""

    def close(self) -> None:  # noqa: B027 (optional hook)
        """The engine is shutting down: drop device memory (statistics stay readable)."""

    # --- the step ---------------------------------------------------------------------------------
    def _max_depth(self, sched: Scheduler, req: Req) -> int | None:
        """How deep a tree may go for ``req`` now. None: it cannot take part in a verify step (it
        needs the full sampler, or has no pending decode); 0: it may ride along as a root-only row
        (no room for a guess, e.g. one token left) but draft nothing."""
        sp = req.sampling_params
        if (req.pending or req.finished or req.to_abort or sp.has_penalties or sp.logprobs or sp.top_logprobs
                or len(req.output_ids) < sp.min_new_tokens or req.kv_len != req.fill_len - 1):
            return None
        left = sp.max_new_tokens - len(req.output_ids)  # the bonus token is one of them
        room = sched.runner.max_context_len - 1 - req.fill_len  # node positions stay in the context
        adaptive = int(self.accept_ema.get(req.rid, float(self.num_steps)) + 0.5) + 1
        return max(0, min(self.num_steps, adaptive, left - 1, room))

    def should_speculate(self) -> bool:
        """Whether this scheduler step speculates (False: a plain, overlapped decode step)."""
        if self._skip > 0:
            self._skip -= 1
            return False
        return True

    def decode_step(self, sched: Scheduler) -> set[int]:
        """Speculate for the running requests; returns ``id()`` of the requests that advanced."""
        joining: list[Req] = []
        if self.joins_admissions:
            # Admitted requests whose prompt is cached but for its last token need one forward row,
            # like a decode: they join this verify (drafting from their prompt) instead of costing
            # the step a separate prefill forward after it.
            sched._admit()
            joining = [r for r in sched.prefilling if r.fill_len - r.kv_len == 1]
        cands, depths = [], []
        for r in [*sched.running, *joining]:
            d = self._max_depth(sched, r)
            if d is not None:
                cands.append(r)
                depths.append(d)
        drafters = [i for i, d in enumerate(depths) if d > 0]
        if not drafters:
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
            self.deferred_work(sched)
            return set()
        self._backoff = 1
        trees = [t if t is not None else DraftTree([r.last_token], [-1])
                 for r, t in zip(cands, proposed, strict=True)]
        need = sum(t.width for t in trees)
        # Leave room for the normal decode of everyone else; when short, skip speculation this step
        # and let the scheduler's decode path evict or retract as it always does.
        others = len(sched.running) + len(joining) - len(cands)
        if sched.allocator.available_size() + sched.tree_cache.evictable_size() < need + others:
            return set()
        slots = sched._alloc(need)
        if slots is None:
            return set()
        self.verify(sched, cands, trees, slots)
        for r in cands:  # joiners have their first token: they run from now on (unless finished)
            if r in sched.prefilling:
                sched.prefilling.remove(r)
                sched.running.append(r)
        return {id(r) for r in cands}

    def build_verify_batch(self, reqs: list[Req], trees: list[DraftTree], slots: torch.Tensor,
                           pad_width: int | None = None, input_ids: torch.Tensor | None = None,
                           custom_mask: torch.Tensor | None = None) -> ForwardBatch:
        """The TARGET_VERIFY batch of ``trees`` (their nodes' KV into ``slots``, tree order).

        ``pad_width``: every request's block is padded to this many tokens with dummy nodes (children
        of the root, token 0, KV into the reserved dummy slot), so a batch of mixed widths replays
        one captured graph. ``spec_info.trees`` stay the real trees, and request i's real nodes are
        logits rows ``[i * pad_width, i * pad_width + width_i)``.

        ``input_ids`` / ``custom_mask``: the nodes' tokens and the mask when they are on the device
        already (draft-tree expansion); ``trees`` then give only the shape (widths and depths)."""
        device = self.runner.device
        real_trees = trees
        src: list[int] = []  # padded layout: slot j of the real layout, or len(slots) (the dummy slot)
        if pad_width is not None:
            trees = [DraftTree(t.tokens + [0] * (pad_width - t.width), t.parents + [0] * (pad_width - t.width))
                     for t in trees]
            off = 0
            for t in real_trees:
                src.extend(range(off, off + t.width))
                src.extend([len(slots)] * (pad_width - t.width))
                off += t.width
        widths = [t.width for t in trees]
        prefix = [r.kv_len for r in reqs]
        ids: list[int] = []
        pos: list[int] = []
        for t, pre in zip(trees, prefix, strict=True):
            ids.extend(t.tokens)
            pos.extend(pre + d for d in t.depths())
        seq_lens = [p + w for p, w in zip(prefix, widths, strict=True)]
        starts = np.concatenate([[0], np.cumsum(widths)[:-1]]).tolist()
        rows = [r.req_pool_idx for r in reqs]
        parts = [ids, pos, rows, seq_lens, widths, prefix, starts, src]
        ids_t, pos_t, rows_t, seq_t, ext_t, pre_t, starts_t, src_t = ints_to_device(parts, device)
        if pad_width is not None:
            slots = torch.cat([slots, slots.new_full((1,), DUMMY_KV_SLOT)])[src_t]
        fb = ForwardBatch(
            forward_mode=ForwardMode.TARGET_VERIFY, batch_size=len(reqs),
            input_ids=ids_t if input_ids is None else input_ids,
            req_pool_indices=rows_t, seq_lens=seq_t, out_cache_loc=slots, positions=pos_t,
            seq_lens_cpu=seq_lens, seq_lens_sum=sum(seq_lens),
            extend_num_tokens=len(ids), extend_seq_lens=ext_t, extend_prefix_lens=pre_t,
            extend_start_loc=starts_t, extend_seq_lens_cpu=widths, extend_prefix_lens_cpu=prefix,
        )
        # logits_indices stays None: every node's logits are needed.
        mask = build_verify_mask(trees, prefix, device) if custom_mask is None else custom_mask
        fb.spec_info = VerifyInput(real_trees, mask, widths)
        return fb

    def tree_draft_batch(self, reqs: list[Any], tokens: torch.Tensor, ancestors: torch.Tensor) -> ForwardBatch:
        """The DRAFT_EXTEND batch of one device tree-expansion step (``plait.speculative.draft_tree``):
        every request's first ``width`` nodes, tokens ``[bs, width]`` and ancestor matrices
        ``[bs, width, width]`` from the device, node n at ``kv_len + depth(n)``, KV into the dummy
        slot (the partial tree is recomputed each step, so no slot is held)."""
        bs, width = tokens.shape
        slots = torch.full((bs * width,), DUMMY_KV_SLOT, dtype=torch.int64, device=tokens.device)
        mask = build_verify_mask_from_ancestors(ancestors, [r.kv_len for r in reqs])
        fb = self.build_verify_batch(reqs, [level_tree(width, self.topk)] * bs, slots,
                                     input_ids=tokens.reshape(-1), custom_mask=mask)
        fb.forward_mode = ForwardMode.DRAFT_EXTEND
        return fb

    def graph_pad_width(self, trees: list[DraftTree]) -> int | None:
        """The width to pad a verify batch of mixed widths to, when a captured graph then runs it
        (the adaptive depth gives requests different widths; eager verify costs several graph
        replays). None: the widths are uniform already, or no graph would take the batch."""
        graphs = self.runner.verify_graph_runner
        widths = {t.width for t in trees}
        if graphs is None or len(widths) == 1 or len(trees) > graphs.max_bs or max(widths) not in graphs.widths:
            return None
        return max(widths)

    def verify(self, sched: Scheduler, reqs: list[Req], trees: list[DraftTree], slots: torch.Tensor) -> None:
        fb = self.build_verify_batch(reqs, trees, slots, pad_width=self.graph_pad_width(trees))
        out = self.runner.forward(fb)  # logits [sum(num_tokens_per_req), V] float32
        sched.stats.forward_steps += 1
        self.deferred_work(sched)  # the forward is queued: hide host work behind it
        results = self.accept(reqs, trees, out.next_token_logits, row_widths=fb.spec_info.num_tokens_per_req,
                              greedy=out.greedy_ids)
        self.commit(sched, reqs, trees, slots, results)

    def accept(self, reqs: list[Req], trees: list[DraftTree], logits: torch.Tensor,
               row_widths: list[int] | None = None, greedy: torch.Tensor | None = None
               ) -> list[tuple[list[int], int]]:
        """Acceptance per request. ``row_widths``: logits rows per request when the verify batch
        was padded (real nodes first); default the trees' widths. ``greedy``: the logits' argmax
        when the forward computed it already (verify graphs).

        Greedy rows take the argmax; sampled rows with one-hot drafts (n-gram, top-k trees, and
        requests riding along without a draft) decide on the device (``one_hot_decisions``); both
        come to the host in one copy. Only drafts with a soft draft distribution bring probability
        rows to the host."""
        widths = [t.width for t in trees]
        row_starts = np.concatenate([[0], np.cumsum(row_widths or widths)]).tolist()
        # The sampler's rule for greedy rows, so a request gets the same treatment on both paths.
        sampled = [i for i, r in enumerate(reqs) if not (r.sampling_params.is_greedy
                                                         or r.sampling_params.temperature < GREEDY_TEMPERATURE_EPS)]
        one_hot = [i for i in sampled if trees[i].draft_probs is None]
        soft = [i for i in sampled if trees[i].draft_probs is not None]
        parts = [greedy if greedy is not None else greedy_ids(logits)]
        num_cols = 1
        if one_hot:
            num_cols = max(1, max(len(trees[i].children(n)) for i in one_hot for n in range(widths[i])))
            rows, info = self._node_rows(reqs, trees, one_hot, row_starts, logits)
            children = ints_to_device([child_token_table([trees[i] for i in one_hot], num_cols)], logits.device)[0]
            unif = counter_uniforms(info.seeds, info.steps, num_cols, stream=ACCEPT_STREAM)
            decisions = one_hot_decisions(Sampler.warp(logits[rows], info), children.view(-1, num_cols), unif,
                                          info.noise_keys, self.sampler.use_triton)
            parts.append(decisions.flatten())
        host = to_host(parts[0] if len(parts) == 1 else torch.cat(parts))
        argmax = host[: logits.shape[0]].tolist()
        decided: dict[int, np.ndarray] = {}
        k = 0
        table = host[logits.shape[0]:].reshape(-1, num_cols + 1)
        for i in one_hot:
            decided[i] = table[k : k + widths[i]]
            k += widths[i]
        probs_of: dict[int, np.ndarray] = {}
        unif_of: dict[int, np.ndarray] = {}
        if soft:
            rows, info = self._node_rows(reqs, trees, soft, row_starts, logits)
            probs = to_host(torch.softmax(Sampler.warp(logits[rows], info), dim=-1).double())
            unif_all = to_host(counter_uniforms(info.seeds, info.steps, self.topk + 2, stream=ACCEPT_STREAM))
            k = 0
            for i in soft:
                probs_of[i], unif_of[i] = probs[k : k + widths[i]], unif_all[k : k + widths[i]]
                k += widths[i]
        results = []
        for i, tree in enumerate(trees):
            if i in decided:
                results.append(walk_decisions(tree, decided[i]))
            elif i in probs_of:
                assert tree.draft_probs is not None
                results.append(tree_accept_sampled(tree, probs_of[i], unif_of[i],
                                                   tree.draft_probs.double().cpu().numpy()))
            else:
                results.append(greedy_accept(tree, argmax[row_starts[i] : row_starts[i] + tree.width]))
        return results

    @staticmethod
    def _node_rows(reqs: list[Req], trees: list[DraftTree], which: list[int], row_starts: list[int],
                   logits: torch.Tensor) -> tuple[torch.Tensor, SamplingBatchInfo]:
        """Logits rows of the nodes of requests ``which`` (tree order) and their sampling info: a node
        at depth d emits the request's token number len(output_ids) + d, which keys its draws."""
        row_idx: list[int] = []
        params, seeds, steps = [], [], []
        for i in which:
            row_idx.extend(range(row_starts[i], row_starts[i] + trees[i].width))
            for d in trees[i].depths():
                params.append(reqs[i].sampling_params)
                seeds.append(reqs[i].seed)
                steps.append(len(reqs[i].output_ids) + d)
        # build() reads only the length of output_ids here (no penalties on speculative rows).
        info = SamplingBatchInfo.build(params, seeds=seeds, output_ids=[range(s) for s in steps],
                                       prompt_ids=[[] for _ in params], eos_token_ids=(),
                                       vocab_size=logits.shape[1], device=logits.device)
        return ints_to_device([row_idx], logits.device)[0], info

    def commit(self, sched: Scheduler, reqs: list[Req], trees: list[DraftTree], slots: torch.Tensor,
               results: list[tuple[list[int], int]]) -> None:
        old_kv_lens = [r.kv_len for r in reqs]
        # Accepted nodes go to consecutive positions after the prefix, in path order: one scatter
        # into req_to_token for the whole batch (node index in ``slots``, pool row, position).
        accepted: list[int] = []
        rows: list[int] = []
        cols: list[int] = []
        start = 0
        for req, tree, (path, _) in zip(reqs, trees, results, strict=True):
            accepted.extend(start + n for n in path)
            rows.extend([req.req_pool_idx] * len(path))  # type: ignore[list-item]
            cols.extend(range(req.kv_len, req.kv_len + len(path)))
            req.kv_len += len(path)
            start += tree.width
        # Rejected node indices come from the host too: a boolean-mask gather on the device would
        # wait for the GPU queue (nonzero) in the middle of the step.
        kept = set(accepted)
        rejected = [i for i in range(slots.numel()) if i not in kept]
        acc_t, rows_t, cols_t, rej_t = ints_to_device([accepted, rows, cols, rejected], slots.device)
        sched.req_to_token_pool.req_to_token[rows_t, cols_t] = slots[acc_t].to(torch.int32)
        sched.allocator.free(slots[rej_t])  # rejected nodes: freed at once
        self.after_accept(reqs, trees, results, old_kv_lens)
        for req, tree, (path, bonus) in zip(reqs, trees, results, strict=True):
            if tree.width > 1:  # a root-only tree is a plain decode row: no guess to count
                req.spec_verify_ct += 1
                req.spec_accepted_tokens += len(path)  # accepted drafts + the bonus token
                self.stats.accept_histogram[len(path) - 1] += 1
                prev = self.accept_ema.get(req.rid, float(self.num_steps))
                self.accept_ema[req.rid] = EMA_DECAY * prev + (1 - EMA_DECAY) * (len(path) - 1)
            for tok in tree.path_tokens(path[1:]) + [bonus]:
                sched._append_token(req, tok)
                if req.finished:
                    break  # tokens after a stop are dropped; _release frees their KV
            if req.finished:
                sched._retire(req)
            sched._updated.append(req)
        self.stats.verify_steps += 1
        self.stats.verified_requests += len(reqs)
        if self.stats.verify_steps % LOG_HISTOGRAM_EVERY == 0:
            self.log_stats()

    def after_accept(self, reqs: list[Req], trees: list[DraftTree], results: list[tuple[list[int], int]],  # noqa: B027
                     old_kv_lens: list[int]) -> None:
        """The accepted nodes are in place (req_to_token, kv_len); tokens not appended yet. A draft
        model extends its KV over the accepted tokens here."""

    def log_stats(self) -> None:
        hist = dict(sorted(self.stats.accept_histogram.items()))
        logger.info("speculative: %d verify steps, mean accept length %.2f, accepted-draft histogram %s",
                    self.stats.verify_steps, self.stats.mean_accept_length(), hist)


class NgramWorker(SpecWorker):
    joins_admissions = True

    def __init__(self, config: EngineConfig, runner: ModelRunner) -> None:
        super().__init__(config, runner)
        from plait.speculative.ngram import NgramDrafter

        self.drafter = NgramDrafter(config.speculative_ngram_min_match_window_size,
                                    config.speculative_ngram_max_match_window_size,
                                    config.speculative_ngram_capacity)
        self._cold_waits: dict[str, int] = {}  # rid -> drafting opportunities skipped while cold
        # Finished requests' tokens, fed to the global cache as deferred work (an insert walks every
        # n-gram of the request: on a step's critical path it delayed the next verify launch).
        self._finished: list[list[int]] = []

    def propose(self, sched: Scheduler, reqs: list[Req], max_depths: list[int]) -> list[DraftTree | None]:
        return [None if self._cooling(r) else self.drafter.propose(r.rid, r.fill_ids, d, self.num_draft_tokens,
                                                                   self.topk)
                for r, d in zip(reqs, max_depths, strict=True)]

    def _cooling(self, req: Req) -> bool:
        """Whether ``req`` skips drafting now: its guesses keep failing (acceptance average below
        COLD_ACCEPT), so a verify row would cost more than the plain decode it replaces. Every
        COLD_STEPS-th opportunity it probes again."""
        if self.accept_ema.get(req.rid, float(self.num_steps)) >= COLD_ACCEPT:
            return False
        waited = self._cold_waits.get(req.rid, 0) + 1
        if waited >= COLD_STEPS:
            self._cold_waits.pop(req.rid, None)
            return False
        self._cold_waits[req.rid] = waited
        return True

    def on_finish(self, req: Req) -> None:
        super().on_finish(req)
        self._cold_waits.pop(req.rid, None)
        self.drafter.forget(req.rid)
        self._finished.append(req.fill_ids)

    def deferred_work(self, sched: Scheduler) -> None:
        """Feed finished requests to the global cache, and index the prompts of the requests the
        scheduler admits next (their first proposal then only indexes what they generated)."""
        finished, self._finished = self._finished, []
        for tokens in finished:
            self.drafter.cache.insert(tokens)
        # The scheduler admits waiting requests as running ones finish, often right after this
        # verify: index at least one (beyond the free places) so its first proposal finds it ready.
        budget = max(1, sched.config.max_running_requests - sched.num_running())
        for req in sched.waiting:
            if budget == 0:
                break
            if req.rid not in self.drafter.indices:
                self.drafter.index(req.rid, req.fill_ids)
                budget -= 1


def create_spec_worker(config: EngineConfig, runner: ModelRunner) -> SpecWorker | None:
    algo = config.speculative_algorithm
    if algo is None:
        return None
    if algo == "NGRAM":
        return NgramWorker(config, runner)
    if algo == "STANDALONE":
        from plait.speculative.standalone import StandaloneWorker

        return StandaloneWorker(config, runner)
    from plait.speculative.eagle import EagleWorker

    return EagleWorker(config, runner)
