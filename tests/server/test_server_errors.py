"""Bad requests over HTTP: each gets its status (400 for every validation failure, never 422; 404,
413, 500) and an OpenAI-shaped error naming the field, and the server answers a good request
afterwards."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.server.conftest import FAULT_TOKEN
from tests.test_bad_input import BAD_PARAMS as CORE_BAD_PARAMS

CONTEXT = 2048  # MAIN_ENGINE_FLAGS["context_length"]


def assert_error(r: httpx.Response, status: int, *, param: str | None = None, contains: str = "") -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert contains in err["message"], err["message"]
    if param is not None:
        assert err["param"] == param, err
    return err


def assert_serves(server, model_name) -> None:
    r = server.post("/v1/completions", json={"model": model_name, "prompt": "Hi", "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == 2


@pytest.fixture
def completion(server, model_name):
    """POST /v1/completions with a good body updated by ``fields`` (None deletes a key)."""

    def post(fields: dict | None = None, raw: str | bytes | None = None) -> httpx.Response:
        if raw is not None:
            return server.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        body = {"model": model_name, "prompt": "Hello", "max_tokens": 4}
        for k, v in (fields or {}).items():
            if v is None:
                body.pop(k, None)
            else:
                body[k] = v
        # json.dumps writes NaN / Infinity literals, as sloppy clients do.
        return server.post("/v1/completions", content=json.dumps(body),
                           headers={"content-type": "application/json"})

    return post


@pytest.fixture
def chat(server, model_name):
    def post(fields: dict | None = None) -> httpx.Response:
        body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4}
        for k, v in (fields or {}).items():
            if v is None:
                body.pop(k, None)
            else:
                body[k] = v
        return server.post("/v1/chat/completions", json=body)

    return post


# The core issue's bad sampling parameters (tests/test_bad_input.py), renamed to OpenAI's fields, so
# a bad input added there is also checked over HTTP.
OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}
BAD_PARAMS = [({OPENAI_NAMES.get(k, k): v for k, v in fields.items()}, OPENAI_NAMES.get(name, name))
              for fields, name in CORE_BAD_PARAMS]


@pytest.mark.parametrize(("fields", "param"), BAD_PARAMS, ids=[f"{p}-{i}" for i, (_, p) in enumerate(BAD_PARAMS)])
def test_bad_sampling_parameter_is_a_400_naming_the_field(server, model_name, completion, fields, param):
    assert_error(completion(fields), 400, param=param, contains=param)
    assert_serves(server, model_name)


def test_bad_sampling_parameter_in_chat_is_a_400_naming_the_field(server, model_name, chat):
    assert_error(chat({"top_p": 1.5}), 400, param="top_p", contains="top_p")
    assert_error(chat({"max_completion_tokens": 0}), 400, param="max_completion_tokens")
    assert_serves(server, model_name)


def test_empty_text_prompt_is_a_400(server, model_name, completion):
    assert_error(completion({"prompt": ""}), 400, param="prompt", contains="prompt must not be empty")
    assert_serves(server, model_name)


def test_empty_token_prompt_is_a_400(server, model_name, completion):
    assert_error(completion({"prompt": []}), 400, param="prompt", contains="prompt must not be empty")
    assert_error(completion({"prompt": [[1, 2], []]}), 400, param="prompt", contains="prompt must not be empty")
    assert_serves(server, model_name)


def test_a_prompt_of_mixed_types_is_a_400_naming_the_alternatives_and_the_array(server, model_name, completion):
    assert_error(completion({"prompt": ["a", 1]}), 400, param="prompt",
                 contains="prompt: expected one of list[int], str, list[str], list[list[int]]; got an array")
    assert_serves(server, model_name)


def test_a_prompt_of_numeric_strings_is_two_text_prompts_not_token_ids():
    from plait.server.protocol import CompletionRequest, parse_request

    assert parse_request(CompletionRequest, b'{"prompt": ["1", "2"]}').prompt == ["1", "2"]
    assert parse_request(CompletionRequest, b'{"prompt": [1, 2]}').prompt == [1, 2]


def test_token_ids_outside_the_vocabulary_are_a_400(server, model_name, completion):
    assert_error(completion({"prompt": [1, 2, 512]}), 400, param="prompt", contains="input_ids must be in [0, 512)")
    assert_error(completion({"prompt": [1, -1, 3]}), 400, param="prompt", contains="input_ids")
    assert_serves(server, model_name)


def test_prompt_plus_max_tokens_over_the_context_uses_openai_wording(server, model_name, completion):
    err = assert_error(completion({"prompt": [5] * 100, "max_tokens": CONTEXT}), 400, param="prompt")
    assert err["message"].startswith(
        f"This model's maximum context length is {CONTEXT} tokens. However, you requested {CONTEXT + 100} tokens "
        f"(100 in the prompt, {CONTEXT} in the completion).")
    assert err["code"] == "context_length_exceeded"
    assert_serves(server, model_name)


def test_chat_over_the_context_uses_openai_wording(server, model_name, chat):
    err = assert_error(chat({"messages": [{"role": "user", "content": "word " * 2100}], "max_tokens": None}), 400,
                       param="messages")
    assert err["message"].startswith(f"This model's maximum context length is {CONTEXT} tokens. However, you "
                                     "requested")
    assert "in the messages" in err["message"]
    assert_serves(server, model_name)


MALFORMED = [
    ("{\"model\": \"m\", ", None, "Invalid JSON"),
    ("[1, 2, 3]", None, "JSON object"),
    ("", None, "Invalid JSON"),
    ("\"just a string\"", None, "JSON object"),
]


@pytest.mark.parametrize(("raw", "param", "contains"), MALFORMED, ids=["truncated", "array", "empty", "string"])
def test_malformed_json_is_a_400(server, model_name, completion, raw, param, contains):
    assert_error(completion(raw=raw), 400, param=param, contains=contains)
    assert_serves(server, model_name)


WRONG_TYPES = [
    ({"prompt": None}, "prompt", "field required"),
    ({"model": 7}, "model", "valid string"),
    ({"temperature": "hot"}, "temperature", "valid number"),
    ({"max_tokens": 4.5}, "max_tokens", "valid integer"),
    ({"n": 1.0}, "n", "valid integer"),
    ({"stream": 1}, "stream", "valid boolean"),
    ({"prompt": 5}, "prompt", "prompt"),
    ({"stop": 5}, "stop", "stop"),
    ({"logprobs": True}, "logprobs", "valid integer"),
    ({"stop_token_ids": ["a"]}, "stop_token_ids", "valid integer"),
]


@pytest.mark.parametrize(("fields", "param", "contains"), WRONG_TYPES, ids=[p for _, p, _ in WRONG_TYPES])
def test_missing_field_or_wrong_type_is_a_400_not_a_422(server, model_name, completion, fields, param, contains):
    assert_error(completion(fields), 400, param=param, contains=contains)
    assert_serves(server, model_name)


CHAT_BAD = [
    ({"messages": None}, "messages", "field required"),
    ({"messages": "Hi"}, "messages", "valid array"),
    ({"messages": []}, "messages", "at least one message"),
    ({"messages": [{"role": "wizard", "content": "Hi"}]}, "messages", "role"),
    ({"messages": [{"content": "Hi"}]}, "messages", "role"),
    ({"messages": [{"role": "user"}]}, "messages[0].content", "content is required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
     "messages[0].content[0]", "not supported"),
    ({"top_logprobs": 2}, "top_logprobs", "requires logprobs"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort", "'low', 'medium' or 'high'"),
    ({"stream_options": {"include_usage": True}}, "stream_options", "only allowed when stream"),
    ({"n": 0}, "n", "n must be in"),
]


@pytest.mark.parametrize(("fields", "param", "contains"), CHAT_BAD, ids=range(len(CHAT_BAD)))
def test_invalid_chat_request_is_a_400(server, model_name, chat, fields, param, contains):
    assert_error(chat(fields), 400, param=param, contains=contains)
    assert_serves(server, model_name)


UNSUPPORTED = [
    ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
]


@pytest.mark.parametrize(("fields", "param"), UNSUPPORTED, ids=range(len(UNSUPPORTED)))
def test_asking_for_an_unsupported_feature_is_a_400_that_says_so(server, model_name, chat, fields, param):
    assert_error(chat(fields), 400, param=param, contains="not supported")
    assert_serves(server, model_name)


def test_unsupported_completion_features_are_a_400(server, model_name, completion):
    assert_error(completion({"suffix": "end"}), 400, param="suffix", contains="not supported")
    assert_serves(server, model_name)


def test_response_format_text_and_tool_choice_none_are_accepted(chat):
    r = chat({"response_format": {"type": "text"}, "tool_choice": "none", "parallel_tool_calls": False,
              "user": "u"})
    assert r.status_code == 200, r.text


def test_unknown_model_is_a_404(server, model_name, completion):
    err = assert_error(completion({"model": "gpt-4"}), 404, param="model", contains="gpt-4")
    assert err["code"] == "model_not_found"
    assert_serves(server, model_name)


@pytest.mark.parametrize("fields", [{"model": None}, {"model": "default"}], ids=["omitted", "sglang-default"])
def test_omitted_or_sglang_default_model_means_the_served_model(model_name, completion, chat, fields):
    for r in (completion(fields), chat(fields)):
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model_name


def test_payload_over_the_limit_is_a_413(server, model_name, completion):
    big = "word " * 250_000  # 1.25 MB > --max-payload-bytes 1000000
    err = assert_error(completion({"prompt": big}), 413, contains="over the limit of 1000000 bytes")
    assert err["code"] == "payload_too_large"
    assert_serves(server, model_name)


def test_chunked_payload_over_the_limit_is_a_413(server, model_name):
    def body():
        for _ in range(30):
            yield b" " * 50_000  # 1.5 MB, no Content-Length

    r = httpx.post(server.url + "/v1/completions", content=body(), headers={"content-type": "application/json"})
    assert_error(r, 413, contains="over the limit")
    assert_serves(server, model_name)


def test_unknown_route_and_wrong_method_have_the_openai_shape(server):
    assert_error(httpx.get(server.url + "/v1/nothing"), 404)
    assert_error(httpx.get(server.url + "/v1/completions"), 405)


def test_internal_error_is_a_500_and_the_server_keeps_serving(server, model_name, completion):
    # FAULT_TOKEN makes the scheduler process raise while admitting this one request.
    err = assert_error(completion({"prompt": [5, FAULT_TOKEN, 6]}), 500, contains="internal error")
    assert err["type"] == "internal_server_error"
    assert httpx.get(server.url + "/health").status_code == 200
    assert_serves(server, model_name)
    assert server.wait_idle()["plait:kv_slots_in_use"] == 0


def test_openai_client_raises_typed_errors_with_the_message(client, model_name):
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=model_name, prompt="Hello", max_tokens=4, temperature=-1)
    assert "temperature must be >= 0" in bad.value.message
    assert bad.value.body["param"] == "temperature"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="Hello", max_tokens=4)
    with pytest.raises(openai.InternalServerError):
        client.completions.create(model=model_name, prompt=[FAULT_TOKEN], max_tokens=4)
