"""The engine core: what one EngineConfig runs, built in one place, and the per-request increments
every front end reports.

Two front ends drive a core: the offline ``Engine`` (in the caller's thread) and the scheduler
process (over ZMQ, for the HTTP server). Both call ``build_engine_core``, which picks the layout the
config describes (one device, a tensor-parallel leader, data-parallel replicas, DP attention) and
constructs the model runner and the scheduler for it; neither front end constructs either itself.
Both turn a request's progress into output with ``LiveRequest.take_update``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from plait.config import EngineConfig
from plait.engine.frontend import RequestLimits
from plait.engine.messages import PlainRow, RequestUpdate
from plait.engine.warmup import WarmupReport, run_warmup, should_warm_up
from plait.executor.model_runner import ModelRunner
from plait.models.loader import ModelConfig, load_config_tokenizer, load_target_config
from plait.parallel.roles import EngineRunner, EngineScheduler
from plait.sampling.params import SamplingParams
from plait.scheduler.detokenizer import IncrementalDetokenizer, prepare_tokenizer
from plait.scheduler.req import FinishReason, Req
from plait.scheduler.scheduler import Scheduler
from plait.speculative.factory import create_spec_worker

logger = logging.getLogger(__name__)


class EngineCore:
    """The model, its tokenizer, the model runner and the scheduler of one engine.

    ``runner`` and ``scheduler`` are the front objects of the layout: a ``ModelRunner`` and a
    ``Scheduler`` on one device, or their data-parallel / DP-attention / TP-leader counterparts, which
    answer the same calls. The core owns both: ``close`` releases them.
    """

    def __init__(self, config: EngineConfig, model_config: ModelConfig, tokenizer: Any, runner: EngineRunner,
                 scheduler: EngineScheduler) -> None:
        self.config = config
        self.model_config = model_config
        self.tokenizer = tokenizer
        self.runner = runner
        self.scheduler = scheduler
        self.warmup: WarmupReport | None = None  # what the start-up warm-up ran (None: it did not run)

    @property
    def limits(self) -> RequestLimits:
        """What a request is validated against, once the KV pool is sized."""
        return RequestLimits(self.model_config.vocab_size, self.runner.max_context_len,
                             self.runner.max_total_tokens)

    def flush_cache(self) -> bool:
        """Empty the prefix cache (SGLang's flush_cache); False, and nothing changed, while requests
        run or wait (their prefixes are locked in it)."""
        if self.scheduler.has_work():
            return False
        self.scheduler.tree_cache.reset()
        return True

    def new_request(self, rid: str, input_ids: list[int], sampling_params: SamplingParams, seed: int,
                    detokenize: bool = True) -> Req:
        """A scheduler request for validated input, with the detokenizer that follows its text (stop
        strings included). ``detokenize`` False (a front end that makes the text itself, for a request
        without stop strings): no detokenizer, the updates carry token ids and no text. Nothing is
        scheduled here."""
        if not detokenize and sampling_params.stop:
            raise ValueError(f"request {rid}: stop strings are matched on the scheduler's text, so it must "
                             "detokenize (detokenize=True)")
        # Without a tokenizer (skip_tokenizer_init) there is no text to make (the front end refuses stop
        # strings then).
        detokenize = detokenize and self.tokenizer is not None
        detok = IncrementalDetokenizer.for_request(self.tokenizer, input_ids, sampling_params) if detokenize else None
        return Req(rid=rid, origin_input_ids=input_ids, sampling_params=sampling_params, seed=seed,
                   detokenizer=detok)

    def close(self) -> None:
        """Abort every request, run the scheduler until it is idle, then release the scheduler and the
        runner (and with them the other ranks, the draft model, the KV pool)."""
        scheduler = self.scheduler
        for req in list(scheduler.waiting) + scheduler.prefilling + scheduler.running:
            scheduler.abort(req.rid)
        while scheduler.has_work():
            scheduler.step()
        if scheduler.spec_worker is not None:
            scheduler.spec_worker.log_stats()  # the engine's acceptance distribution
        scheduler.close()
        self.runner.close()


def build_engine_core(config: EngineConfig) -> EngineCore:
    """Load the model's config and tokenizer and build the runner and the scheduler for ``config``'s
    layout. The one place either is constructed for a front end."""
    model_config = load_target_config(config, config.resolved_device())
    tokenizer = load_config_tokenizer(config)
    prepare_tokenizer(tokenizer)
    from plait.parallel.data_parallel import is_plain_data_parallel
    from plait.sampling.grammar import grammar_backend_for  # xgrammar: imported once a core is built

    if is_plain_data_parallel(config):
        # dp_size independent replicas (each with its own TP group when tp_size > 1), and a front-end
        # balancer over the replicas' schedulers (shortest queue).
        from plait.parallel.data_parallel import DataParallelRunner, DataParallelScheduler

        replicas = DataParallelRunner(config, model_config)
        dp_scheduler = DataParallelScheduler(config, replicas)
        for replica in dp_scheduler.replicas:
            replica.grammar_backend = grammar_backend_for(tokenizer, model_config)
        return _warmed(EngineCore(config, model_config, tokenizer, replicas, dp_scheduler))
    runner: ModelRunner
    if config.tp_size > 1:
        # This process is rank 0 (it schedules and samples); the other ranks are spawned from here.
        from plait.parallel.dp_attention import DPAttentionLeader, DPAttentionScheduler
        from plait.parallel.launch import start_tensor_parallel

        leader = start_tensor_parallel(config, model_config)
        if isinstance(leader, DPAttentionLeader):
            # Every rank schedules its own requests; this front end balances them over the ranks.
            grammars = grammar_backend_for(tokenizer, model_config)
            return _warmed(EngineCore(config, model_config, tokenizer, leader,
                                      DPAttentionScheduler(config, leader, grammars)))
        runner = leader
    else:
        runner = ModelRunner(config, model_config)
    # --- the scheduler ---
    scheduler = Scheduler(config, runner, create_spec_worker(config, runner),
                          grammar_backend=grammar_backend_for(tokenizer, model_config))
    return _warmed(EngineCore(config, model_config, tokenizer, runner, scheduler))


def _warmed(core: EngineCore) -> EngineCore:
    """``core`` after the start-up warm-up, when the config asks for one (plait.engine.warmup)."""
    if should_warm_up(core.config):
        core.warmup = run_warmup(core)
    return core


# The adaptive stream interval (EngineConfig.stream_interval None): each stream gets every token while
# at most STREAMS_PER_INTERVAL requests are live, then one update per ceil(live / STREAMS_PER_INTERVAL)
# tokens, at most MAX_ADAPTIVE_INTERVAL. Every update costs the scheduler process its text delta and
# pickling and the HTTP process an event (tens of microseconds each): at hundreds of streams a step's
# updates take longer than the step, and the HTTP process merges a lagging stream's tokens into one event
# anyway, so they are merged here, before either process pays for them.
STREAMS_PER_INTERVAL = 64
MAX_ADAPTIVE_INTERVAL = 8


def adaptive_stream_interval(live_requests: int) -> int:
    """Output tokens per streamed update at ``live_requests`` requests in flight (at least 1)."""
    return min(MAX_ADAPTIVE_INTERVAL, max(1, -(-live_requests // STREAMS_PER_INTERVAL)))


@dataclass
class LiveRequest:
    """A request a front end reports on, and how much of it was reported.

    ``stream``: text deltas at every update; otherwise one update with the first token and then the
    finishing one, which carries the rest and the whole text (stop strings are still checked as tokens
    arrive). ``sent_tokens`` counts the output tokens already reported, so an update is exact whatever
    a step delivered (several tokens under speculative decoding, one step late under overlap
    scheduling, none for a request aborted while waiting).
    """

    req: Req
    stream: bool = True
    # take_update's interval: report a running request once this many output tokens are unreported (its
    # first token and its end at once); take_update_into is given its interval each step.
    stream_interval: int = 1
    sent_tokens: int = 0
    sent_input_logprobs: int = 0

    def take_update(self) -> RequestUpdate | None:
        """What the request produced since the previous call (the finishing update carries the finish
        reason), or None when it produced nothing and is not finished, or while fewer than
        ``stream_interval`` tokens wait after its first."""
        taken = self._take(self.stream_interval)
        return None if taken is None else self._update(*taken)

    def take_update_into(self, rows: list[PlainRow], interval: int) -> RequestUpdate | None:
        """``take_update`` at ``interval``, but a plain update (new tokens and text of a running request,
        nothing else) is appended to ``rows`` (``UpdateBatch.rows``) instead of returned: what the
        scheduler process does for every running request every step."""
        taken = self._take(interval)
        if taken is None:
            return None
        start, n, in_start, n_in, finished, text = taken
        req = self.req
        if finished or n_in > in_start or req.sampling_params.logprobs:
            return self._update(*taken)
        rows.append((req.rid, req.output_ids[start:n], text, len(req.origin_input_ids), n, req.cached_tokens))
        return None

    def _take(self, interval: int) -> tuple[int, int, int, int, bool, str] | None:
        """Mark what the request produced since the previous call as reported: (first and end output
        token, first and end prompt logprob, finished, the text delta), or None (nothing to report)."""
        req = self.req
        n = len(req.output_ids)
        start = self.sent_tokens
        n_in, in_start = len(req.input_token_logprobs), self.sent_input_logprobs
        finished = req.finished  # read once: this runs for every live request every step
        # A request that does not stream reports its first token (the front end's time to first token)
        # and then only its end: nobody reads its tokens before, and each update costs both processes.
        held = 0 < start and (n - start < interval or not self.stream)
        if not finished and (n == start and n_in == in_start or held):
            return None
        detok = req.detokenizer
        text = detok.take_delta(finished) if detok is not None and (self.stream or finished) else ""
        self.sent_tokens, self.sent_input_logprobs = n, n_in
        return start, n, in_start, n_in, finished, text

    def _update(self, start: int, n: int, in_start: int, n_in: int, finished: bool, text: str) -> RequestUpdate:
        req = self.req
        update = RequestUpdate(req.rid, req.output_ids[start:n], text, prompt_tokens=len(req.origin_input_ids),
                               completion_tokens=n, cached_tokens=req.cached_tokens)
        sp = req.sampling_params
        if sp.logprobs:
            update.logprobs = req.output_logprobs[start:n]
            if sp.top_logprobs:
                update.top_logprobs = req.output_top_logprobs[start:n]
        if n_in > in_start:
            update.input_logprobs = req.input_token_logprobs[in_start:n_in]
            update.input_top_logprobs = req.input_top_logprobs[in_start:n_in]
        if finished:
            assert req.finish_reason is not None
            update.finish_reason = req.finish_reason.value
            update.finish_message = req.finish_message
            update.matched_stop = matched_stop(req)
        return update


def matched_stop(req: Req) -> int | str | None:
    """What ended a request that finished with "stop": its stop string, else its last token (the
    stop token or EOS the scheduler stopped at); None for other finishes."""
    if req.finish_reason != FinishReason.STOP:
        return None
    string = req.detokenizer.matched_stop() if req.detokenizer is not None else None
    if string is not None:
        return string
    return req.output_ids[-1] if req.output_ids else None
