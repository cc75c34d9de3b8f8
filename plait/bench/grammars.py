"""A corpus of grammars for the ``structured-overhead`` benchmark and the constrained-decoding tests:
30 JSON schemas, 10 regular expressions and 5 EBNF grammars, each with how to check an output.

Every schema is bounded (string lengths, array sizes, number ranges, enums), so a complete output
fits in a few tens of tokens. ``REGEXES`` pairs xgrammar's regex with the Python pattern that checks
it (``re.fullmatch``); ``EBNF_GRAMMARS`` pairs each grammar with a Python regex of the same language.
"""

from __future__ import annotations

from typing import Any

_NAME = {"type": "string", "minLength": 1, "maxLength": 12}
_SMALL_INT = {"type": "integer", "minimum": 0, "maximum": 99}

JSON_SCHEMAS: list[tuple[str, dict[str, Any]]] = [
    ("flat_required", {"type": "object", "properties": {"name": _NAME, "age": _SMALL_INT},
                       "required": ["name", "age"], "additionalProperties": False}),
    ("boolean_field", {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
                       "additionalProperties": False}),
    ("enum_color", {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}},
                    "required": ["color"], "additionalProperties": False}),
    ("const_version", {"type": "object", "properties": {"version": {"const": 2}, "tag": _NAME},
                       "required": ["version", "tag"], "additionalProperties": False}),
    ("bounded_number", {"type": "object", "properties": {"score": {"type": "number", "minimum": 0, "maximum": 10}},
                        "required": ["score"], "additionalProperties": False}),
    ("exclusive_bounds", {"type": "object",
                          "properties": {"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}},
                          "required": ["n"], "additionalProperties": False}),
    ("negative_range", {"type": "object", "properties": {"t": {"type": "integer", "minimum": -50, "maximum": -1}},
                        "required": ["t"], "additionalProperties": False}),
    ("nested_object", {"type": "object", "properties": {
        "user": {"type": "object", "properties": {"id": _SMALL_INT, "name": _NAME}, "required": ["id", "name"],
                 "additionalProperties": False}}, "required": ["user"], "additionalProperties": False}),
    ("deeply_nested", {"type": "object", "properties": {"a": {"type": "object", "properties": {
        "b": {"type": "object", "properties": {"c": {"type": "object", "properties": {"d": _SMALL_INT},
                                                     "required": ["d"], "additionalProperties": False}},
              "required": ["c"], "additionalProperties": False}}, "required": ["b"], "additionalProperties": False}},
        "required": ["a"], "additionalProperties": False}),
    ("bounded_int_array", {"type": "object", "properties": {
        "values": {"type": "array", "items": _SMALL_INT, "minItems": 1, "maxItems": 3}},
        "required": ["values"], "additionalProperties": False}),
    ("exact_length_array", {"type": "object", "properties": {
        "pair": {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}},
        "required": ["pair"], "additionalProperties": False}),
    ("array_of_objects", {"type": "object", "properties": {"items": {"type": "array", "maxItems": 2, "minItems": 1,
        "items": {"type": "object", "properties": {"sku": _NAME, "qty": {"type": "integer", "minimum": 1,
                                                                        "maximum": 9}},
                  "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False}),
    ("enum_array", {"type": "object", "properties": {"tags": {"type": "array", "maxItems": 3, "minItems": 1,
                                                              "items": {"enum": ["a", "b", "c"]}}},
                    "required": ["tags"], "additionalProperties": False}),
    ("string_pattern_zip", {"type": "object", "properties": {"zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                            "required": ["zip"], "additionalProperties": False}),
    ("string_pattern_code", {"type": "object",
                             "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}},
                             "required": ["code"], "additionalProperties": False}),
    ("email_pattern", {"type": "object",
                       "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,8}@[a-z]{1,8}\\.com$"}},
                       "required": ["email"], "additionalProperties": False}),
    ("format_date", {"type": "object", "properties": {"day": {"type": "string", "format": "date"}},
                     "required": ["day"], "additionalProperties": False}),
    ("format_ipv4", {"type": "object", "properties": {"ip": {"type": "string", "format": "ipv4"}},
                     "required": ["ip"], "additionalProperties": False}),
    ("format_uuid", {"type": "object", "properties": {"id": {"type": "string", "format": "uuid"}},
                     "required": ["id"], "additionalProperties": False}),
    ("string_length_bounds", {"type": "object", "properties": {"word": {"type": "string", "minLength": 3,
                                                                        "maxLength": 5}},
                              "required": ["word"], "additionalProperties": False}),
    ("optional_fields", {"type": "object", "properties": {"name": _NAME, "nick": _NAME, "age": _SMALL_INT},
                         "required": ["name"], "additionalProperties": False}),
    ("nullable_type", {"type": "object", "properties": {"middle": {"type": ["string", "null"], "maxLength": 8}},
                       "required": ["middle"], "additionalProperties": False}),
    ("any_of_scalar", {"type": "object", "properties": {"v": {"anyOf": [{"type": "integer", "minimum": 0,
                                                                         "maximum": 9},
                                                                        {"type": "boolean"}]}},
                       "required": ["v"], "additionalProperties": False}),
    ("any_of_objects", {"type": "object", "properties": {"shape": {"anyOf": [
        {"type": "object", "properties": {"kind": {"const": "circle"}, "r": _SMALL_INT}, "required": ["kind", "r"],
         "additionalProperties": False},
        {"type": "object", "properties": {"kind": {"const": "square"}, "side": _SMALL_INT},
         "required": ["kind", "side"], "additionalProperties": False}]}},
        "required": ["shape"], "additionalProperties": False}),
    ("ref_defs", {"$defs": {"point": {"type": "object", "properties": {"x": _SMALL_INT, "y": _SMALL_INT},
                                      "required": ["x", "y"], "additionalProperties": False}},
                  "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
                  "additionalProperties": False}),
    ("ref_reused", {"$defs": {"id": {"type": "integer", "minimum": 1, "maximum": 999}},
                    "type": "object", "properties": {"src": {"$ref": "#/$defs/id"}, "dst": {"$ref": "#/$defs/id"}},
                    "required": ["src", "dst"], "additionalProperties": False}),
    ("ref_array", {"$defs": {"tag": {"type": "string", "enum": ["x", "y", "z"]}},
                   "type": "object", "properties": {"tags": {"type": "array", "items": {"$ref": "#/$defs/tag"},
                                                             "minItems": 1, "maxItems": 2}},
                   "required": ["tags"], "additionalProperties": False}),
    ("top_level_array", {"type": "array", "items": _SMALL_INT, "minItems": 1, "maxItems": 3}),
    ("top_level_enum", {"enum": ["alpha", "beta", "gamma"]}),
    ("mixed_record", {"type": "object", "properties": {
        "title": {"type": "string", "maxLength": 16}, "year": {"type": "integer", "minimum": 1900, "maximum": 2030},
        "rating": {"type": "number", "minimum": 0, "maximum": 5}, "genre": {"enum": ["drama", "comedy"]},
        "seen": {"type": "boolean"}}, "required": ["title", "year", "genre", "seen"], "additionalProperties": False}),
]

# (xgrammar regex, Python pattern of the same language)
REGEXES: list[tuple[str, str]] = [
    (r"[0-9]{3}-[0-9]{4}", r"[0-9]{3}-[0-9]{4}"),
    (r"\d{4}-\d{2}-\d{2}", r"\d{4}-\d{2}-\d{2}"),
    (r"(yes|no)", r"(yes|no)"),
    (r"[A-Z][a-z]{2,8}", r"[A-Z][a-z]{2,8}"),
    (r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)", r"[a-z]{3,8}@[a-z]{3,8}\.(com|org)"),
    (r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])",
     r"((25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])\.){3}(25[0-5]|2[0-4][0-9]|1?[0-9]?[0-9])"),
    (r"#[0-9a-f]{6}", r"#[0-9a-f]{6}"),
    (r"[0-9]{1,5}(\.[0-9]{1,2})?", r"[0-9]{1,5}(\.[0-9]{1,2})?"),
    (r"(red|green|blue), (small|large)", r"(red|green|blue), (small|large)"),
    (r"The answer is [0-9]{1,3}\.", r"The answer is [0-9]{1,3}\."),
]

# (EBNF grammar, Python pattern of the same language)
EBNF_GRAMMARS: list[tuple[str, str]] = [
    ('root ::= "yes" | "no" | "maybe"', r"(yes|no|maybe)"),
    ('root ::= greeting " " name\ngreeting ::= "Hello" | "Hi"\nname ::= [A-Z] [a-z] [a-z]? [a-z]? [a-z]?',
     r"(Hello|Hi) [A-Z][a-z]{1,4}"),
    ('root ::= "[" item ("," item)? ("," item)? "]"\nitem ::= [0-9] [0-9]?', r"\[[0-9]{1,2}(,[0-9]{1,2}){0,2}\]"),
    ('root ::= pair ("; " pair)?\npair ::= key "=" value\nkey ::= "a" | "b" | "c"\nvalue ::= [0-9] [0-9]? [0-9]?',
     r"[abc]=[0-9]{1,3}(; [abc]=[0-9]{1,3})?"),
    ('root ::= subject " " verb " " object "."\nsubject ::= "The cat" | "A dog"\nverb ::= "eats" | "sees"\n'
     'object ::= "fish" | "a ball"', r"(The cat|A dog) (eats|sees) (fish|a ball)\."),
]
