"""Structured outputs over HTTP: OpenAI's ``response_format`` and SGLang's ``regex`` / ``ebnf`` body
extensions, mapped onto SamplingParams' grammar fields (docs/structured-outputs.md).

- ``{"type": "text"}``: no constraint;
- ``{"type": "json_object"}``: any JSON object (the schema ``{"type": "object"}``, as SGLang does);
- ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}``: that schema (``strict``
  is accepted: the grammar always enforces the schema exactly);
- ``{"type": "structural_tag", ...}``: SGLang's structural tag, the whole object.

A malformed ``response_format`` is a 400 naming the field; a grammar xgrammar rejects is a 400 from
SamplingParams' validation, before anything is scheduled.
"""

from __future__ import annotations

import json
from typing import Any

from plait.server.errors import bad_request

RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema", "structural_tag")
JSON_OBJECT_SCHEMA = '{"type": "object"}'


# vLLM's structured_outputs keys (and its older guided_* fields) -> how each becomes a grammar field.
GUIDED_KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def choice_grammar(choices: Any, where: str) -> str:
    """The EBNF grammar whose outputs are exactly the strings of ``choices`` (vLLM's guided_choice)."""
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise bad_request(f"{where} must be a non-empty list of non-empty strings", where)
    # A JSON string literal is an EBNF string literal with the same escapes.
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def guided_fields(structured_outputs: dict[str, Any] | None, guided: dict[str, Any]) -> dict[str, Any]:
    """SamplingParams' grammar fields for vLLM's ``structured_outputs`` object or its older
    ``guided_json`` / ``guided_regex`` / ``guided_choice`` / ``guided_grammar`` fields (``guided``:
    those given, by their suffix); at most one constraint among them."""
    given = {f"guided_{k}": (k, v) for k, v in guided.items() if v is not None}
    if structured_outputs is not None:
        if not isinstance(structured_outputs, dict):
            raise bad_request("structured_outputs must be an object", "structured_outputs")
        unknown = sorted(set(structured_outputs) - set(GUIDED_KINDS))
        if unknown:
            raise bad_request(f"structured_outputs: unknown key(s) {unknown}; accepted: {', '.join(GUIDED_KINDS)}",
                              "structured_outputs")
        given |= {f"structured_outputs.{k}": (k, v) for k, v in structured_outputs.items()
                  if v is not None and v is not False}
    if len(given) > 1:
        raise bad_request(f"{' and '.join(given)} are all set: give one output constraint", next(iter(given)))
    if not given:
        return {}
    (where, (kind, value)), = given.items()
    if kind == "json":
        if not isinstance(value, dict | str):
            raise bad_request(f"{where} must be a JSON schema (an object, or its JSON text)", where)
        return {"json_schema": value if isinstance(value, str) else json.dumps(value)}
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "choice":
        return {"ebnf": choice_grammar(value, where)}
    if not isinstance(value, str):
        raise bad_request(f"{where} must be a string", where)
    return {{"regex": "regex", "grammar": "ebnf", "structural_tag": "structural_tag"}[kind]: value}


def grammar_fields(response_format: dict[str, Any] | None, regex: str | None, ebnf: str | None) -> dict[str, Any]:
    """SamplingParams' grammar fields for a request (empty when unconstrained)."""
    out: dict[str, Any] = {}
    if regex is not None:
        out["regex"] = regex
    if ebnf is not None:
        out["ebnf"] = ebnf
    if response_format is None:
        return out
    kind = response_format.get("type")
    if kind not in RESPONSE_FORMAT_TYPES:
        raise bad_request(f"response_format.type must be one of {', '.join(RESPONSE_FORMAT_TYPES)}, got {kind!r}",
                          "response_format.type")
    if kind == "text":
        return out
    if out:
        raise bad_request(f"response_format of type {kind!r} cannot be combined with {' or '.join(out)}",
                          "response_format")
    if kind == "json_object":
        return {"json_schema": JSON_OBJECT_SCHEMA}
    if kind == "structural_tag":
        return {"structural_tag": json.dumps(response_format)}
    spec = response_format.get("json_schema")
    if not isinstance(spec, dict):
        raise bad_request("response_format.json_schema must be an object with the schema under 'schema'",
                          "response_format.json_schema")
    name = spec.get("name")
    if name is not None and not isinstance(name, str):
        raise bad_request("response_format.json_schema.name must be a string", "response_format.json_schema.name")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request("response_format.json_schema.strict must be a boolean",
                          "response_format.json_schema.strict")
    # OpenAI's field is "schema"; some clients send "schema_" or put it at the top (pydantic aliases).
    schema = spec.get("schema", spec.get("schema_"))
    if not isinstance(schema, dict | bool):
        raise bad_request("response_format.json_schema.schema must be a JSON Schema object",
                          "response_format.json_schema.schema")
    return {"json_schema": json.dumps(schema)}
