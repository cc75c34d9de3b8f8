"""Engine: the offline API. Tokenizes and validates in the caller's thread, then drives the
scheduler in-process until the requests it was given finish.

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
from plait.engine.frontend import Frontend, ParamsLike, Prompt, RequestLimits, to_sampling_params
from plait.engine.outputs import RequestOutput, StreamChunk
from plait.executor.model_runner import ModelRunner
from plait.models.loader import load_model_config
from plait.scheduler.detokenizer import IncrementalDetokenizer
from plait.scheduler.req import Req
from plait.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)

__all__ = ["Engine", "ParamsLike", "Prompt", "to_sampling_params"]


class Engine:
    def __init__(self, model: str | None = None, **options: Any) -> None:
        if model is None:
            from plait.models.tiny import demo_model_path

            model = str(demo_model_path())
            logger.info("no model given: using the built-in demo model at %s (random weights)", model)
        self.config = EngineConfig.from_kwargs(model=model, **options)
        device = self.config.resolved_device()
        self.model_config = load_model_config(model, self.config.dtype, device, self.config.context_length)
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(self.config.tokenizer or model)
        from plait.parallel.data_parallel import is_plain_data_parallel

        if is_plain_data_parallel(self.config):
            # dp_size independent replicas (each with its own TP group when tp_size > 1).
            from plait.parallel.data_parallel import DataParallelRunner, DataParallelScheduler

            self.runner = DataParallelRunner(self.config, self.model_config)  # type: ignore[assignment]
        elif self.config.tp_size > 1:
            # This process is rank 0 (it schedules and samples); the other ranks are spawned here.
            from plait.parallel.launch import start_tensor_parallel

            self.runner = start_tensor_parallel(self.config, self.model_config)
        else:
            self.runner = ModelRunner(self.config, self.model_config)
        if is_plain_data_parallel(self.config):
            # A front-end balancer over the replicas' schedulers (shortest queue).
            self.scheduler = DataParallelScheduler(self.config, self.runner)  # type: ignore[assignment,arg-type]
        elif self.config.enable_dp_attention:
            # Every rank schedules its own requests; this front end balances them over the ranks.
            from plait.parallel.dp_attention import DPAttentionScheduler

            self.scheduler = DPAttentionScheduler(self.config, self.runner)  # type: ignore[assignment]
        else:
            self.scheduler = Scheduler(self.config, self.runner)
        # Tokenization and validation are shared with the HTTP server (plait.engine.frontend).
        self.frontend = Frontend(self.tokenizer, RequestLimits(self.model_config.vocab_size,
                                                               self.runner.max_context_len,
                                                               self.runner.max_total_tokens),
                                 seed=self.config.seed)
        self._closed = False

    # --- requests ---------------------------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        return self.frontend.tokenize(prompt)

    def make_request(self, prompt: Prompt, params: ParamsLike = None, rid: str | None = None) -> Req:
        """Tokenize and validate; raises ValueError naming the field and the limit. Nothing is
        scheduled here, so a bad request affects no other."""
        prepared = self.frontend.prepare(prompt, params)
        sp = prepared.sampling_params
        detok = IncrementalDetokenizer(self.tokenizer, prepared.input_ids, sp.stop, sp.skip_special_tokens)
        return Req(rid=rid or uuid.uuid4().hex, origin_input_ids=prepared.input_ids, sampling_params=sp,
                   seed=prepared.seed, detokenizer=detok)

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
        self.scheduler.add_request(req)
        sent_tokens = 0
        while True:
            if not req.finished:
                self.scheduler.step()
            delta = req.detokenizer.take_delta(req.finished)
            new_ids = req.output_ids[sent_tokens:]
            sent_tokens = len(req.output_ids)
            if delta or new_ids or req.finished:
                yield StreamChunk(req.rid, delta, new_ids,
                                  req.finish_reason.value if req.finish_reason else None,
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
        for req in list(self.scheduler.waiting) + self.scheduler.prefilling + self.scheduler.running:
            self.scheduler.abort(req.rid)
        while self.scheduler.has_work():
            self.scheduler.step()
        if self.scheduler.spec_worker is not None:
            self.scheduler.spec_worker.log_stats()  # the engine's acceptance distribution
        self.scheduler.close()
        self.runner.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
