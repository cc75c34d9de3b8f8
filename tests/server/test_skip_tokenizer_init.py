"""SGLang's --skip-tokenizer-init: an engine and a server on a checkpoint without tokenizer files, which
take token ids and give token ids (empty text), and refuse what needs the tokenizer naming the field."""

from __future__ import annotations

import json
import pathlib
import shutil
import subprocess
import sys
from collections.abc import Iterator

import httpx
import pytest

from plait.config import EngineConfig
from tests.helpers import make_engine
from tests.server.conftest import HTTP_TIMEOUT, Server
from tests.server.test_server_errors import assert_error

IDS = [5, 6, 7, 8]
GREEDY = {"max_new_tokens": 8, "temperature": 0.0}


@pytest.fixture(scope="module")
def no_tokenizer_model(server_model, tmp_path_factory) -> pathlib.Path:
    """The tiny checkpoint with its tokenizer files left out."""
    dest = tmp_path_factory.mktemp("no-tokenizer") / "model"
    shutil.copytree(server_model, dest,
                    ignore=shutil.ignore_patterns("tokenizer*", "special_tokens_map.json", "vocab.json", "merges.txt"))
    return dest


@pytest.fixture(scope="module")
def ids_engine(no_tokenizer_model):
    engine = make_engine(no_tokenizer_model, skip_tokenizer_init=True)
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def ids_server(no_tokenizer_model, tmp_path_factory) -> Iterator[Server]:
    srv = Server(no_tokenizer_model, tmp_path_factory.mktemp("ids-server-logs"), "ids", skip_tokenizer_init=True,
                 max_total_tokens=4096, context_length=512)
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


def test_an_engine_without_a_tokenizer_gives_the_token_ids_of_one_with_it(ids_engine, offline_engine):
    out = ids_engine.generate(input_ids=IDS, sampling_params=GREEDY)
    assert out.token_ids == offline_engine.generate(input_ids=IDS, sampling_params=GREEDY).token_ids
    assert out.text == ""


@pytest.mark.parametrize(("prompt", "params", "field"), [
    ("Hello", GREEDY, "prompt"),
    (IDS, {**GREEDY, "stop": ["x"]}, "stop"),
    (IDS, {**GREEDY, "json_schema": '{"type": "object"}'}, "json_schema"),
])
def test_an_engine_without_a_tokenizer_refuses_what_needs_text_naming_the_field(ids_engine, prompt, params, field):
    with pytest.raises(ValueError, match=rf"^{field}: .*skip_tokenizer_init"):
        ids_engine.generate(prompt, params)


def test_an_engine_without_a_tokenizer_refuses_token_texts_in_logprobs(ids_engine):
    with pytest.raises(ValueError, match="return_text_in_logprobs"):
        ids_engine.generate(input_ids=IDS, sampling_params=GREEDY, return_logprob=True, return_text_in_logprobs=True)


def test_skip_tokenizer_init_with_a_tokenizer_path_is_refused():
    with pytest.raises(ValueError, match="leave tokenizer unset"):
        EngineConfig(model="m", tokenizer="t", skip_tokenizer_init=True)


def _post(server: Server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=HTTP_TIMEOUT)


def test_the_native_api_serves_token_ids_without_a_tokenizer(ids_server, offline_engine):
    r = _post(ids_server, "/generate", {"input_ids": IDS, "sampling_params": GREEDY})
    assert r.status_code == 200, r.text
    ref = offline_engine.generate(input_ids=IDS, sampling_params=GREEDY)
    assert r.json()["output_ids"] == ref.token_ids and r.json()["text"] == ""


def test_a_streamed_generate_without_a_tokenizer_ends_with_every_token(ids_server, offline_engine):
    with httpx.stream("POST", ids_server.url + "/generate", json={"input_ids": IDS, "sampling_params": GREEDY,
                                                                  "stream": True}, timeout=HTTP_TIMEOUT) as r:
        events = [line for line in r.iter_lines() if line.startswith("data: {")]
    last = json.loads(events[-1].removeprefix("data: "))
    assert last["output_ids"] == offline_engine.generate(input_ids=IDS, sampling_params=GREEDY).token_ids


def test_completions_of_token_ids_work_without_a_tokenizer(ids_server, offline_engine):
    r = _post(ids_server, "/v1/completions", {"prompt": IDS, "max_tokens": 8, "temperature": 0,
                                              "return_token_ids": True})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["token_ids"] == offline_engine.generate(input_ids=IDS, sampling_params=GREEDY).token_ids
    assert choice["text"] == ""


@pytest.mark.parametrize(("path", "body", "param"), [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, "messages"),
    ("/v1/completions", {"prompt": "Hello", "max_tokens": 4}, "prompt"),
    ("/v1/completions", {"prompt": IDS, "max_tokens": 4, "stop": ["x"]}, "stop"),
    ("/v1/completions", {"prompt": IDS, "max_tokens": 4, "logprobs": 2}, "logprobs"),
    ("/v1/completions", {"prompt": IDS, "max_tokens": 4, "echo": True}, "echo"),
    ("/generate", {"text": "Hello", "sampling_params": GREEDY}, "text"),
    ("/v1/tokenize", {"prompt": "Hello"}, "prompt"),
    ("/v1/detokenize", {"tokens": IDS}, "tokens"),
])
def test_a_server_without_a_tokenizer_refuses_what_needs_text_naming_the_field(ids_server, path, body, param):
    assert_error(_post(ids_server, path, body), 400, param=param, contains="tokenizer")
    assert _post(ids_server, "/generate", {"input_ids": IDS, "sampling_params": GREEDY}).status_code == 200


def test_health_generate_probes_without_a_tokenizer(ids_server):
    assert httpx.get(ids_server.url + "/health_generate", timeout=HTTP_TIMEOUT).status_code == 200


def test_text_parsers_with_skip_tokenizer_init_fail_at_start_naming_the_flag(no_tokenizer_model):
    done = subprocess.run([sys.executable, "-m", "plait", "serve", "--model", str(no_tokenizer_model), "--device",
                           "cpu", "--skip-tokenizer-init", "--tool-call-parser", "hermes"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "--tool-call-parser read the text, which needs the tokenizer" in done.stderr
