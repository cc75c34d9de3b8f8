"""Engine: the offline API. Tokenizes and validates in the caller's thread, then drives the engine
core's scheduler in-process until the requests it was given finish.

    with plait.Engine(model="/path/to/checkpoint") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out.text)
"""

from __future__ import annotations

import dataclasses
import logging
import time
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import nullcontext
from typing import Any

from plait import envs
from plait.config import EngineConfig
from plait.engine.core import LiveRequest, build_engine_core, matched_stop
from plait.engine.frontend import NO_TOKENIZER, Frontend, ParamsLike, Prompt, to_sampling_params
from plait.engine.generation_config import sampling_defaults
from plait.engine.heap import startup_heap_frozen
from plait.engine.outputs import (
    EngineLoad,
    LogprobLists,
    RequestOutput,
    StreamChunk,
    TokenText,
    finish_reason_dict,
)
from plait.sampling.params import SamplingParams
from plait.scheduler.req import Req

logger = logging.getLogger(__name__)

__all__ = ["Engine", "ParamsLike", "Prompt", "to_sampling_params"]


class Engine:
    """The offline engine. ``model`` (or SGLang's ``model_path``) is a checkpoint directory; the
    other keyword arguments are EngineConfig fields."""

    def __init__(self, model: str | None = None, model_path: str | None = None, **options: Any) -> None:
        if model is not None and model_path is not None and model != model_path:
            raise ValueError(f"model ({model!r}) and model_path ({model_path!r}) name the same setting: pass one")
        model = model if model is not None else model_path
        if model is None:
            from plait.models.demo import demo_model

            demo = demo_model()
            model = str(demo.path)
            logger.info("no model given: using the built-in demo model, %s, at %s", demo.description, model)
        self.config = EngineConfig.from_kwargs(model=model, **options)
        self.core = build_engine_core(self.config)
        # The core's parts under their own names: tests, benchmarks and the CLI reach them here.
        self.model_config = self.core.model_config
        self.tokenizer = self.core.tokenizer
        self.runner = self.core.runner
        self.scheduler = self.core.scheduler
        # Tokenization and validation are shared with the HTTP server (plait.engine.frontend).
        self.frontend = Frontend(self.tokenizer, self.core.limits, seed=self.config.seed,
                                 sampling_defaults=sampling_defaults(self.config),
                                 constrained=self.config.grammar_backend != "none",
                                 auto_truncate=self.config.allow_auto_truncate)
        self._closed = False

    # --- requests ---------------------------------------------------------------------------------
    def make_request(self, prompt: Prompt, params: ParamsLike = None, rid: str | None = None) -> Req:
        """Tokenize and validate; raises ValueError naming the field and the limit. Nothing is
        scheduled here, so a bad request affects no other."""
        prepared = self.frontend.prepare(prompt, params)
        return self.core.new_request(rid or uuid.uuid4().hex, prepared.input_ids, prepared.sampling_params,
                                     prepared.seed)

    def generate(self, prompt: Prompt | Sequence[Prompt] | None = None,
                 sampling_params: ParamsLike | Sequence[ParamsLike] = None, *,
                 input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
                 return_logprob: bool | None = None, logprob_start_len: int | None = None,
                 top_logprobs_num: int | None = None, return_text_in_logprobs: bool = False,
                 stream: bool = False) -> RequestOutput | list[RequestOutput] | Iterator[StreamChunk]:
        """One prompt (text or token ids) -> one RequestOutput; a list of prompts -> a list.

        SGLang's signature: ``prompt`` (one or a list), ``sampling_params`` (one or a list), and its
        keywords: ``input_ids`` instead of a prompt, ``return_logprob``,
        ``logprob_start_len`` (prompt-token logprobs from that index), ``top_logprobs_num``,
        ``return_text_in_logprobs`` (name each token in the logprob entries) and ``stream=True``,
        which returns ``generate_stream``'s iterator (one prompt only)."""
        if (prompt is None) == (input_ids is None):
            raise ValueError("pass exactly one of prompt (text or token ids, or a list of them) and input_ids")
        prompts = prompt if prompt is not None else input_ids
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int))
        prompt_list: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, Mapping)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        else:
            params_list = [sampling_params] * len(prompt_list)  # type: ignore[list-item]
        params_list = [with_logprob_options(p, return_logprob, logprob_start_len, top_logprobs_num)
                       for p in params_list]
        if return_text_in_logprobs and self.tokenizer is None:
            raise ValueError(f"return_text_in_logprobs: a token's text needs the tokenizer, {NO_TOKENIZER}")
        text = self._token_text if return_text_in_logprobs else None
        if stream:
            if not single:
                raise ValueError(f"stream=True takes one prompt, got {len(prompt_list)}")
            return self.generate_stream(prompt_list[0], params_list[0], token_text=text)
        start = time.perf_counter()
        with startup_heap_frozen() if envs.GC_FREEZE.get() else nullcontext():
            reqs = [self.make_request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
            for req in reqs:
                self.scheduler.add_request(req)
            while any(not r.finished for r in reqs):
                self.scheduler.step()
            self.scheduler.flush()
        outputs = [self._output(r, time.perf_counter() - start, text) for r in reqs]
        return outputs[0] if single else outputs

    def generate_stream(self, prompt: Prompt, sampling_params: ParamsLike = None,
                        token_text: TokenText = None) -> Iterator[StreamChunk]:
        """Yield text deltas as they are produced; the last chunk carries the finish reason.

        Leaving early (``break``, ``close()``, an exception in the consumer, the iterator garbage
        collected) aborts the request: it stops decoding and its KV slots are freed before the
        generator returns."""
        start = time.perf_counter()
        req = self.make_request(prompt, sampling_params)
        return self._stream(req, start, token_text)

    def _stream(self, req: Req, start: float, token_text: TokenText) -> Iterator[StreamChunk]:
        live = LiveRequest(req, stream_interval=self.config.stream_interval or 1)  # one stream: adaptive is 1
        self.scheduler.add_request(req)
        text = ""
        try:
            while True:
                if not req.finished:
                    self.scheduler.step()
                update = live.take_update()
                if update is not None:
                    text += update.text
                    meta = self._meta(req, time.perf_counter() - start, token_text) if req.finished else {}
                    yield StreamChunk(req.rid, update.text, update.token_ids, update.finish_reason, meta, text,
                                      list(req.output_ids))
                if req.finished:
                    self.scheduler.flush()
                    return
        finally:
            if not req.finished and not self._closed:
                self._abort_now(req)

    def _abort_now(self, req: Req) -> None:
        """Abort ``req`` and step until the scheduler has finished and released it."""
        if not self.scheduler.abort(req.rid):
            return  # not scheduled (anymore): nothing holds its KV
        while not req.finished:
            self.scheduler.step()
        self.scheduler.flush()

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

    def flush_cache(self) -> bool:
        """Empty the prefix cache, as SGLang's Engine.flush_cache does (benchmarks call it between
        runs); False while requests run or wait."""
        return self.core.flush_cache()

    def load(self) -> EngineLoad:
        """Running and waiting requests and the KV slots they hold, now."""
        s = self.scheduler
        return EngineLoad(num_running=s.num_running(), num_waiting=len(s.waiting),
                          kv_tokens_in_use=s.kv_tokens_in_use(), max_total_tokens=self.runner.total_kv_tokens)

    # --- results ----------------------------------------------------------------------------------
    def _token_text(self, tid: int) -> str:
        return self.tokenizer.decode([tid])

    def _meta(self, req: Req, e2e_latency: float | None = None, token_text: TokenText = None) -> dict[str, Any]:
        sp = req.sampling_params
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finish_reason_dict(req.finish_reason.value if req.finish_reason else None,
                                                req.finish_message, matched_stop(req), len(req.output_ids)),
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_message": req.finish_message,
            "num_retractions": req.num_retractions,
        }
        if e2e_latency is not None:
            meta["e2e_latency"] = e2e_latency
        if self.config.speculative_algorithm is not None:
            # Tokens gained per verify step (accepted drafts + the target's bonus token); 0.0 when
            # the request never took a speculative step.
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = req.spec_accepted_tokens / req.spec_verify_ct if req.spec_verify_ct else 0.0
        if sp.logprobs:
            lists = LogprobLists(req.output_logprobs, req.output_top_logprobs, req.input_token_logprobs,
                                 req.input_top_logprobs, req.origin_input_ids[max(sp.logprob_start_len, 0):],
                                 with_top=sp.top_logprobs > 0)
            meta.update(lists.entries(req.output_ids, token_text))
        return meta

    def _output(self, req: Req, e2e_latency: float | None = None, token_text: TokenText = None) -> RequestOutput:
        text = req.detokenizer.final_text() if req.detokenizer is not None else ""  # "": skip_tokenizer_init
        return RequestOutput(rid=req.rid, text=text, token_ids=list(req.output_ids),
                             finish_reason=req.finish_reason.value if req.finish_reason else None,
                             meta_info=self._meta(req, e2e_latency, token_text))

    # --- lifecycle --------------------------------------------------------------------------------
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


def with_logprob_options(params: ParamsLike, return_logprob: bool | None, logprob_start_len: int | None,
                         top_logprobs_num: int | None) -> ParamsLike:
    """Fold SGLang's request-level logprob options into sampling params (plait keeps them there):
    return_logprob -> logprobs, top_logprobs_num -> top_logprobs, logprob_start_len as is."""
    extra = {k: v for k, v in (("logprobs", return_logprob), ("top_logprobs", top_logprobs_num),
                                ("logprob_start_len", logprob_start_len)) if v is not None}
    if not extra:
        return params
    if isinstance(params, SamplingParams):
        return dataclasses.replace(params, **extra)
    return {**(params or {}), **extra}
