"""The scheduler: continuous batching over the paged KV cache.

Each ``step()`` builds one batch: a decode token for every running request, plus prefill chunks of
admitted requests within the per-step token budget (``chunked_prefill_size``); runs it; and appends
the sampled tokens. Admission matches the radix prefix cache and reserves KV for the expected decode
of everything already running (``new_token_ratio``), so that retraction is rare. When the pool still
cannot hold the next step, the request with the least progress is retracted: its KV goes to the
prefix cache (evictable) and it returns to the front of the queue; on re-admission it re-prefills its
prompt and generated tokens and continues where it stopped.

Ownership: the scheduler owns every Req's request-pool row and KV slots from admission to release;
after release nothing of the request is held outside the radix cache.
"""

from __future__ import annotations

import logging
import math
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from plait.config import EngineConfig
from plait.executor.forward_output import InputLogprobs
from plait.executor.model_runner import ModelRunner
from plait.mem.radix_cache import RadixCache
from plait.sampling import SamplingBatchInfo, SamplingParams
from plait.scheduler.in_flight import InFlight
from plait.scheduler.interface import SpecWorker
from plait.scheduler.kv_cache import KVCacheManager
from plait.scheduler.policy import SchedulePolicy
from plait.scheduler.req import FinishReason, Req
from plait.scheduler.schedule_batch import BatchEntry, ScheduleBatch
from plait.scheduler.stats import BucketCounts, SchedulerStats
from plait.transfer import to_device

if TYPE_CHECKING:
    from plait.executor.forward_output import ForwardOutput
    from plait.sampling.grammar import GrammarBackend

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.001
RETRACT_DECODE_STEPS = 20
# How long an otherwise idle step waits for a grammar compile to finish (seconds): the loop neither
# spins nor sleeps past the compile.
GRAMMAR_POLL_S = 0.05


@dataclass
class _LastSampling:
    reqs: list[Req]
    info: SamplingBatchInfo


class Scheduler:
    """``spec_worker``: the speculative decoder (None when speculation is off), built by
    ``plait.speculative.factory.create_spec_worker``; it drives this scheduler through the
    ``SchedulerAPI`` methods below (plait.scheduler.interface).

    ``grammar_backend``: compiles the grammars of constrained requests (None: such requests are
    refused with a finish message). A constrained request waits in ``grammar_queue`` until its
    grammar is compiled (in ``waiting``, skipped by admission); nothing else waits for it.
    """

    def __init__(self, config: EngineConfig, runner: ModelRunner, spec_worker: SpecWorker | None = None,
                 grammar_backend: GrammarBackend | None = None) -> None:
        self.config = config
        self.runner = runner
        self.kv = KVCacheManager(runner.req_to_token_pool, runner.allocator, runner.max_total_tokens,
                                 config.disable_radix_cache, runner.device)
        self.eos_token_ids = runner.model_config.eos_token_ids
        self.vocab_size = runner.model_config.vocab_size
        self.waiting: deque[Req] = deque()
        self.policy = SchedulePolicy(config.schedule_policy, config.seed)
        self.prefilling: list[Req] = []  # admitted, prefill not complete (chunked)
        self.running: list[Req] = []  # decoding
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * config.schedule_conservativeness
        self.min_new_token_ratio = MIN_NEW_TOKEN_RATIO * config.schedule_conservativeness
        self.stats = SchedulerStats()
        self.overlap = not config.disable_overlap_schedule
        self._in_flight: InFlight | None = None
        self._draining: list[Req] = []  # finished, waiting for an in-flight batch before release
        self._updated: list[Req] = []
        self._last_sampling: _LastSampling | None = None  # the previous step's sampled requests and info
        # Optional observer of every sampled step: (requests, their float32 logits rows). Used by
        # correctness tests and logit debugging; None costs nothing.
        self.on_logits: Callable[[list[Req], torch.Tensor], None] | None = None
        # Speculative decoding (None when off): decodes running requests through draft + verify.
        self.spec_worker = spec_worker
        self.grammar_backend = grammar_backend

    # --- requests in and out ----------------------------------------------------------------------
    @property
    def max_request_tokens(self) -> int:
        """prompt + max_new_tokens must fit both the context and the whole KV pool."""
        return min(self.runner.max_context_len, self.runner.max_total_tokens)

    def add_request(self, req: Req) -> None:
        key = req.sampling_params.grammar
        if key is not None and req.grammar is None:
            if self.grammar_backend is None:
                self._finish(req, FinishReason.ABORT,
                             f"{key[0]}: constrained decoding is not available in this engine layout")
                return
            req.grammar_future = self.grammar_backend.request(key)
        self.waiting.append(req)

    def _poll_grammars(self) -> None:
        """Give waiting requests whose grammar compiled their matcher (admission skips the others);
        finish those whose grammar failed to compile. Never waits, unless nothing else can run."""
        compiling = [r for r in self.waiting if r.grammar_future is not None]
        if not compiling:
            return
        if len(compiling) == len(self.waiting) and not (self.prefilling or self.running or self._in_flight):
            wait_futures([r.grammar_future for r in compiling if r.grammar_future is not None],
                         timeout=GRAMMAR_POLL_S, return_when=FIRST_COMPLETED)
        assert self.grammar_backend is not None
        for req in compiling:
            fut = req.grammar_future
            assert fut is not None
            if not fut.done():
                continue
            req.grammar_future = None
            error = fut.exception()
            if error is not None:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT, str(error))
                self._updated.append(req)
            else:
                req.grammar = self.grammar_backend.new_matcher(fut.result())
        st = self.grammar_backend.stats
        self.stats.grammar_compiles = st.compiles
        self.stats.grammar_compile_failures = st.compile_failures
        self.stats.grammar_cache_hits = st.cache_hits
        self.stats.grammar_compile_seconds_sum = st.compile_seconds_sum
        self.stats.grammar_compile_seconds = BucketCounts(st.bucket_bounds, tuple(st.compile_seconds_buckets))

    def abort(self, rid: str) -> bool:
        for req in list(self.waiting):
            if req.rid == rid:
                self.waiting.remove(req)
                self._finish(req, FinishReason.ABORT, "aborted by the client")
                return True
        for req in self.prefilling + self.running:
            if req.rid == rid:
                req.to_abort = True
                return True
        return False

    def has_work(self) -> bool:
        return bool(self.waiting or self.prefilling or self.running or self._in_flight or self._draining)

    def num_running(self) -> int:
        return len(self.prefilling) + len(self.running)

    # --- one step ---------------------------------------------------------------------------------
    def step(self) -> list[Req]:
        """Schedule and launch one batch, then process results. Returns the requests with new output
        (tokens or a finish).

        With overlap scheduling the results processed are those of the batch launched by the
        previous step: the host reads them while the device runs the batch just launched.
        """
        self._updated = self._process_aborts()
        self._poll_grammars()
        advanced: set[int] = set()  # id() of requests the speculative step advanced
        if self.spec_worker is not None and self.spec_worker.should_speculate():
            # Speculative steps run with overlap drained: drafting and acceptance need every
            # request's tokens on the host. Requests it advanced skip this step's normal decode.
            self._drain()
            advanced = self.spec_worker.decode_step(self)
        batch = self._schedule(advanced)
        launched = self._launch(batch) if batch is not None else None
        if self.overlap:
            # A constrained batch's forward is queued but not sampled: its masks need the tokens of
            # the in-flight batch, which processing it feeds to the matchers. Only sampling waits.
            self._drain()
            if launched is not None and launched.unsampled is not None:
                self._sample(launched)
            self._in_flight = launched
        elif launched is not None:
            if launched.unsampled is not None:
                self._sample(launched)
            self._process(launched)
        if self.spec_worker is not None and not self.has_work():
            self.spec_worker.on_idle(self)
        updated, self._updated = self._updated, []
        return updated

    def flush(self) -> list[Req]:
        """Process the in-flight batch and release requests that were waiting for it (used when a
        caller stops stepping, so nothing stays held)."""
        self._drain()
        updated, self._updated = self._updated, []
        return updated

    def _drain(self) -> None:
        """Process the in-flight batch now (the host needs its results before going on)."""
        if self._in_flight is not None:
            in_flight, self._in_flight = self._in_flight, None
            self._process(in_flight)

    def _process_aborts(self) -> list[Req]:
        aborted = [r for r in self.prefilling + self.running if r.to_abort and not r.finished]
        for req in aborted:
            self._finish(req, FinishReason.ABORT, "aborted by the client")
            self._retire(req)
        return aborted

    def _retire(self, req: Req) -> None:
        """A finished request leaves the batch lists; its memory is released once no in-flight
        batch still writes into it."""
        if req in self.prefilling:
            self.prefilling.remove(req)
        if req in self.running:
            self.running.remove(req)
        if req.pending == 0:
            self.kv.release(req)
        else:
            self._draining.append(req)

    # --- KV slots (SchedulerAPI) ---------------------------------------------------------------------
    def available_kv_tokens(self) -> int:
        return self.kv.available_tokens()

    def alloc_kv_slots(self, n: int) -> torch.Tensor | None:
        return self.kv.alloc(n)

    def free_kv_slots(self, slots: torch.Tensor) -> None:
        self.kv.free(slots)

    def map_kv_slots(self, rows: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        self.kv.map(rows, positions, slots)

    def commit_tokens(self, req: Req, tokens: Sequence[int]) -> None:
        if req.grammar is None and (req.detokenizer is None or not req.detokenizer.stop):
            self._append_plain_tokens(req, tokens)
        else:  # a matcher or stop strings look at every token
            for token in tokens:
                self._append_token(req, token)
                if req.finished:
                    break  # tokens after a stop are dropped; releasing the request frees their KV
        if req.finished:
            self._retire(req)
        elif req in self.prefilling:  # its first token: it decodes from now on
            self.prefilling.remove(req)
            self.running.append(req)
        self._updated.append(req)

    def _reserved_tokens(self) -> float:
        """KV the admitted requests are expected to still need (prefill left + decode estimate)."""
        total = 0.0
        for r in self.running + self.prefilling:
            left_new = r.sampling_params.max_new_tokens - r.num_generated
            total += max(0, r.fill_len - r.kv_len) + left_new * self.new_token_ratio
        return total

    def _schedulable_decodes(self, skip: set[int]) -> list[Req]:
        """Running requests that need another token (ones whose last token is still on the device
        may be done already; those that surely are, by length, are left out)."""
        limit = self.runner.max_context_len
        return [r for r in self.running
                if (n := r.num_generated) < r.sampling_params.max_new_tokens
                and len(r.origin_input_ids) + n < limit
                and id(r) not in skip]

    def _needs_host_state(self) -> bool:
        """Penalties read every generated token on the host: such a batch waits for the in-flight
        one instead of overlapping (outputs stay identical with overlap on or off)."""
        return any(r.pending and r.sampling_params.has_penalties for r in self.running)

    def _schedule(self, skip: set[int] | None = None) -> ScheduleBatch | None:
        """The next batch; requests whose id() is in ``skip`` (advanced this step already) do not decode."""
        if self._in_flight is not None and self._needs_host_state():
            self._drain()
        decodes = self._reserve_decode_slots(skip or set())
        decode_slots = self.alloc_kv_slots(len(decodes)) if decodes else None
        entries = [BatchEntry(r, r.kv_len, 1, sample=True, is_decode=True) for r in decodes]
        locs = [decode_slots] if decode_slots is not None else []
        self.admit()
        if skip and not entries and self.spec_worker is not None and all(
                self.spec_worker.joins_next_verify(r) for r in self.prefilling):
            # This step verified already and only cached-prompt admissions are left: they join the
            # next step's verify as rows of it (decode_step admits them) rather than cost a forward
            # of their own now. Never a wait for nothing: the next step verifies them, or, when it
            # does not speculate, schedules them here with an empty ``skip``.
            return None
        taken = 0  # prefill tokens in this step
        for req in self.prefilling:
            room = self.config.prefill_room(self.runner.max_context_len, taken)
            if room <= 0:
                break
            remaining = req.fill_len - req.kv_len
            n = min(remaining, room)
            slots = self.alloc_kv_slots(n)
            if slots is None:
                break  # admission reserved this; only eviction races can land here: retry next step
            taken += n
            entries.append(BatchEntry(req, req.kv_len, n, sample=(n == remaining), is_decode=False))
            locs.append(slots)
        if not entries:
            return None
        out_cache_loc = torch.cat(locs) if len(locs) > 1 else locs[0]
        return ScheduleBatch(entries, out_cache_loc)

    def _reserve_decode_slots(self, skip: set[int]) -> list[Req]:
        """The requests to decode this step, with room for one slot each: evict the prefix cache,
        wait for the in-flight batch, and finally retract the least-progressed requests."""
        while True:
            decodes = self._schedulable_decodes(skip)
            if not decodes:
                return []
            if self.available_kv_tokens() >= len(decodes):
                self.new_token_ratio = max(self.min_new_token_ratio, self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
                return decodes
            if self._in_flight is not None:
                self._drain()  # may finish requests; retraction needs host-complete state anyway
                continue
            if len(self.running) == 1 and not self.prefilling:
                raise RuntimeError("KV pool cannot hold a single request's next token; raise max_total_tokens")
            self._retract_one()

    def _retract_one(self) -> None:
        # Least progress first: fewest generated tokens, then the longest prompt (frees the most).
        pool = self.prefilling if (len(self.running) <= 1 and self.prefilling) else self.running
        victim = min(pool, key=lambda r: (len(r.output_ids), -len(r.origin_input_ids)))
        pool.remove(victim)
        self.kv.release(victim)
        victim.kv_len = 0
        victim.prefix_len = 0
        victim.num_retractions += 1
        self.waiting.appendleft(victim)
        self.stats.num_retractions += 1
        total_decoded = sum(len(r.output_ids) for r in self.running)
        total_max_new = sum(r.sampling_params.max_new_tokens for r in self.running) or 1
        self.new_token_ratio = min(
            1.0, (total_decoded + RETRACT_DECODE_STEPS * len(self.running)) / total_max_new)
        logger.info("retracted request %s (%d generated tokens); new_token_ratio %.3f",
                    victim.rid, len(victim.output_ids), self.new_token_ratio)

    def admit(self) -> None:
        """Move waiting requests to ``prefilling`` while rows, budget and reserved KV allow."""
        if not self.waiting or self.num_running() >= self.config.max_running_requests:
            return  # the common steady-decode step: no tallies to build
        ordered = self.policy.order(self.waiting, self.kv)
        if ordered is not None:
            self.waiting.clear()
            self.waiting.extend(ordered)
        # Running tallies over running + prefilling, each admission adding its own share: rescanning
        # every admitted request per admission made a step of many admissions quadratic.
        pending_prefill = sum(r.fill_len - r.kv_len for r in self.prefilling)
        reserved = self._reserved_tokens()
        while self.waiting and self.num_running() < self.config.max_running_requests:
            if self.config.prefill_room(self.runner.max_context_len, pending_prefill) <= 0:
                break  # this step's prefill budget is already spoken for
            # The first request in the policy's order that can run (one whose grammar still compiles waits).
            req = next((r for r in self.waiting if r.grammar_future is None), None)
            if req is None:
                break
            fill = req.fill_ids
            # Leave at least one token to compute: its logits give the next token. Prompt positions
            # still to be scored for their logprobs are computed too, never taken from the cache.
            limit = len(fill) - 1
            scored = req.next_scored_position
            if scored is not None:
                limit = min(limit, scored)
            match = self.kv.match_prefix(fill[:limit])
            prefix_len = int(match.kv_indices.numel())
            left_new = req.sampling_params.max_new_tokens - len(req.output_ids)
            cost = (len(fill) - prefix_len) + left_new * self.new_token_ratio
            # Locking the matched prefix removes it from the evictable pool: count it as spent.
            available = self.available_kv_tokens() - prefix_len
            if self.running or self.prefilling:
                if reserved + cost > available:
                    break
            elif len(fill) - prefix_len > available:
                break
            if not self.kv.admit(req, match):
                break  # no request-pool row free
            self.waiting.remove(req)
            sp = req.sampling_params
            if sp.wants_input_logprobs and sp.logprob_start_len == 0 and not req.input_token_logprobs:
                # The first prompt token follows nothing: SGLang reports it with a None logprob.
                req.input_token_logprobs.append(None)
                req.input_top_logprobs.append(None)
            if req.num_retractions == 0:
                req.cached_tokens = min(prefix_len, len(req.origin_input_ids))
                self.stats.cached_tokens += req.cached_tokens
                self.stats.prompt_tokens += len(req.origin_input_ids)
            self.prefilling.append(req)
            pending_prefill += len(fill) - prefix_len
            reserved += cost

    def _launch(self, batch: ScheduleBatch) -> InFlight:
        """Write the slot map, run the forward and the sampler; no host sync on the results."""
        fb = batch.to_forward_batch(self.runner.device)
        # Attention reads req_to_token for the new tokens too: map them before the forward (one
        # scatter for the whole batch).
        assert batch.token_rows is not None
        self.map_kv_slots(batch.token_rows, fb.positions, batch.out_cache_loc)
        sampled = batch.sampled
        reqs = [e.req for e in sampled]
        prev = self._last_sampling
        # Req compares by identity (eq=False): the list comparison checks the same requests in order.
        if reqs and prev is not None and prev.info.reusable_next_step and prev.reqs == reqs:
            # Steady decode: the same requests sample again; only their step index moved.
            fb.sampling_info = prev.info.with_steps([r.num_generated for r in reqs])
        elif sampled:
            fb.sampling_info = SamplingBatchInfo.build(
                [e.req.sampling_params for e in sampled],
                seeds=[e.req.seed for e in sampled],
                # Only penalty rows read the tokens themselves, and they have none pending (see
                # _needs_host_state); every other row gives just its step index, tokens still on the
                # device included (a range: no copy of the request's output).
                output_ids=[e.req.output_ids if e.req.sampling_params.has_penalties else range(e.req.num_generated)
                            for e in sampled],
                prompt_ids=[e.req.origin_input_ids for e in sampled],
                eos_token_ids=self.eos_token_ids,
                vocab_size=self.vocab_size,
                device=self.runner.device,
            )
        # Sampling info depends only on each request's params, seed and step count: the next step of the
        # same requests (compared by identity, in order) reuses it.
        self._last_sampling = _LastSampling(reqs, fb.sampling_info) if sampled else None
        # A constrained batch samples later (_sample), once its masks can be filled.
        constrained = any(r.grammar is not None for r in reqs)
        out = self.runner.forward_batch(fb, sample=not constrained)  # forward (+ sampler, host copy): no sync
        if out.input_logprobs is not None:
            assert fb.input_logprobs is not None
            self._store_input_logprobs(batch, fb.input_logprobs.counts, out.input_logprobs)
        if self.spec_worker is not None:
            self.spec_worker.after_target_forward(fb)  # a draft model mirrors the target's KV
        self.stats.forward_steps += 1
        self.stats.decode_rows += sum(e.is_decode for e in sampled)
        for e in batch.entries:
            e.req.kv_len += e.extend_len
        if not sampled:
            return InFlight(sampled, None)
        if self.on_logits is not None:
            self.on_logits([e.req for e in sampled], out.logits.next_token_logits)
        for e in sampled:
            if not e.is_decode:
                self.prefilling.remove(e.req)
                self.running.append(e.req)
            e.req.pending += 1
        if constrained:
            return InFlight(sampled, None, unsampled=(fb, out))
        self._set_future_tokens(sampled, out)
        return InFlight(sampled, out.host_copy)

    def _sample(self, launched: InFlight) -> None:
        """Fill the vocabulary mask of a constrained batch from its requests' matchers (each has
        accepted every token but the one this batch samples) and run the sampler."""
        assert launched.unsampled is not None and self.grammar_backend is not None
        fb, out = launched.unsampled
        matchers = []
        for e in launched.sampled:
            m = e.req.grammar
            # Invariant (plait.sampling.grammar): the matcher follows the host-known tokens. A
            # request finished meanwhile gets whatever row: its token is discarded.
            assert m is None or e.req.finished or m.num_accepted == len(e.req.output_ids), e.req.rid
            matchers.append(m)
        assert fb.sampling_info is not None
        fb.sampling_info.vocab_mask = to_device(self.grammar_backend.fill_vocab_mask(matchers), self.runner.device)
        out = self.runner.sample(fb, out.logits, out.input_logprobs)
        launched.unsampled = None
        launched.results = out.host_copy
        self._set_future_tokens(launched.sampled, out)

    @staticmethod
    def _set_future_tokens(sampled: list[BatchEntry], out: ForwardOutput) -> None:
        assert out.sample is not None and out.host_copy is not None
        for i, e in enumerate(sampled):
            e.req.future_token = (out.sample.next_token_ids, i)

    @staticmethod
    def _store_input_logprobs(batch: ScheduleBatch, counts: Sequence[int], scored: InputLogprobs) -> None:
        """Append the prompt-token logprobs a forward scored to their requests (entry order)."""
        k = 0
        for e, n in zip(batch.entries, counts, strict=True):
            if not n:
                continue
            req, top = e.req, e.req.sampling_params.top_logprobs
            req.input_token_logprobs.extend(scored.logprobs[k : k + n])
            for j in range(k, k + n):
                pairs = [] if scored.top_ids is None or scored.top_vals is None else list(
                    zip(scored.top_ids[j][:top], scored.top_vals[j][:top], strict=True))
                req.input_top_logprobs.append(pairs)
            k += n

    def _process(self, done: InFlight) -> None:
        """Read a launched batch's samples on the host: append tokens, check stops, release."""
        if done.results is None:
            return
        next_ids, logprobs, top_ids, top_vals = done.results.wait()
        append, updated = self._append_token, self._updated
        for i, e in enumerate(done.sampled):
            req = e.req
            req.pending -= 1
            if req.pending == 0:
                req.future_token = None
            if req.finish_reason is not None:
                # Finished while this batch was in flight (stop token, abort): drop the extra token.
                if req.pending == 0 and req in self._draining:
                    self._draining.remove(req)
                    self.kv.release(req)
                continue
            append(req, next_ids[i])
            if logprobs is not None and req.sampling_params.logprobs:
                req.output_logprobs.append(logprobs[i])
                if top_ids is not None and top_vals is not None and req.sampling_params.top_logprobs:
                    k = req.sampling_params.top_logprobs
                    # A grammar can leave fewer than k tokens possible: the impossible (-inf) are not listed.
                    req.output_top_logprobs.append([(t, v) for t, v in zip(top_ids[i][:k], top_vals[i][:k], strict=True)
                                                    if v != -math.inf])
            if req.finish_reason is not None:
                self._retire(req)
            updated.append(req)

    def _append_plain_tokens(self, req: Req, tokens: Sequence[int]) -> None:
        """``_append_token`` for each of ``tokens`` until one finishes the request, for a request
        without a grammar or stop strings (only stop tokens and lengths end it): one list extend."""
        sp = req.sampling_params
        n0 = len(req.output_ids)
        # Tokens until the length limit: the c-th token finishes when n0 + c >= max_new_tokens or
        # fill_len + c >= max_context_len (the first one at least, as _append_token checks after it).
        room = max(1, min(sp.max_new_tokens - n0, self.runner.max_context_len - req.fill_len))
        take = min(len(tokens), room)
        reason: FinishReason | None = FinishReason.LENGTH if take == room else None
        message = None
        for c in range(max(1, sp.min_new_tokens - n0), take + 1):  # stop tokens count from min_new_tokens
            token = tokens[c - 1]
            if self._is_stop_token(sp, token):
                take, reason, message = c, FinishReason.STOP, f"stop token {token}"
                break
        new = tokens[:take]
        req.output_ids.extend(new)
        self.stats.generation_tokens += take
        if req.detokenizer is not None:
            req.detokenizer.add_tokens(new)
        if reason is not None:
            self._finish(req, reason, message)

    def _is_stop_token(self, sp: SamplingParams, token: int) -> bool:
        return token in sp.stop_token_ids or (not sp.ignore_eos and token in self.eos_token_ids)

    def _append_token(self, req: Req, token: int) -> None:
        if req.grammar is not None and not req.grammar.accept_token(token):
            # The mask allows only grammar tokens, so this means a sampler row with nothing allowed
            # (e.g. min_new_tokens holding back the only token the grammar accepts).
            kind = req.sampling_params.grammar[0] if req.sampling_params.grammar else "grammar"
            self._finish(req, FinishReason.ABORT, f"token {token} is not allowed by the request's {kind}")
            return
        # The decode step's per-request path at hundreds of requests: locals over repeated attribute
        # and property reads.
        out = req.output_ids
        out.append(token)
        self.stats.generation_tokens += 1
        detok = req.detokenizer
        if detok is not None:
            detok.add_token(token)
        sp = req.sampling_params
        n = len(out)
        if n >= sp.min_new_tokens:
            if self._is_stop_token(sp, token):
                self._finish(req, FinishReason.STOP, f"stop token {token}")
                return
            if detok is not None and detok.stop and detok.find_stop():
                self._finish(req, FinishReason.STOP, "stop string")
                return
        if n >= sp.max_new_tokens or len(req.origin_input_ids) + n >= self.runner.max_context_len:
            self._finish(req, FinishReason.LENGTH, None)

    def _finish(self, req: Req, reason: FinishReason, message: str | None) -> None:
        req.finish_reason = reason
        req.finish_message = message
        if req.detokenizer is not None:
            req.detokenizer.finish()
        if self.spec_worker is not None:
            self.spec_worker.on_finish(req)
        if reason == FinishReason.ABORT:
            self.stats.num_aborts += 1

    def reset(self) -> None:
        """Back to the state after construction (the engine's warm-up ran requests through it): the
        KV side as new, the counters zero, the sampling reuse and the speculative state forgotten.
        Only when idle."""
        if self.has_work():
            raise RuntimeError("Scheduler.reset with requests in flight: finish or abort them first")
        self.kv.reset()
        self.stats = SchedulerStats()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * self.config.schedule_conservativeness
        self._last_sampling = None
        self._updated = []
        if self.spec_worker is not None:
            self.spec_worker.reset()

    def close(self) -> None:
        """Forget the pools and the prefix cache (the engine is shutting down and frees the device)."""
        # Dropped, not set to None: reading it after close raises AttributeError.
        vars(self).pop("kv", None)
        if self.spec_worker is not None:
            self.spec_worker.close()  # a draft model and its KV pool live there
        if self.grammar_backend is not None:
            self.grammar_backend.close()

    # --- introspection (tests, metrics) -----------------------------------------------------------
    def kv_tokens_in_use(self) -> int:
        """Slots neither free nor evictable: held by live requests (0 when idle)."""
        return self.kv.tokens_in_use()

    @property
    def tree_cache(self) -> RadixCache:
        """The prefix cache (front ends read its sizes; benchmarks reset it)."""
        return self.kv.tree_cache
