"""SGLang's native HTTP API, so SGLang users' scripts run unchanged against ``plait serve``.

Routes (request and response shapes as SGLang's ``http_server.py`` and ``io_struct.py`` lay them out):

* ``POST /generate``: ``text`` or ``input_ids`` (one prompt or a batch), ``sampling_params`` with
  SGLang's names (one dict, or one per prompt; ``n`` samples per prompt), ``rid``, ``stream``,
  ``return_logprob``, ``top_logprobs_num``, ``logprob_start_len`` (prompt scoring) and
  ``return_text_in_logprobs``. Answers ``{"text", "output_ids", "meta_info"}`` (a list for a batch or
  ``n`` > 1; ``meta_info`` as plait.engine.outputs describes it). Streamed: ``data: {...}`` events
  with the text and tokens so far (a batch's carry their ``index``), then ``data: [DONE]``.
* ``POST /v1/tokenize`` and ``/tokenize``: ``{"model", "prompt", "add_special_tokens"}`` ->
  ``{"tokens", "count", "max_model_len"}``; ``POST /v1/detokenize`` and ``/detokenize``:
  ``{"model", "tokens"}`` -> ``{"text"}``. A list of prompts (or of token lists) gives lists.
* ``GET /health_generate``: 200 once a one-token generation went through the scheduler, else 503.
* ``GET /get_model_info``, ``GET /get_server_info``.
* ``POST /flush_cache``: empties the prefix cache (400 while requests run or wait).
* ``POST /abort_request``: ``{"rid"}`` (or ``{"abort_all": true}``) aborts requests in flight.

Errors are OpenAI-shaped 400s naming the field, as on the OpenAI routes.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from pydantic import BaseModel, ConfigDict, ValidationError
from starlette.responses import JSONResponse, PlainTextResponse, Response

from plait.config import EngineConfig
from plait.engine.frontend import ContextLengthError, PreparedRequest
from plait.engine.messages import RequestUpdate
from plait.engine.outputs import LogprobLists, TokenText, finish_reason_dict
from plait.sampling.params import MAX_TOP_LOGPROBS, SamplingParams, seed_to_int64
from plait.server import protocol
from plait.server.errors import APIError, bad_request, unsupported
from plait.server.http import SSE_DONE, SSEResponse, read_acknowledgements, replayed, sse, unless_disconnected
from plait.server.prompt_work import PromptTooLong, PromptWork, tokenize_prompt
from plait.server.scheduler_client import SchedulerClient, State

# SGLang's bound on /health_generate's probe (HEALTH_CHECK_TIMEOUT).
HEALTH_GENERATE_TIMEOUT_S = 20.0
# Logprob options live on the request in SGLang, in SamplingParams in plait: not sampling_params keys.
_REQUEST_LEVEL = frozenset({"logprobs", "top_logprobs", "logprob_start_len"})
NATIVE_SAMPLING_KEYS: frozenset[str] = frozenset(
    set(SamplingParams.field_names()) - _REQUEST_LEVEL
    | {"n", "sampling_seed", "spaces_between_special_tokens"})

T = TypeVar("T")
ModelT = TypeVar("ModelT", bound=BaseModel)


# --- request schemas ------------------------------------------------------------------------------
class GenerateReqInput(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    return_logprob: bool | list[bool] | None = None
    logprob_start_len: int | list[int] | None = None
    top_logprobs_num: int | list[int] | None = None
    return_text_in_logprobs: bool = False
    stream: bool = False


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    prompt: str | list[str]
    add_special_tokens: bool = True


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    tokens: list[int] | list[list[int]]


class AbortReq(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)

    rid: str = ""
    abort_all: bool = False


def parse_body(cls: type[ModelT], body: bytes) -> ModelT:
    """Strict parse; unknown fields are a 400 naming them (SGLang fields plait lacks included)."""
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        message, param = protocol.describe_errors(e.errors())
        if e.errors()[0]["type"] == "extra_forbidden":
            message = f"Unrecognized request argument supplied: {param}"
        raise bad_request(message, param) from None
    unknown = sorted(req.model_extra or {})
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    return req


# --- /generate: one prompt of a request, validated --------------------------------------------------
@dataclass(frozen=True)
class _Item:
    index: int  # position in the response list
    rid: str  # the scheduler's id (meta_info.id)
    group: str  # the client's rid it belongs to (several with n > 1), for /abort_request
    prepared: PreparedRequest
    logprobs: bool
    top_logprobs: int
    logprob_start_len: int


@dataclass
class _Output:
    """One scheduler request's output so far, accumulated from its updates."""

    item: _Item
    start: float
    text: str = ""
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    input_logprobs: list[float | None] = field(default_factory=list)
    input_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    finish: dict[str, Any] | None = None
    completion_tokens: int = 0
    cached_tokens: int = 0
    e2e_latency: float | None = None

    def add(self, upd: RequestUpdate) -> None:
        self.text += upd.text
        self.output_ids += upd.token_ids
        self.logprobs += upd.logprobs or []
        self.top_logprobs += upd.top_logprobs or []
        self.input_logprobs += upd.input_logprobs or []
        self.input_top_logprobs += upd.input_top_logprobs or []
        self.completion_tokens = max(self.completion_tokens, upd.completion_tokens)
        self.cached_tokens = upd.cached_tokens
        if upd.finish_reason is not None:
            self.finish = finish_reason_dict(upd.finish_reason, upd.finish_message, upd.matched_stop,
                                             upd.completion_tokens)
            self.e2e_latency = time.perf_counter() - self.start

    def result(self, token_text: TokenText) -> dict[str, Any]:
        item = self.item
        meta: dict[str, Any] = {
            "id": item.rid, "finish_reason": self.finish, "prompt_tokens": len(item.prepared.input_ids),
            "completion_tokens": self.completion_tokens, "cached_tokens": self.cached_tokens,
            "e2e_latency": self.e2e_latency if self.e2e_latency is not None else time.perf_counter() - self.start}
        if item.logprobs:
            lists = LogprobLists(self.logprobs, self.top_logprobs, self.input_logprobs, self.input_top_logprobs,
                                 item.prepared.input_ids[max(item.logprob_start_len, 0):],
                                 with_top=item.top_logprobs > 0)
            meta.update(lists.entries(self.output_ids, token_text))
        return {"text": self.text, "output_ids": list(self.output_ids), "meta_info": meta}


def _per_item(name: str, value: T | list[T] | None, count: int, default: T) -> list[T]:
    """A request-level option: one value for every prompt, or a list with one per prompt."""
    if value is None:
        return [default] * count
    if isinstance(value, list):
        if len(value) != count:
            raise bad_request(f"{name} has {len(value)} entries for {count} prompts", name)
        return value
    return [value] * count


def native_sampling_dict(raw: dict[str, Any], where: str) -> tuple[dict[str, Any], int]:
    """SGLang's sampling_params -> plait's SamplingParams fields, and ``n``."""
    unknown = sorted(set(raw) - NATIVE_SAMPLING_KEYS)
    if unknown:
        raise bad_request(f"{where}: unknown sampling parameter(s) {', '.join(map(repr, unknown))}; accepted: "
                          f"{', '.join(sorted(NATIVE_SAMPLING_KEYS))}", f"{where}.{unknown[0]}")
    # json_schema, regex, ebnf and structural_tag pass as they are: SamplingParams checks them (at most
    # one, a grammar xgrammar compiles) like the offline Engine's.
    out = {k: v for k, v in raw.items() if k not in ("n", "sampling_seed", "spaces_between_special_tokens")}
    if raw.get("spaces_between_special_tokens") is False:
        raise unsupported(f"{where}.spaces_between_special_tokens=false", f"{where}.spaces_between_special_tokens")
    if raw.get("sampling_seed") is not None:
        out["seed"] = raw["sampling_seed"]
    n = raw.get("n", 1)
    if n is None:
        n = 1
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= protocol.MAX_N:
        raise bad_request(f"{where}.n must be an integer in [1, {protocol.MAX_N}], got {n!r}", f"{where}.n")
    return out, n


class NativeServing:
    """SGLang's native routes over the server's SchedulerClient."""

    def __init__(self, client: SchedulerClient, config: EngineConfig, model_name: str,
                 server_info: Callable[[], dict[str, Any]], prompt_work: PromptWork,
                 incremental_stream: bool = False, model_aliases: tuple[str, ...] = ()) -> None:
        self.client = client
        # SGLang's --incremental-streaming-output: stream events carry the new text and ids only.
        self.incremental_stream = incremental_stream
        self.prompt_work = prompt_work  # tokenization runs there, off the event loop
        self.config = config
        self.model_name = model_name
        self.model_aliases = model_aliases
        self.server_info = server_info
        self._token_texts: dict[int, str] = {}
        # SGLang rid -> the scheduler rids of its samples, while in flight (/abort_request).
        self._groups: dict[str, list[str]] = {}

    # --- /generate --------------------------------------------------------------------------------
    def _token_text(self, tid: int) -> str:
        text = self._token_texts.get(tid)
        if text is None:
            text = self._token_texts[tid] = self.client.tokenizer.decode([tid])
        return text

    def _items(self, req: GenerateReqInput) -> tuple[list[_Item], bool]:
        """Validate and tokenize; returns the scheduler requests and whether the answer is one object."""
        if req.text is not None and req.input_ids is not None:
            raise bad_request("text and input_ids are exclusive: send one of them", "input_ids")
        if req.text is None and req.input_ids is None:
            raise bad_request("one of text or input_ids is required", "text")
        frontend = self.client.frontend
        assert frontend is not None, "check_accepting() runs first"
        field_name = "text" if req.text is not None else "input_ids"
        if req.text is not None:
            prompts: list[str | list[int]] = [req.text] if isinstance(req.text, str) else list(req.text)
            single = isinstance(req.text, str)
        else:
            ids = req.input_ids or []
            single = not ids or isinstance(ids[0], int)
            prompts = [ids] if single else list(ids)  # type: ignore[list-item]
        if not prompts:
            raise bad_request(f"{field_name} must not be an empty batch", field_name)
        count = len(prompts)
        params = _per_item("sampling_params", req.sampling_params, count, {})
        want_lp = _per_item("return_logprob", req.return_logprob, count, False)
        starts = _per_item("logprob_start_len", req.logprob_start_len, count, -1)
        tops = _per_item("top_logprobs_num", req.top_logprobs_num, count, 0)
        rids = _per_item("rid", req.rid, count, "") if req.rid is not None else [uuid.uuid4().hex for _ in prompts]
        if isinstance(req.rid, str) and count > 1:
            raise bad_request("rid must be a list with one id per prompt for a batch", "rid")
        items: list[_Item] = []
        many = count > 1
        for k, prompt in enumerate(prompts):
            where = f"sampling_params[{k}]" if isinstance(req.sampling_params, list) else "sampling_params"
            fields, n = native_sampling_dict(params[k], where)
            top = tops[k]
            if not 0 <= top <= MAX_TOP_LOGPROBS:
                raise bad_request(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}", "top_logprobs_num")
            fields.update(logprobs=want_lp[k], top_logprobs=top if want_lp[k] else 0,
                          logprob_start_len=starts[k] if want_lp[k] else -1)
            try:
                sp = frontend.sampling_params(fields)
            except ValueError as e:
                message = str(e)
                first = message.split(" ", 1)[0].split("[", 1)[0]
                if first in _REQUEST_LEVEL:  # logprob_start_len: a request-level field in SGLang
                    raise bad_request(message, first) from None
                param = f"{where}.{first}" if first.isidentifier() else where
                raise bad_request(f"{where}: {message}", param) from None
            try:
                ids = tokenize_prompt(frontend, prompt)
            except PromptTooLong as e:
                raise bad_request(str(e), field_name, "context_length_exceeded") from None
            except ValueError as e:
                raise bad_request(str(e).replace("prompt", field_name, 1), field_name) from None
            try:
                ids, sp = frontend.fit(ids, sp)
                frontend.check_logprob_start(len(ids), sp)
            except ContextLengthError as e:
                raise bad_request(str(e), f"{where}.max_new_tokens", "context_length_exceeded") from None
            except ValueError as e:
                raise bad_request(str(e), "logprob_start_len") from None
            many = many or n > 1
            for j in range(n):
                seed = seed_to_int64(sp.seed + j) if sp.seed is not None else frontend.draw_seed(sp)
                rid = rids[k] if n == 1 else f"{rids[k]}-{j}"
                items.append(_Item(len(items), rid, rids[k], PreparedRequest(ids, sp, seed), sp.logprobs,
                                   sp.top_logprobs, sp.logprob_start_len))
        return items, not many

    async def generate(self, request: Request) -> Response:
        req = parse_body(GenerateReqInput, await request.body())
        self.client.check_accepting()
        if req.return_text_in_logprobs:
            self.client.need_tokenizer("return_text_in_logprobs", "a token's text")
        items, single = await self.prompt_work.run(self._items, req)
        groups = self._group(items)
        gen = self.client.generate([it.prepared for it in items], stream=req.stream, rids=[it.rid for it in items],
                                   groups=[it.group for it in items])
        text = self._token_text if req.return_text_in_logprobs else None
        start = time.perf_counter()
        outputs = [_Output(it, start) for it in items]
        if not req.stream:
            try:
                done = await unless_disconnected(request, self._collect(gen, outputs))
            finally:
                self._ungroup(groups)
            if done is None:
                return Response(status_code=499)
            results = [o.result(text) for o in outputs]
            return JSONResponse(results[0] if single else results)
        try:
            primed = await unless_disconnected(request, read_acknowledgements(gen, len(items)))
        except BaseException:
            self._ungroup(groups)
            raise
        if primed is None:
            self._ungroup(groups)
            return Response(status_code=499)
        return SSEResponse(self._stream(gen, primed, outputs, single, text, groups))

    def _group(self, items: list[_Item]) -> list[str]:
        """Register the client's rids (with n > 1, one rid covers its samples) for /abort_request."""
        groups: dict[str, list[str]] = {}
        for it in items:
            groups.setdefault(it.group, []).append(it.rid)
        clash = [g for g in groups if g in self._groups]
        if clash:
            raise bad_request(f"rid {clash[0]!r} is already in flight; request ids must be unique", "rid")
        self._groups.update(groups)
        return list(groups)

    def _ungroup(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._groups.pop(key, None)

    @staticmethod
    async def _collect(gen: AsyncIterator[tuple[int, RequestUpdate]], outputs: list[_Output]) -> bool:
        try:
            async for i, upd in gen:
                outputs[i].add(upd)
        finally:
            await gen.aclose()  # type: ignore[attr-defined]
        return True

    async def _stream(self, gen: Any, primed: list[tuple[int, RequestUpdate]], outputs: list[_Output],
                      single: bool, text: TokenText, groups: list[str]) -> AsyncIterator[bytes]:
        try:
            async for i, upd in replayed(primed, gen):
                out = outputs[i]
                out.add(upd)
                if upd.text or upd.token_ids or upd.finish_reason is not None:
                    event = out.result(text)
                    if self.incremental_stream:
                        event["text"], event["output_ids"] = upd.text, list(upd.token_ids)
                    if not single:
                        event["index"] = i
                    yield sse(event)
        except APIError as e:  # the status line went out already: report in-band
            yield sse(e.body())
        finally:
            self._ungroup(groups)
            await gen.aclose()
        yield SSE_DONE

    # --- tokenizer routes -------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        protocol.resolve_model(model, self.model_name, self.config.model, self.model_aliases)

    async def tokenize(self, request: Request) -> Response:
        req = parse_body(TokenizeRequest, await request.body())
        self._check_model(req.model)
        self.client.check_accepting()
        tok = self.client.need_tokenizer("prompt", "tokenizing")
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        tokens = await self.prompt_work.run(
            lambda: [tok.encode(p, add_special_tokens=req.add_special_tokens) for p in prompts])
        frontend = self.client.frontend
        assert frontend is not None
        limit = frontend.limits.max_request_tokens
        if isinstance(req.prompt, str):
            return JSONResponse({"tokens": tokens[0], "count": len(tokens[0]), "max_model_len": limit})
        return JSONResponse({"tokens": tokens, "count": [len(t) for t in tokens], "max_model_len": limit})

    async def detokenize(self, request: Request) -> Response:
        req = parse_body(DetokenizeRequest, await request.body())
        self._check_model(req.model)
        self.client.check_accepting()
        tok = self.client.need_tokenizer("tokens", "detokenizing")
        single = not req.tokens or isinstance(req.tokens[0], int)
        lists: list[list[int]] = [req.tokens] if single else req.tokens  # type: ignore[list-item]
        vocab = len(tok)
        for ids in lists:
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise bad_request(f"tokens must be in [0, {vocab}) (the tokenizer's vocabulary); got {bad[:5]}",
                                  "tokens")
        texts = [tok.decode(ids) for ids in lists]
        return JSONResponse({"text": texts[0] if single else texts})

    # --- operations -------------------------------------------------------------------------------
    async def health_generate(self, request: Request) -> Response:
        """A one-token greedy generation through the scheduler; 503 if it fails or takes too long."""
        if self.client.state != State.READY:
            return Response(status_code=503)
        tok = self.client.tokenizer
        if tok is None:  # --skip-tokenizer-init: any token is a probe
            probe = 0
        else:
            probe = tok.bos_token_id if tok.bos_token_id is not None else (
                tok.encode("hi", add_special_tokens=False) or [0])[0]
        sp = SamplingParams(max_new_tokens=1, temperature=0.0)
        gen = self.client.generate([PreparedRequest([probe], sp, 0)], stream=False,
                                   rids=[f"health-generate-{uuid.uuid4().hex}"])
        try:
            await asyncio.wait_for(self._drain(gen), HEALTH_GENERATE_TIMEOUT_S)
        except (APIError, TimeoutError):
            return Response(status_code=503)
        return Response(status_code=200)

    @staticmethod
    async def _drain(gen: Any) -> None:
        try:
            async for _ in gen:
                pass
        finally:
            await gen.aclose()

    def model_info(self) -> dict[str, Any]:
        frontend = self.client.frontend
        return {
            "model_path": self.config.model,
            "tokenizer_path": self.config.tokenizer or self.config.model,
            "served_model_name": self.model_name,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": None,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "max_model_len": frontend.limits.max_request_tokens if frontend else None,
            # What unset sampling parameters default to (the checkpoint's generation_config.json).
            "default_sampling_params": dict(frontend.sampling_defaults) if frontend else None,
        }

    def get_server_info(self) -> dict[str, Any]:
        info = self.server_info()
        ready = self.client.ready
        info["internal_states"] = [{
            "max_total_num_tokens": ready.max_total_tokens if ready else None,
            "max_running_requests": ready.max_running_requests if ready else None,
            "context_len": ready.max_context_len if ready else None,
        }]
        info["version"] = _plait_version()
        return info

    async def flush_cache(self, request: Request) -> Response:
        reply = await self.client.flush_cache()
        return PlainTextResponse(reply.message, status_code=200 if reply.success else 400)

    async def abort_request(self, request: Request) -> Response:
        req = parse_body(AbortReq, await request.body())
        if req.abort_all:
            rids = self.client.in_flight_rids
        elif not req.rid:
            raise bad_request("rid is required (or abort_all: true)", "rid")
        else:
            rids = list(self._groups.get(req.rid, [req.rid]))
        rids = [r for r in rids if self.client.is_in_flight(r)]
        self.client.abort(rids)
        if self.client.workers > 1:
            # Another HTTP process may hold the request: the scheduler process finds it by its client id.
            # The answer lists what this process held.
            self.client.abort_groups([] if req.abort_all else [req.rid], everything=bool(req.abort_all))
        return JSONResponse({"aborted": rids})


def _plait_version() -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version("plait")
    except importlib.metadata.PackageNotFoundError:
        return None


def add_native_routes(app: FastAPI, native: NativeServing,
                      guarded: Callable[[Callable[[Request], Coroutine[Any, Any, Response]], Request],
                                        Coroutine[Any, Any, Response]]) -> None:
    """Register SGLang's native routes on the server's app (errors handled as on the OpenAI routes)."""

    async def model_info(request: Request) -> Response:
        return JSONResponse(native.model_info())

    async def server_info(request: Request) -> Response:
        return JSONResponse(native.get_server_info())

    routes: list[tuple[str, list[str], Callable[[Request], Coroutine[Any, Any, Response]]]] = [
        ("/generate", ["POST"], native.generate),
        ("/v1/tokenize", ["POST"], native.tokenize),
        ("/tokenize", ["POST"], native.tokenize),
        ("/v1/detokenize", ["POST"], native.detokenize),
        ("/detokenize", ["POST"], native.detokenize),
        ("/health_generate", ["GET"], native.health_generate),
        ("/get_model_info", ["GET"], model_info),
        ("/get_server_info", ["GET"], server_info),
        ("/flush_cache", ["GET", "POST"], native.flush_cache),
        ("/abort_request", ["POST"], native.abort_request),
    ]
    def endpoint_for(handler: Callable[[Request], Coroutine[Any, Any, Response]],
                     ) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        async def endpoint(request: Request) -> Response:
            return await guarded(handler, request)

        return endpoint

    for path, methods, handler in routes:
        app.add_api_route(path, endpoint_for(handler), methods=methods)
