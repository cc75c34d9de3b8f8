"""OpenAI request schemas and their mapping onto plait's SamplingParams.

Parsing is strict (JSON types as OpenAI documents them: ``"n": 1.0`` or ``"stream": 1`` are 400s,
not silently coerced) and every failure is an ``APIError(400)`` naming the field. Three kinds of
extra fields:

* OpenAI fields that plait does not use and that change nothing about the result (``user``,
  ``store``, ...): accepted and ignored, with a debug log;
* OpenAI features that would change the result and that plait does not implement (the legacy
  ``functions``, ``suffix``, ...): 400 saying so;
* anything else: 400 "Unrecognized request argument supplied", as OpenAI answers, so that a typo
  such as ``temprature`` cannot silently fall back to a default.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StrictInt, ValidationError

from plait.sampling.params import MAX_TOP_LOGPROBS
from plait.server.errors import APIError, bad_request, unsupported
from plait.server.structured import grammar_fields, guided_fields

logger = logging.getLogger(__name__)

# OpenAI's ceiling for n.
MAX_N = 128
# Stop conditions are checked on every generated token: bounded so one request cannot make that slow.
MAX_STOP_SEQUENCES = 64
MAX_STOP_CHARS = 1024
MAX_STOP_TOKEN_IDS = 1024

# The model name SGLang's requests carry when the client names none.
SGLANG_DEFAULT_MODEL = "default"


def resolve_model(name: str | None, served_name: str, model_path: str, aliases: Collection[str] = ()) -> str:
    """The model name a response carries (the served name, as vLLM answers) for a request naming
    ``name``: absent or SGLang's ``default`` mean the served model; otherwise 404 unless ``name`` is
    the served name, one of its ``aliases`` (vLLM's further --served-model-name values) or the model
    path (vLLM's rule: a typo'd model must not be answered by another one)."""
    if name is None or name == SGLANG_DEFAULT_MODEL:
        return served_name
    if name != served_name and name != model_path and name not in aliases:
        raise APIError(404, f"The model `{name}` does not exist. This server serves `{served_name}`.",
                       param="model", code="model_not_found")
    return served_name


# OpenAI fields that plait accepts and ignores (they do not change the tokens produced).
IGNORED_FIELDS: frozenset[str] = frozenset({
    "user", "store", "metadata", "service_tier", "prompt_cache_key",
    "safety_identifier", "modalities", "verbosity", "reasoning_effort", "web_search_options", "audio",
    "prediction",
})


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    include_usage: bool = False
    continuous_usage_stats: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(extra="allow", strict=True)

    # Optional as in SGLang and vLLM: omitted (or SGLang's "default") means the served model.
    model: str | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    logit_bias: dict[str, float] | None = None
    # Extensions that vLLM and SGLang accept too.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = None
    skip_special_tokens: bool | None = None
    # Keep the stop string that ended the text: SGLang's name, and vLLM's.
    no_stop_trim: bool | None = None
    include_stop_str_in_output: bool | None = None
    # vLLM's name: add prompt_token_ids / token_ids to each choice (tests and benchmarks count tokens).
    return_token_ids: bool = False
    # Structured outputs (plait.server.structured): OpenAI's response_format, SGLang's regex and ebnf.
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    # vLLM's: structured_outputs {json | regex | choice | grammar | json_object | structural_tag}, and
    # its older guided_* fields (plait.server.structured.guided_fields).
    structured_outputs: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None


# A completion prompt: text, texts, token ids or lists of them. Token ids are tried first and strictly
# (JSON integers only), then the alternatives in pydantic's lax order: a 512-id prompt validates in a
# fifth of the smart union's time (which tries every alternative), with the same value for every input.
Prompt = Annotated[list[StrictInt] | str | list[str] | list[int] | list[list[int]], Field(union_mode="left_to_right")]


class CompletionRequest(GenerationRequest):
    prompt: Prompt
    logprobs: int | None = None  # number of top logprobs per token (OpenAI: 0..5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: str
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[TextPart] | None = None
    name: str | None = None


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    # Validated by plait.server.tool_calling.plan_tools.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # vLLM's; refused unless --trust-request-chat-template
    # OpenAI's: reaches the chat template as ``reasoning_effort`` (gpt-oss's harmony templates read it),
    # as vLLM passes it; chat_template_kwargs may still set it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


RequestT = TypeVar("RequestT", bound=GenerationRequest)


# --- parsing --------------------------------------------------------------------------------------
def describe_errors(errors: list[Any]) -> tuple[str, str | None]:
    """One readable line from pydantic errors, and the offending top-level field."""
    first = errors[0]
    loc = [str(x) for x in first["loc"]]
    if first["type"] == "json_invalid":
        return f"Invalid JSON in the request body: {first['msg'].removeprefix('Invalid JSON: ')}", None
    if not loc:
        return "The request body must be a JSON object", None
    field = loc[0]
    same_field = [e for e in errors if e["loc"] and str(e["loc"][0]) == field]
    if first["type"] == "missing":
        return f"{'.'.join(loc)}: field required", field
    if len(same_field) > 1:
        # A union (prompt, stop, content): every alternative failed. pydantic reports one error per
        # alternative, at <path to the union>.<alternative>...; name the union and its alternatives.
        locs = [[str(x) for x in e["loc"]] for e in same_field]
        depth = 0
        while all(len(lc) > depth + 1 and lc[depth] == locs[0][depth] for lc in locs):
            depth += 1
        tags = list(dict.fromkeys(lc[depth] for lc in locs))
        path = ".".join(locs[0][:depth])
        # The value the union was given: the input of an alternative that failed as a whole (an error
        # inside one, at an element, has that element as its input).
        value = min(same_field, key=lambda e: len(e["loc"])).get("input")
        got = _JSON_TYPES.get(type(value), type(value).__name__)
        return f"{path}: expected one of {', '.join(tags)}; got {got}", field
    return f"{'.'.join(loc)}: {first['msg']}", field


_JSON_TYPES = {str: "a string", int: "an integer", float: "a number", bool: "a boolean", list: "an array",
               dict: "an object", type(None): "null"}


def parse_request(cls: type[RequestT], body: bytes) -> RequestT:
    try:
        req = cls.model_validate_json(body)
    except ValidationError as e:
        message, param = describe_errors(e.errors())
        raise bad_request(message, param) from None
    extra = set(req.model_extra or {})
    unknown = sorted(extra - IGNORED_FIELDS)
    if unknown:
        raise bad_request(f"Unrecognized request argument supplied: {', '.join(unknown)}", unknown[0])
    if extra:
        logger.debug("ignoring unused OpenAI fields %s", sorted(extra))
    _check_common(req)
    return req


def _check_common(req: GenerationRequest) -> None:
    if not 1 <= req.n <= MAX_N:
        raise bad_request(f"n must be in [1, {MAX_N}], got {req.n}", "n")
    if req.stream_options is not None and not req.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(f"stop may hold at most {MAX_STOP_SEQUENCES} sequences, got {len(stops)}", "stop")
    if any(len(s) > MAX_STOP_CHARS for s in stops):
        raise bad_request(f"each stop sequence may be at most {MAX_STOP_CHARS} characters", "stop")
    if req.stop_token_ids is not None and len(req.stop_token_ids) > MAX_STOP_TOKEN_IDS:
        raise bad_request(f"stop_token_ids may hold at most {MAX_STOP_TOKEN_IDS} ids, got "
                          f"{len(req.stop_token_ids)}", "stop_token_ids")


def check_completion(req: CompletionRequest) -> None:
    if req.suffix:
        raise unsupported("suffix", "suffix")
    if req.best_of is not None and req.best_of != req.n:
        raise unsupported("best_of other than n", "best_of")
    if req.logprobs is not None and not 0 <= req.logprobs <= MAX_TOP_LOGPROBS:
        raise bad_request(f"logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.logprobs}", "logprobs")


def check_chat(req: ChatCompletionRequest) -> None:
    if req.functions:
        raise unsupported("functions (the legacy form of tools)", "functions")
    if req.function_call not in (None, "none", "auto"):
        raise unsupported("function_call", "function_call")
    if req.top_logprobs is not None:
        if not req.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        if not 0 <= req.top_logprobs <= MAX_TOP_LOGPROBS:
            raise bad_request(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {req.top_logprobs}",
                              "top_logprobs")
    if not req.messages:
        raise bad_request("messages must contain at least one message", "messages")
    for i, m in enumerate(req.messages):
        if m.content is None and m.role != "assistant":
            raise bad_request(f"messages[{i}].content is required for role {m.role!r}", f"messages[{i}].content")
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type != "text":
                    raise unsupported(f"content part of type {part.type!r}", f"messages[{i}].content[{j}]")
                if part.text is None:
                    raise bad_request(f"messages[{i}].content[{j}].text is required", f"messages[{i}].content[{j}]")
    if req.continue_final_message and req.add_generation_prompt:
        raise bad_request("continue_final_message and add_generation_prompt cannot both be true",
                          "continue_final_message")


def continuous_usage(req: GenerationRequest) -> bool:
    """vLLM's rule: stream_options.continuous_usage_stats takes effect with include_usage."""
    options = req.stream_options
    return bool(options and options.include_usage and options.continuous_usage_stats)


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the chat template expects them: text parts joined into one string."""
    out: list[dict[str, Any]] = []
    for m in req.messages:
        if isinstance(m.content, list):
            content: str | None = "\n".join(p.text or "" for p in m.content)
        else:
            content = m.content
        msg: dict[str, Any] = {"role": m.role, "content": content}
        if m.name is not None:
            msg["name"] = m.name
        out.append(msg)
    return out


def request_grammar(req: GenerationRequest) -> dict[str, Any]:
    """The request's one output constraint, from OpenAI's / SGLang's fields or vLLM's."""
    ours = grammar_fields(req.response_format, req.regex, req.ebnf)
    vllm = guided_fields(req.structured_outputs, {"json": req.guided_json, "regex": req.guided_regex,
                                                  "choice": req.guided_choice, "grammar": req.guided_grammar})
    if ours and vllm:
        raise bad_request("vLLM's structured_outputs / guided_* cannot be combined with response_format, regex or "
                          "ebnf: give one output constraint", "structured_outputs")
    return ours or vllm


def sampling_dict(req: GenerationRequest, max_new_tokens: int, logprobs: bool, top_logprobs: int,
                  logprob_start_len: int = -1) -> dict[str, Any]:
    """SamplingParams fields; None values mean "default" (the model's generation_config.json or
    plait's; see plait.engine.generation_config). ``logprob_start_len`` 0 scores the prompt (echo)."""
    return {
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": req.min_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "repetition_penalty": req.repetition_penalty,
        "frequency_penalty": req.frequency_penalty,
        "presence_penalty": req.presence_penalty,
        "seed": req.seed,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim or req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens,
        "logprobs": logprobs,
        "top_logprobs": top_logprobs,
        **request_grammar(req),
        "logit_bias": req.logit_bias,
        "logprob_start_len": logprob_start_len if logprobs else -1,
    }


# SamplingParams names -> the OpenAI names a client sent, for error messages.
def rename_fields(message: str, max_tokens_name: str) -> tuple[str, str | None]:
    """Rewrite a SamplingParams error in the client's vocabulary; return it and the field named."""
    message = message.replace("max_new_tokens", max_tokens_name).replace("min_new_tokens", "min_tokens")
    first = message.split(" ", 1)[0].removesuffix(":")  # "stop: ...", "json_schema: ..." name their field too
    param = first if first.replace("_", "").isalpha() else None
    return message, param


def value_error_to_api(e: ValueError, max_tokens_name: str) -> APIError:
    message, param = rename_fields(str(e), max_tokens_name)
    return bad_request(message, param)
