"""Chat completions' ``tools``, ``tool_choice``, ``parallel_tool_calls`` and reasoning split: the
request side (validation, what the chat template receives, the grammar that enforces
``required`` and named functions) and the output side (``ChatOutput``: one choice's text turned
into ``reasoning_content``, ``content`` and ``tool_calls``, whole or as stream deltas).

``tool_choice``, with SGLang's and vLLM's formats:

* ``none``: no tools reach the template, the output is text;
* ``auto`` (the default with tools): the model decides; the configured ``--tool-call-parser`` finds
  calls in its text (without one, 400);
* ``required``: a JSON-schema grammar makes the output a JSON array of
  ``{"name": <a tool>, "parameters": <its schema>}``, at least one item, at most one when
  ``parallel_tool_calls`` is false;
* ``{"type": "function", "function": {"name": N}}``: the grammar is N's parameters schema; the
  whole output is N's arguments.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from plait.sampling.grammar import GRAMMAR_FIELDS
from plait.server import protocol
from plait.server.errors import APIError, bad_request
from plait.server.function_call import (
    TOOL_CALL_PARSERS,
    HarmonyToolParser,
    JsonArrayParser,
    NamedFunctionParser,
    ParseDelta,
    ToolParser,
    make_tool_call_parser,
    parameter_schemas,
)
from plait.server.reasoning import REASONING_PARSERS, HarmonyReasoningParser, Reasoner, make_reasoning_parser

# OpenAI's rule for function names.
TOOL_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")
# Parsers that read the model's special tokens (gpt-oss's harmony markers): with one configured, chat
# outputs are detokenized with skip_special_tokens false, whatever the request says, as SGLang does.
SPECIAL_TOKEN_PARSERS = frozenset({"gpt-oss"})


@dataclass(frozen=True)
class ChatOptions:
    """The server's chat settings: ``--tool-call-parser``, ``--reasoning-parser`` and the text of
    ``--chat-template`` (None: the checkpoint's own template)."""

    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    chat_template: str | None = None
    # vLLM's --response-role: the role of the reply's message when the request asks for a generation
    # prompt (else the reply continues the last message, in its role).
    response_role: str = "assistant"

    def __post_init__(self) -> None:
        if not self.response_role.strip():
            raise ValueError("--response-role must name a role, got an empty string")
        if self.tool_call_parser is not None and self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(f"--tool-call-parser must be one of {', '.join(TOOL_CALL_PARSERS)}; "
                             f"got {self.tool_call_parser!r}")
        if self.reasoning_parser is not None and self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser must be one of {', '.join(REASONING_PARSERS)}; "
                             f"got {self.reasoning_parser!r}")
        parsers = {self.tool_call_parser, self.reasoning_parser} - {None}
        if parsers & SPECIAL_TOKEN_PARSERS and len(parsers) > 1:
            # The harmony stage hands tool calls on in harmony form, which only its tool parser reads.
            raise ValueError(f"--tool-call-parser {self.tool_call_parser} and --reasoning-parser "
                             f"{self.reasoning_parser} read different formats: gpt-oss goes with gpt-oss "
                             "(or alone)")

    @classmethod
    def from_flags(cls, tool_call_parser: str | None, reasoning_parser: str | None,
                   chat_template: str | None, response_role: str = "assistant") -> ChatOptions:
        text = None
        if chat_template is not None:
            try:
                text = Path(chat_template).read_text()
            except OSError as e:
                raise ValueError(f"--chat-template: cannot read {chat_template}: {e.strerror or e}") from None
            if not text.strip():
                raise ValueError(f"--chat-template: {chat_template} is empty")
        return cls(tool_call_parser, reasoning_parser, text, response_role)

    @property
    def keeps_special_tokens(self) -> bool:
        return bool({self.tool_call_parser, self.reasoning_parser} & SPECIAL_TOKEN_PARSERS)


# --- the request side -----------------------------------------------------------------------------
ToolMode = Literal["none", "auto", "required", "named"]


@dataclass(frozen=True)
class ToolPlan:
    mode: ToolMode
    tools: tuple[dict[str, Any], ...]  # validated OpenAI tool objects
    named: str | None
    parallel_tool_calls: bool
    parser: str | None  # --tool-call-parser, for auto
    keep_special_tokens: bool = False  # the configured parsers read special tokens

    @property
    def names(self) -> list[str]:
        return [t["function"]["name"] for t in self.tools]

    def template_tools(self) -> list[dict[str, Any]] | None:
        """What the chat template receives as ``tools`` (transformers' apply_chat_template)."""
        return list(self.tools) if self.tools and self.mode != "none" else None

    def json_schema(self) -> dict[str, Any] | None:
        if self.mode == "named":
            tool = next(t for t in self.tools if t["function"]["name"] == self.named)
            return _parameters(tool)
        if self.mode != "required":
            return None
        schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"type": "object", "anyOf": [
            {"properties": {"name": {"type": "string", "enum": [t["function"]["name"]]}, "parameters": _parameters(t)},
             "required": ["name", "parameters"]} for t in self.tools]}}
        if not self.parallel_tool_calls:
            schema["maxItems"] = 1
        defs = _shared_defs(self.tools)
        if defs:
            schema["$defs"] = defs  # the tools' "#/$defs/..." references resolve at the new root
        return schema

    def sampling_fields(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``fields`` (SamplingParams fields from the request) with this plan's grammar added."""
        if self.keep_special_tokens:
            fields = {**fields, "skip_special_tokens": False}  # the parsers take the markers out
        schema = self.json_schema()
        if schema is None:
            return fields
        taken = [k for k in GRAMMAR_FIELDS if fields.get(k) is not None]
        if taken:
            raise bad_request(f"tool_choice {self.mode!r} enforces its own grammar and cannot be combined with "
                              f"another output constraint (response_format, regex or ebnf)", "tool_choice")
        return {**fields, "json_schema": json.dumps(schema)}

    def new_parser(self) -> ToolParser | None:
        if self.mode == "named":
            assert self.named is not None
            return NamedFunctionParser(self.named)
        if self.mode == "required":
            return JsonArrayParser(self.names, max_calls=None if self.parallel_tool_calls else 1)
        if self.mode == "auto" and self.tools:
            assert self.parser is not None
            return make_tool_call_parser(self.parser, self.names, self.parallel_tool_calls,
                                         parameter_schemas(self.tools))
        return None


def _parameters(tool: dict[str, Any]) -> dict[str, Any]:
    params = tool["function"].get("parameters")
    return params if params else {"type": "object", "properties": {}}


def _shared_defs(tools: Sequence[dict[str, Any]]) -> dict[str, Any]:
    defs: dict[str, Any] = {}
    for i, t in enumerate(tools):
        for name, schema in (t["function"].get("parameters") or {}).get("$defs", {}).items():
            if name in defs and defs[name] != schema:
                raise bad_request(f"tools[{i}].function.parameters.$defs.{name} differs from another tool's "
                                  f"definition of the same name", "tools")
            defs[name] = schema
    return defs


def _check_tools(raw: list[Any]) -> tuple[dict[str, Any], ...]:
    seen: set[str] = set()
    for i, tool in enumerate(raw):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"{where}.type must be 'function'", "tools")
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise bad_request(f"{where}.function must be an object", "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.match(name):
            raise bad_request(f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-'; got {name!r}",
                              "tools")
        if name in seen:
            raise bad_request(f"{where}.function.name {name!r} is given twice", "tools")
        seen.add(name)
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object", "tools")
        if fn.get("description") is not None and not isinstance(fn["description"], str):
            raise bad_request(f"{where}.function.description must be a string", "tools")
    return tuple(raw)


def plan_tools(req: protocol.ChatCompletionRequest, options: ChatOptions) -> ToolPlan:
    """Validate ``tools``, ``tool_choice`` and ``parallel_tool_calls`` (400s name the field)."""
    tools = _check_tools(req.tools or [])
    choice = req.tool_choice
    named = None
    if choice is None:
        mode: ToolMode = "auto" if tools else "none"
    elif choice in ("none", "auto", "required"):
        mode = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict) \
            and isinstance(choice["function"].get("name"), str):
        mode, named = "named", choice["function"]["name"]
    else:
        raise bad_request("tool_choice must be 'none', 'auto', 'required' or "
                          '{"type": "function", "function": {"name": ...}}', "tool_choice")
    if mode in ("required", "named") and not tools:
        raise bad_request(f"tool_choice {choice!r} needs tools", "tool_choice")
    if named is not None and named not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names the function {named!r}, which is not in tools", "tool_choice")
    if mode == "auto" and tools and options.tool_call_parser is None:
        raise bad_request("tool_choice 'auto' (the default with tools) needs the server started with "
                          f"--tool-call-parser {{{','.join(TOOL_CALL_PARSERS)}}} to find the calls in the output; "
                          "or send tool_choice 'required', a named function or 'none'", "tool_choice")
    parallel = req.parallel_tool_calls if req.parallel_tool_calls is not None else True
    return ToolPlan(mode, tools, named, parallel, options.tool_call_parser, options.keeps_special_tokens)


def template_messages(req: protocol.ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages for the chat template, with the history's tool traffic: an assistant message's
    ``tool_calls`` (their JSON ``arguments`` decoded, as transformers' templates expect a mapping)
    and a tool message's ``tool_call_id``."""
    out = protocol.chat_messages(req)
    for i, (m, msg) in enumerate(zip(req.messages, out, strict=True)):
        extra = m.model_extra or {}
        calls = extra.get("tool_calls")
        if calls is not None:
            if m.role != "assistant":
                raise bad_request(f"messages[{i}].tool_calls is only allowed on assistant messages",
                                  f"messages[{i}].tool_calls")
            if not isinstance(calls, list):
                raise bad_request(f"messages[{i}].tool_calls must be an array", f"messages[{i}].tool_calls")
            msg["tool_calls"] = [_history_call(i, j, c) for j, c in enumerate(calls)]
            if msg["content"] is None:
                # OpenAI clients send null content beside tool calls; templates that know nothing of
                # tool calls still read the content (as a string).
                msg["content"] = ""
        if m.role == "tool":
            call_id = extra.get("tool_call_id")
            if not isinstance(call_id, str):
                raise bad_request(f"messages[{i}].tool_call_id is required for role 'tool'",
                                  f"messages[{i}].tool_call_id")
            msg["tool_call_id"] = call_id
    return out


def _history_call(i: int, j: int, call: Any) -> dict[str, Any]:
    where = f"messages[{i}].tool_calls[{j}]"
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise bad_request(f"{where}.function.name is required", where)
    args = fn.get("arguments", "{}")
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError as e:
            raise bad_request(f"{where}.function.arguments is not valid JSON: {e}", where) from None
    return {"id": call.get("id"), "type": "function", "function": {"name": fn["name"], "arguments": args}}


# --- the output side ------------------------------------------------------------------------------
class ChatOutput:
    """One choice's output: the reasoning parser first, then the tool-call parser on the content.
    ``feed`` / ``finish`` give OpenAI stream deltas; ``message`` the whole message.
    ``show_reasoning`` false: the reasoning parser only takes its span out of the content."""

    def __init__(self, reasoning: Reasoner | None, tools: ToolParser | None, show_reasoning: bool = True) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self.show_reasoning = show_reasoning and reasoning is not None
        self._ids: dict[int, str] = {}

    @classmethod
    def for_request(cls, plan: ToolPlan, options: ChatOptions) -> ChatOutput:
        reasoning = make_reasoning_parser(options.reasoning_parser) if options.reasoning_parser else None
        tools = plan.new_parser()
        shown = reasoning is not None
        if options.keeps_special_tokens:
            # The text holds gpt-oss's harmony markers (and its stop token): a harmony stage reads
            # them whatever the request's tool parser is. Without --reasoning-parser gpt-oss its
            # analysis is dropped, as SGLang's gpt-oss tool parser does; it passes calls on in the
            # content, which a harmony tool parser without tools drops (tool_choice none, no tools).
            if reasoning is None:
                reasoning = HarmonyReasoningParser()
            if tools is None:
                tools = HarmonyToolParser(())
        return cls(reasoning, tools, shown)

    @property
    def num_calls(self) -> int:
        return len(self._ids)

    def feed(self, text: str) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._deltas("", text, final=False)
        reasoning, content = self.reasoning.feed(text)
        return self._deltas(reasoning, content, final=False)

    def finish(self) -> list[dict[str, Any]]:
        if self.reasoning is None:
            return self._deltas("", "", final=True)
        reasoning, content = self.reasoning.finish()
        return self._deltas(reasoning, content, final=True)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if reason == "stop" and self.num_calls else reason

    def _deltas(self, reasoning: str, content: str, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if reasoning and self.show_reasoning:
            out.append({"reasoning_content": reasoning})
        if self.tools is None:
            if content:
                out.append({"content": content})
            return out
        parsed = self.tools.feed(content) if content else ParseDelta()
        if final:
            end = self.tools.finish()
            parsed = ParseDelta(parsed.normal_text + end.normal_text, parsed.calls + end.calls)
        if parsed.normal_text:
            out.append({"content": parsed.normal_text})
        for c in parsed.calls:
            if c.name is not None:
                self._ids[c.index] = f"call_{uuid.uuid4().hex[:24]}"
                entry: dict[str, Any] = {"index": c.index, "id": self._ids[c.index], "type": "function",
                                         "function": {"name": c.name, "arguments": ""}}
            else:
                entry = {"index": c.index, "function": {"arguments": c.arguments}}
            out.append({"tool_calls": [entry]})
        return out

    def message(self, text: str) -> dict[str, Any]:
        """The whole assistant message of a complete output (this object is used up)."""
        content: list[str] = []
        reasoning: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        for d in self.feed(text) + self.finish():
            reasoning.append(d.get("reasoning_content", ""))
            content.append(d.get("content", ""))
            for entry in d.get("tool_calls", ()):
                if "id" in entry:
                    calls[entry["index"]] = {"id": entry["id"], "type": "function",
                                             "function": {"name": entry["function"]["name"], "arguments": ""}}
                else:
                    calls[entry["index"]]["function"]["arguments"] += entry["function"]["arguments"]
        text_out = "".join(content)
        msg: dict[str, Any] = {"role": "assistant", "content": text_out if text_out or not calls else None}
        if self.show_reasoning:
            msg["reasoning_content"] = "".join(reasoning) or None
        if calls:
            msg["tool_calls"] = [calls[i] for i in sorted(calls)]
        return msg


def check_template_available(tokenizer: Any, options: ChatOptions) -> None:
    if options.chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions or start the server "
                       "with --chat-template FILE", param="messages")
