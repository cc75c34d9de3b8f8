"""The OpenAI endpoints' logic: a request is parsed and validated (plait.server.protocol, then
plait.engine.frontend, the offline Engine's checks), fanned out into one scheduler request per
choice, sent through the SchedulerClient, and the updates that come back are assembled into an
OpenAI response, whole or streamed as server-sent events."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from fastapi import Request
from starlette.responses import JSONResponse, Response

from plait.config import EngineConfig
from plait.engine.frontend import ContextLengthError, Frontend, PreparedRequest
from plait.engine.messages import RequestUpdate
from plait.sampling.params import SamplingParams, seed_to_int64
from plait.server import protocol
from plait.server.errors import APIError, bad_request
from plait.server.http import SSE_DONE, SSEResponse, read_acknowledgements, replayed, sse, unless_disconnected
from plait.server.logprobs import LogprobsRenderer, TopLogprobs, TopPairs
from plait.server.prompt_work import (
    PromptTooLong,
    PromptWork,
    check_rendered,
    encode_bounded,
    ids_only,
    tokenize_prompt,
)
from plait.server.scheduler_client import SchedulerClient
from plait.server.tool_calling import ChatOptions, ChatOutput, ToolPlan, plan_tools, template_messages

# OpenAI's default max_tokens for /v1/completions; chat completions default to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16

# One scheduler request's updates, tagged with the index of its choice.
Updates = AsyncGenerator[tuple[int, RequestUpdate], None]


@dataclass
class _Choice:
    """One choice's output so far, accumulated from its scheduler updates."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    text_offset: int = 0  # running character offset of token strings (completions logprobs)
    # echo: the prompt's logprobs (None for its first token), and whether the prompt went out.
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    echoed: bool = False

    def add(self, upd: RequestUpdate) -> None:
        self.text += upd.text
        self.token_ids += upd.token_ids
        self.input_logprobs += upd.input_logprobs or []
        self.input_top_logprobs += upd.input_top_logprobs or []
        if upd.logprobs:
            self.logprobs += upd.logprobs
        if upd.top_logprobs:
            self.top_logprobs += upd.top_logprobs
        self.completion_tokens = max(self.completion_tokens, upd.completion_tokens)
        self.cached_tokens = upd.cached_tokens
        if upd.finish_reason is not None:
            self.finish_reason = upd.finish_reason


@dataclass
class _Job:
    """One HTTP generation request after validation."""

    kind: Literal["completion", "chat"]
    id: str
    created: int
    model: str
    prompt_ids: list[list[int]]
    n: int
    prepared: list[PreparedRequest]
    logprobs: bool
    top_logprobs: int
    return_token_ids: bool
    include_usage: bool
    echo_texts: list[str] | None = None
    # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk carries the usage so far.
    continuous_usage: bool = False  # completions with echo: each prompt's text, put before its choices
    # Chat: turns a choice's text into content, reasoning_content and tool_calls.
    tool_plan: ToolPlan | None = None
    chat_options: ChatOptions = field(default_factory=ChatOptions)
    role: str = "assistant"  # the role of a chat reply's message

    def chat_output(self) -> ChatOutput:
        assert self.tool_plan is not None
        return ChatOutput.for_request(self.tool_plan, self.chat_options)

    def usage(self, choices: Sequence[_Choice]) -> dict[str, Any]:
        prompt = sum(len(ids) for ids in self.prompt_ids)
        completion = sum(c.completion_tokens for c in choices)
        cached = sum(choices[p * self.n].cached_tokens for p in range(len(self.prompt_ids)))
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}


class OpenAIServing:
    """/v1/completions, /v1/chat/completions and the model card, over one SchedulerClient."""

    def __init__(self, client: SchedulerClient, model_name: str, config: EngineConfig, *,
                 trust_request_chat_template: bool = False, max_rendered_chars: int = 16 * 2**20,
                 chat_options: ChatOptions | None = None, model_aliases: tuple[str, ...] = ()) -> None:
        self.client = client
        self.model_name = model_name
        self.model_aliases = model_aliases  # other names requests may use (vLLM's further --served-model-name)
        self.config = config
        self.trust_request_chat_template = trust_request_chat_template
        self.max_rendered_chars = max_rendered_chars
        self.chat_options = chat_options or ChatOptions()
        # Tokenization and templating run here, off the event loop (plait.server.prompt_work).
        self.prompt_work = PromptWork()
        self.created = int(time.time())
        self._renderer: LogprobsRenderer | None = None

    @property
    def frontend(self) -> Frontend:
        assert self.client.frontend is not None, "check_accepting() runs first"
        return self.client.frontend

    @property
    def renderer(self) -> LogprobsRenderer:
        # The tokenizer loads while the server starts; no request reaches here before it has.
        if self._renderer is None:
            self._renderer = LogprobsRenderer(self.client.tokenizer)
        return self._renderer

    def check_model(self, name: str | None) -> str:
        """The model name a response carries (see ``protocol.resolve_model``)."""
        return protocol.resolve_model(name, self.model_name, self.config.model, self.model_aliases)

    def _sampling(self, req: protocol.GenerationRequest, max_new: int, logprobs: bool, top: int,
                  max_name: str, logprob_start_len: int = -1, tool_plan: ToolPlan | None = None) -> SamplingParams:
        fields = protocol.sampling_dict(req, max_new, logprobs, top, logprob_start_len)
        if tool_plan is not None:
            fields = tool_plan.sampling_fields(fields)
        try:
            return self.frontend.sampling_params(fields)
        except ValueError as e:
            raise protocol.value_error_to_api(e, max_name) from None

    def _fit(self, ids: list[int], sp: SamplingParams, noun: str) -> tuple[list[int], SamplingParams]:
        try:
            return self.frontend.fit(ids, sp)
        except ContextLengthError as e:
            raise bad_request(e.openai_message(noun), "messages" if noun == "messages" else "prompt",
                              "context_length_exceeded") from None

    def _fan_out(self, fitted: list[tuple[list[int], SamplingParams]], n: int) -> list[PreparedRequest]:
        out = []
        for ids, sp in fitted:
            for j in range(n):
                # n choices of one seeded request: seed, seed+1, ... so they differ yet reproduce.
                seed = seed_to_int64(sp.seed + j) if sp.seed is not None else self.frontend.draw_seed(sp)
                out.append(PreparedRequest(ids, sp, seed))
        return out

    # --- /v1/completions ---
    def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts: list[Any] = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = list(prompt)
        if not prompts:
            raise bad_request("prompt must not be empty", "prompt")
        out = []
        for p in prompts:
            try:
                out.append(tokenize_prompt(self.frontend, p))
            except PromptTooLong as e:
                raise bad_request(str(e), "prompt", "context_length_exceeded") from None
            except ValueError as e:
                raise bad_request(str(e), "prompt") from None
        return out

    def _echo_texts(self, prompt: Any, prompt_ids: list[list[int]], truncated: list[bool]) -> list[str]:
        """What echo puts before each prompt's completions: the prompt as sent, or its tokens' text
        (always for a prompt --allow-auto-truncate cut: the text the model saw)."""
        texts: list[str | None] = [None] * len(prompt_ids)  # token-id prompts: their tokens' text
        if isinstance(prompt, str):
            texts = [prompt]
        elif prompt and isinstance(prompt[0], str):
            texts = list(prompt)
        if any(text is None or cut for text, cut in zip(texts, truncated, strict=True)):
            self.client.need_tokenizer("echo", "echoing a token-id prompt")
        return [text if text is not None and not cut else self.client.tokenizer.decode(ids)
                for text, ids, cut in zip(texts, prompt_ids, truncated, strict=True)]

    async def completions(self, request: Request) -> Response:
        req = protocol.parse_request(protocol.CompletionRequest, await request.body())
        protocol.check_completion(req)
        model = self.check_model(req.model)
        self.client.check_accepting()
        max_new = req.max_tokens if req.max_tokens is not None else DEFAULT_COMPLETION_MAX_TOKENS
        top = req.logprobs or 0
        if req.logprobs is not None:
            self.client.need_tokenizer("logprobs", "logprobs (each token named by its text)")
        # echo with logprobs scores the prompt too (OpenAI lists its tokens first).
        sp = self._sampling(req, max_new, req.logprobs is not None, top, "max_tokens", 0 if req.echo else -1)
        if ids_only(req.prompt):
            prompt_ids = self._completion_prompts(req.prompt)
        else:
            prompt_ids = await self.prompt_work.run(self._completion_prompts, req.prompt)
        fitted = [self._fit(ids, sp, "prompt") for ids in prompt_ids]
        truncated = [len(kept) < len(ids) for (kept, _), ids in zip(fitted, prompt_ids, strict=True)]
        prompt_ids = [ids for ids, _ in fitted]
        echo_texts = self._echo_texts(req.prompt, prompt_ids, truncated) if req.echo else None
        job = _Job("completion", f"cmpl-{uuid.uuid4().hex}", int(time.time()), model, prompt_ids, req.n,
                   self._fan_out(fitted, req.n), req.logprobs is not None, top, req.return_token_ids,
                   bool(req.stream_options and req.stream_options.include_usage), echo_texts,
                   continuous_usage=protocol.continuous_usage(req))
        return await self._respond(request, job, req.stream)

    # --- /v1/chat/completions ---
    def _chat_prompt(self, req: protocol.ChatCompletionRequest, tool_plan: ToolPlan) -> list[int]:
        tok = self.client.need_tokenizer("messages", "a chat completion (the chat template and the reply's text)")
        kwargs: dict[str, Any] = {"add_generation_prompt": req.add_generation_prompt,
                                  "continue_final_message": req.continue_final_message}
        if req.reasoning_effort is not None:
            kwargs["reasoning_effort"] = req.reasoning_effort
        kwargs.update(req.chat_template_kwargs or {})
        if req.chat_template is not None:
            kwargs["chat_template"] = req.chat_template
        if "chat_template" in kwargs and not self.trust_request_chat_template:
            # A template is code the server runs (and can render without bound): only the operator's.
            raise bad_request("a chat template supplied by the request is refused: this server renders only its "
                              "own (start it with --trust-request-chat-template to allow them)", "chat_template")
        if "chat_template" not in kwargs and self.chat_options.chat_template is not None:
            kwargs["chat_template"] = self.chat_options.chat_template  # --chat-template
        if not getattr(tok, "chat_template", None) and "chat_template" not in kwargs:
            raise bad_request("this model's tokenizer has no chat template; use /v1/completions or start the "
                              "server with --chat-template FILE", "messages")
        kwargs["tokenize"] = False
        kwargs["tools"] = tool_plan.template_tools()
        messages = template_messages(req)
        try:
            text = tok.apply_chat_template(messages, **kwargs)
        except Exception as e:  # a template or its kwargs rejected these messages: the client's input
            raise bad_request(f"the chat template failed on these messages: {type(e).__name__}: {e}",
                              "messages") from None
        try:
            check_rendered(text, self.max_rendered_chars)
            # The template writes the special tokens (BOS, turn markers) itself.
            ids = encode_bounded(self.frontend, text, add_special_tokens=False)
            self.frontend.check_input_ids(ids)
        except PromptTooLong as e:
            raise bad_request(str(e), "messages", "context_length_exceeded") from None
        except ValueError as e:
            raise bad_request(str(e), "messages") from None
        return ids

    async def chat(self, request: Request) -> Response:
        req = protocol.parse_request(protocol.ChatCompletionRequest, await request.body())
        protocol.check_chat(req)
        model = self.check_model(req.model)
        self.client.check_accepting()
        tool_plan = plan_tools(req, self.chat_options)
        ids = await self.prompt_work.run(self._chat_prompt, req, tool_plan)
        if req.max_completion_tokens is not None:
            max_name, max_new = "max_completion_tokens", req.max_completion_tokens
        elif req.max_tokens is not None:
            max_name, max_new = "max_tokens", req.max_tokens
        else:  # OpenAI: up to the context limit
            max_name, max_new = "max_completion_tokens", max(1, self.frontend.limits.max_request_tokens - len(ids))
        top = req.top_logprobs or 0
        sp = self._sampling(req, max_new, req.logprobs, top, max_name, tool_plan=tool_plan)
        ids, sp = self._fit(ids, sp, "messages")
        job = _Job("chat", f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model, [ids], req.n,
                   self._fan_out([(ids, sp)], req.n), req.logprobs, top, req.return_token_ids,
                   bool(req.stream_options and req.stream_options.include_usage), tool_plan=tool_plan,
                   continuous_usage=protocol.continuous_usage(req),
                   chat_options=self.chat_options,
                   role=self.chat_options.response_role if req.add_generation_prompt else req.messages[-1].role)
        return await self._respond(request, job, req.stream)

    # --- running a job ---
    async def _respond(self, request: Request, job: _Job, stream: bool) -> Response:
        gen = self.client.generate(job.prepared, stream=stream)
        if not stream:
            body = await unless_disconnected(request, self._full(job, gen))
            return JSONResponse(body) if body is not None else Response(status_code=499)
        # Commit to a 200 only once every choice was accepted by the scheduler (a full queue must be
        # a 503, not an error inside a 200 stream): read up to the acknowledgements first.
        primed = await unless_disconnected(request, read_acknowledgements(gen, len(job.prepared)))
        if primed is None:
            return Response(status_code=499)
        return SSEResponse(self._stream(job, gen, primed))


    async def _full(self, job: _Job, gen: Updates) -> dict[str, Any]:
        choices = [_Choice() for _ in job.prepared]
        try:
            async for i, upd in gen:
                choices[i].add(upd)
        finally:
            await gen.aclose()
        out = []
        for i, c in enumerate(choices):
            text, lp = self._with_echo(job, i, c, c.text, c.token_ids, c.logprobs, c.top_logprobs)
            if job.kind == "chat":
                output = job.chat_output()
                choice: dict[str, Any] = {"index": i, "message": {**output.message(c.text), "role": job.role},
                                          "logprobs": lp,
                                          "finish_reason": output.finish_reason(c.finish_reason)}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": c.finish_reason}
            if job.return_token_ids:
                choice["token_ids"] = c.token_ids
                choice["prompt_token_ids"] = job.prompt_ids[i // job.n]
            out.append(choice)
        obj = "chat.completion" if job.kind == "chat" else "text_completion"
        return {"id": job.id, "object": obj, "created": job.created, "model": job.model, "choices": out,
                "usage": job.usage(choices)}

    async def _stream(self, job: _Job, gen: Updates,
                      primed: list[tuple[int, RequestUpdate]]) -> AsyncGenerator[bytes, None]:
        chat = job.kind == "chat"
        obj = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": job.id, "object": obj, "created": job.created, "model": job.model}
        if job.include_usage:
            head["usage"] = None
        choices = [_Choice() for _ in job.prepared]
        outputs = [job.chat_output() for _ in job.prepared] if chat else []

        def chunk(i: int, upd: RequestUpdate | None, finish: str | None, first: bool = False,
                  delta: dict[str, Any] | None = None) -> str:
            c = choices[i]
            lp = None
            text = upd.text if upd is not None else ""
            if upd is not None and job.echo_texts is not None and not c.echoed:
                c.echoed = True
                text, lp = self._with_echo(job, i, c, text, upd.token_ids, upd.logprobs or [], upd.top_logprobs or [])
            elif upd is not None and upd.token_ids:
                lp = self._logprobs(job, c, upd.token_ids, upd.logprobs or [], upd.top_logprobs or [])
            if chat:
                if first:
                    delta = {"role": job.role, "content": ""}
                choice: dict[str, Any] = {"index": i, "delta": delta or {}, "logprobs": lp, "finish_reason": finish}
            else:
                choice = {"index": i, "text": text, "logprobs": lp, "finish_reason": finish}
            if job.return_token_ids:
                choice["token_ids"] = upd.token_ids if upd is not None else []
                if first or (not chat and upd is not None and c.completion_tokens == len(upd.token_ids)):
                    choice["prompt_token_ids"] = job.prompt_ids[i // job.n]
            return sse({**head, "choices": [choice], **({"usage": job.usage(choices)} if job.continuous_usage else {})})

        try:
            if chat:
                for i in range(len(choices)):
                    yield chunk(i, None, None, first=True)
            async for i, upd in replayed(primed, gen):
                choices[i].add(upd)
                has_content = bool(upd.text or upd.token_ids)
                if chat:
                    # Parsers may hold text back (a marker's start) or split it into reasoning,
                    # content and tool-call deltas: one chunk each; the tokens' logprobs and ids
                    # ride on the first, or on an empty delta.
                    deltas = outputs[i].feed(upd.text) if upd.text else []
                    if upd.finish_reason is not None:
                        deltas += outputs[i].finish()
                    if has_content and not deltas:
                        deltas = [{}]
                    for k, d in enumerate(deltas):
                        yield chunk(i, upd if k == 0 else None, None, delta=d)
                    if upd.finish_reason is not None:
                        yield chunk(i, None, outputs[i].finish_reason(upd.finish_reason))
                elif has_content or upd.finish_reason is not None:
                    yield chunk(i, upd, upd.finish_reason)
            if job.include_usage:
                yield sse({**head, "choices": [], "usage": job.usage(choices)})
        except APIError as e:  # the status line went out already: report in-band, as OpenAI does
            yield sse(e.body())
        finally:
            await gen.aclose()
        yield SSE_DONE

    # --- logprobs ---
    def _with_echo(self, job: _Job, i: int, c: _Choice, text: str, ids: Sequence[int], lps: Sequence[float],
                   tops: TopLogprobs) -> tuple[str, dict[str, Any] | None]:
        """A completion's text and logprobs, behind its prompt's when the request echoes it."""
        if job.echo_texts is None:
            return text, self._logprobs(job, c, ids, lps, tops)
        prompt = job.prompt_ids[i // job.n]
        return job.echo_texts[i // job.n] + text, self._logprobs(
            job, c, [*prompt, *ids], [*c.input_logprobs, *lps], [*c.input_top_logprobs, *tops])

    def _logprobs(self, job: _Job, c: _Choice, ids: Sequence[int], lps: Sequence[float | None],
                  tops: Sequence[TopPairs | None]) -> dict[str, Any] | None:
        if not job.logprobs:
            return None
        if job.kind == "chat":
            return self.renderer.chat(ids, lps, tops)
        body, c.text_offset = self.renderer.completion(ids, lps, tops, bool(job.top_logprobs), c.text_offset)
        return body

    # --- other endpoints ---
    @property
    def attention_backend(self) -> str | None:
        """The attention backend /v1/models and /server_info report, None until the model is loaded:
        the scheduler process names the kernels that serve prefill and decode batches
        (plait.attention.hybrid.serving_backend_name), e.g. hybrid(prefill=torch_flash,decode=triton)."""
        ready = self.client.ready
        return ready.runner_info.get("attention_backend") if ready is not None else None

    def model_card(self) -> dict[str, Any]:
        limits = self.client.frontend.limits.max_request_tokens if self.client.frontend else None
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "plait",
                "root": self.config.model, "max_model_len": limits, "attention_backend": self.attention_backend}
