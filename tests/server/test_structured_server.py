"""Structured outputs through `plait serve` (the shared tiny-model server): response_format
json_schema / json_object, SGLang's regex and ebnf on both endpoints, streaming, 400s for bad
grammars with the server still serving, and the grammar metrics."""

from __future__ import annotations

import json
import re

import pytest

from tests.server.test_server_errors import assert_error, assert_serves

COLOR = {"enum": ["red", "green", "blue"]}


@pytest.fixture
def post(server, model_name):
    def send(path: str, fields: dict) -> dict:
        body = {"model": model_name, "max_tokens": 24, "temperature": 0, **fields}
        if path == "/v1/completions":
            body.setdefault("prompt", "Pick one:")
        else:
            body.setdefault("messages", [{"role": "user", "content": "Pick one."}])
        r = server.post(path, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]

    return send


def _text(choice: dict) -> str:
    return choice["text"] if "text" in choice else choice["message"]["content"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_response_format_json_schema_gives_valid_json(post, path):
    fmt = {"type": "json_schema", "json_schema": {"name": "color", "schema": COLOR, "strict": True}}
    choice = post(path, {"response_format": fmt})
    assert json.loads(_text(choice)) in COLOR["enum"]
    assert choice["finish_reason"] == "stop"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_regex_and_ebnf_extensions_constrain_the_output(post, path):
    choice = post(path, {"regex": r"(yes|no)-[0-9]"})
    assert re.fullmatch(r"(yes|no)-[0-9]", _text(choice)) and choice["finish_reason"] == "stop"
    choice = post(path, {"ebnf": 'root ::= "A" | "B" "C"'})
    assert _text(choice) in ("A", "BC") and choice["finish_reason"] == "stop"


CHOICES = ["yes", "no", 'say "hi"', "back\\slash"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("fields", [
    {"guided_choice": CHOICES}, {"structured_outputs": {"choice": CHOICES}},
], ids=["guided_choice", "structured_outputs.choice"])
def test_vllms_choice_constraint_gives_one_of_the_choices(post, path, fields):
    choice = post(path, {**fields, "temperature": 1.0, "seed": 3})
    assert _text(choice) in CHOICES and choice["finish_reason"] == "stop"


@pytest.mark.parametrize("fields", [
    {"guided_json": COLOR}, {"structured_outputs": {"json": COLOR}}, {"guided_regex": r"(yes|no)-[0-9]"},
    {"structured_outputs": {"regex": r"(yes|no)-[0-9]"}}, {"guided_grammar": 'root ::= "A" | "B" "C"'},
    {"structured_outputs": {"json_object": True}},
], ids=["guided_json", "so.json", "guided_regex", "so.regex", "guided_grammar", "so.json_object"])
def test_vllms_structured_output_fields_constrain_the_output(post, fields):
    text = _text(post("/v1/chat/completions", fields))
    if "guided_json" in fields or "json" in fields.get("structured_outputs", {}):
        assert json.loads(text) in COLOR["enum"]
    elif "json_object" in fields.get("structured_outputs", {}):
        assert text.lstrip().startswith("{")
    elif "guided_grammar" in fields:
        assert text in ("A", "BC")
    else:
        assert re.fullmatch(r"(yes|no)-[0-9]", text)


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "a", "guided_choice": ["b"]}, "guided_regex"),
    ({"guided_regex": "a", "regex": "b"}, "structured_outputs"),
    ({"structured_outputs": {"choice": []}}, "structured_outputs.choice"),
    ({"structured_outputs": {"lark": "x"}}, "structured_outputs"),
], ids=["two_guided", "guided_and_regex", "empty_choice", "unknown_key"])
def test_a_bad_or_doubled_vllm_constraint_is_a_400_naming_the_field(server, model_name, fields, param):
    r = server.post("/v1/chat/completions", json={"model": model_name, "max_tokens": 4,
                                                  "messages": [{"role": "user", "content": "Hi"}], **fields})
    assert_error(r, 400, param=param)
    assert_serves(server, model_name)


def test_native_generate_takes_sglangs_grammar_fields(server):
    schema = server.post("/generate", json={"text": "Pick one:", "sampling_params": {
        "max_new_tokens": 24, "temperature": 0, "json_schema": json.dumps(COLOR)}})
    assert schema.status_code == 200, schema.text
    assert json.loads(schema.json()["text"]) in COLOR["enum"]
    assert schema.json()["meta_info"]["finish_reason"]["type"] == "stop"
    batch = server.post("/generate", json={"text": ["Yes or no?", "Say a word."], "sampling_params": {
        "max_new_tokens": 8, "temperature": 0.8, "n": 2, "regex": r"(yes|no)-[0-9]"}})
    assert batch.status_code == 200, batch.text
    assert len(batch.json()) == 4
    assert all(re.fullmatch(r"(yes|no)-[0-9]", item["text"]) for item in batch.json())


def test_json_object_starts_an_object_and_a_length_cut_says_length(post):
    choice = post("/v1/chat/completions", {"response_format": {"type": "json_object"}, "max_tokens": 5})
    assert _text(choice).lstrip().startswith("{")
    assert choice["finish_reason"] in ("length", "stop")


def test_openai_client_streams_a_constrained_chat(server, model_name):
    client = server.openai()
    stream = client.chat.completions.create(
        model=model_name, messages=[{"role": "user", "content": "Date?"}], max_tokens=32, temperature=0.8,
        seed=3, stream=True, extra_body={"regex": r"20[0-9]{2}-[01][0-9]-[0-3][0-9]"})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert re.fullmatch(r"20[0-9]{2}-[01][0-9]-[0-3][0-9]", text), text
    assert chunks[-1].choices[0].finish_reason == "stop" or chunks[-2].choices[0].finish_reason == "stop"


def test_top_logprobs_list_only_tokens_the_grammar_allows(post):
    choice = post("/v1/chat/completions", {"ebnf": 'root ::= "A" | "B"', "logprobs": True, "top_logprobs": 5})
    assert choice["message"]["content"] in ("A", "B")
    for entry in choice["logprobs"]["content"]:
        assert 1 <= len(entry["top_logprobs"]) <= 2  # the grammar allows "A" or "B", then only EOS


BAD = [
    ({"regex": "(ab"}, "regex", "parenthesis"),
    ({"ebnf": "root ::= nothing"}, "ebnf", "not defined"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "json_schema", "nope"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema",
     "JSON Schema object"),
    ({"response_format": {"type": "xml"}}, "response_format.type", "must be one of"),
    ({"response_format": {"type": "json_object"}, "regex": "a"}, "response_format", "cannot be combined"),
]


@pytest.mark.parametrize(("fields", "param", "contains"), BAD, ids=range(len(BAD)))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_bad_grammar_is_a_400_and_the_server_keeps_serving(server, model_name, path, fields, param, contains):
    body = {"model": model_name, "max_tokens": 4, **fields}
    body.update({"prompt": "Hi"} if path == "/v1/completions" else {"messages": [{"role": "user", "content": "Hi"}]})
    assert_error(server.post(path, json=body), 400, param=param, contains=contains)
    assert_serves(server, model_name)


def test_schema_too_deep_to_compile_is_a_400(server, model_name):
    schema: dict = {"type": "string"}
    for _ in range(40):  # 81 levels of JSON nesting: past plait's limit, within the server's JSON parser's
        schema = {"type": "object", "properties": {"a": schema}}
    fmt = {"type": "json_schema", "json_schema": {"name": "deep", "schema": schema}}
    r = server.post("/v1/chat/completions", json={"model": model_name, "max_tokens": 4, "response_format": fmt,
                                                  "messages": [{"role": "user", "content": "Hi"}]})
    assert_error(r, 400, param="json_schema", contains="too deep")
    assert_serves(server, model_name)


def test_grammar_compile_time_and_cache_hits_are_on_metrics(server, post):
    post("/v1/completions", {"regex": "[0-9]{2}q"})
    post("/v1/completions", {"regex": "[0-9]{2}q"})
    m = server.wait_idle()
    assert m["plait:grammar_compile_time_seconds_count"] >= 1
    assert m["plait:grammar_compile_time_seconds_sum"] > 0
    assert m["plait:grammar_cache_hits_total"] >= 1
