"""Engine: the offline API. Tokenizes and validates in the caller's thread, then drives the engine
core's scheduler in-process until the requests it was given finish.

    with plait.Engine(model="/path/to/checkpoint") as engine:
        out = engine.generate("The capital of France is", {"max_new_tokens": 16, "temperature": 0})
        print(out.text)
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from plait.config import EngineConfig
from plait.engine.core import LiveRequest, build_engine_core
from plait.engine.frontend import Frontend, ParamsLike, Prompt, to_sampling_params
from plait.engine.outputs import RequestOutput, StreamChunk
from plait.scheduler.req import Req

logger = logging.getLogger(__name__)

__all__ = ["Engine", "ParamsLike", "Prompt", "to_sampling_params"]


class Engine:
    def __init__(self, model: str | None = None, **options: Any) -> None:
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
        self.frontend = Frontend(self.tokenizer, self.core.limits, seed=self.config.seed)
        self._closed = False

    # --- requests ---------------------------------------------------------------------------------
    def make_request(self, prompt: Prompt, params: ParamsLike = None, rid: str | None = None) -> Req:
        """Tokenize and validate; raises ValueError naming the field and the limit. Nothing is
        scheduled here, so a bad request affects no other."""
        prepared = self.frontend.prepare(prompt, params)
        return self.core.new_request(rid or uuid.uuid4().hex, prepared.input_ids, prepared.sampling_params,
                                     prepared.seed)

    def generate(self, prompts: Prompt | Sequence[Prompt], sampling_params: ParamsLike | Sequence[ParamsLike] = None,
                 ) -> RequestOutput | list[RequestOutput]:
        """One prompt (text or token ids) -> one RequestOutput; a list of prompts -> a list."""
        single = isinstance(prompts, str) or (
            isinstance(prompts, Sequence) and len(prompts) > 0 and isinstance(prompts[0], int))
        prompt_list: list[Prompt] = [prompts] if single else list(prompts)  # type: ignore[list-item]
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, (str, Mapping)):
            params_list = list(sampling_params)
            if len(params_list) != len(prompt_list):
                raise ValueError(f"sampling_params has {len(params_list)} entries for {len(prompt_list)} prompts")
        else:
            params_list = [sampling_params] * len(prompt_list)  # type: ignore[list-item]
        reqs = [self.make_request(p, sp) for p, sp in zip(prompt_list, params_list, strict=True)]
        for req in reqs:
            self.scheduler.add_request(req)
        while any(not r.finished for r in reqs):
            self.scheduler.step()
        self.scheduler.flush()
        outputs = [self._output(r) for r in reqs]
        return outputs[0] if single else outputs

    def generate_stream(self, prompt: Prompt, sampling_params: ParamsLike = None) -> Iterator[StreamChunk]:
        """Yield text deltas as they are produced; the last chunk carries the finish reason."""
        req = self.make_request(prompt, sampling_params)
        live = LiveRequest(req)
        self.scheduler.add_request(req)
        while True:
            if not req.finished:
                self.scheduler.step()
            update = live.take_update()
            if update is not None:
                yield StreamChunk(req.rid, update.text, update.token_ids, update.finish_reason,
                                  self._meta(req) if req.finished else {})
            if req.finished:
                self.scheduler.flush()
                return

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

    # --- results ----------------------------------------------------------------------------------
    def _meta(self, req: Req) -> dict[str, Any]:
        meta: dict[str, Any] = {
            "prompt_tokens": len(req.origin_input_ids),
            "completion_tokens": len(req.output_ids),
            "cached_tokens": req.cached_tokens,
            "finish_message": req.finish_message,
            "num_retractions": req.num_retractions,
        }
        if self.config.speculative_algorithm is not None:
            # Tokens gained per verify step (accepted drafts + the target's bonus token); 0.0 when
            # the request never took a speculative step.
            meta["spec_verify_ct"] = req.spec_verify_ct
            meta["spec_accept_length"] = req.spec_accepted_tokens / req.spec_verify_ct if req.spec_verify_ct else 0.0
        if req.sampling_params.logprobs:
            meta["output_token_logprobs"] = list(zip(req.output_logprobs, req.output_ids, strict=False))
            if req.sampling_params.top_logprobs:
                meta["output_top_logprobs"] = req.output_top_logprobs
        return meta

    def _output(self, req: Req) -> RequestOutput:
        return RequestOutput(rid=req.rid, text=req.detokenizer.final_text(), token_ids=list(req.output_ids),
                             finish_reason=req.finish_reason.value if req.finish_reason else None,
                             meta_info=self._meta(req))

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
