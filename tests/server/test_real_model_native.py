"""One server on the real trained model (SmolLM2-135M-Instruct) with vLLM's --generation-config
pointing at a generation_config.json of our own: tokenize / detokenize round trips on a real
tokenizer, and the checkpoint's sampling defaults apply to requests that omit them."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import requests

from tests.server.conftest import HTTP_TIMEOUT, Server

# top_k 1 makes any temperature greedy: a request that leaves top_k unset must sample greedily.
GENERATION_CONFIG = {"temperature": 0.8, "top_k": 1, "do_sample": True}
PROMPT = "My favourite word is"


@pytest.fixture(scope="module")
def real_server(real_model_dir, tmp_path_factory) -> Iterator[Server]:
    gen_dir = tmp_path_factory.mktemp("generation-config")
    (gen_dir / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    srv = Server(real_model_dir, tmp_path_factory.mktemp("real-server-logs"), "real", max_total_tokens=4096,
                 context_length=1024, generation_config=str(gen_dir))
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def real_tokenizer(real_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(real_model_dir)


TEXTS = ["The capital of France is Paris.", "Ünïcödé, emoji 🙂 and CJK 漢字 survive the trip.",
         "  leading spaces,\ttabs\nand newlines  "]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_tokenize_detokenize_round_trip_on_the_real_model(real_server, real_tokenizer, text):
    tok = requests.post(real_server.url + "/v1/tokenize", json={"model": real_server.model, "prompt": text},
                        timeout=HTTP_TIMEOUT).json()
    assert tok["tokens"] == real_tokenizer.encode(text, add_special_tokens=True)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 1024
    back = requests.post(real_server.url + "/v1/detokenize", json={"model": real_server.model, "tokens": tok["tokens"]},
                         timeout=HTTP_TIMEOUT).json()
    assert back["text"] == text


def _sample(server: Server, **sampling: object) -> list[int]:
    body = {"text": PROMPT, "sampling_params": {"max_new_tokens": 6, "ignore_eos": True, "sampling_seed": 1,
                                                **sampling}}
    r = requests.post(server.url + "/generate", json=body, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    return r.json()["output_ids"]


def test_generation_config_defaults_apply_and_a_request_overrides_them(real_server):
    info = requests.get(real_server.url + "/get_model_info", timeout=HTTP_TIMEOUT).json()
    assert info["default_sampling_params"] == {"temperature": 0.8, "top_k": 1}
    greedy = _sample(real_server, temperature=0.0)
    assert _sample(real_server) == greedy  # top_k 1 from generation_config.json
    assert _sample(real_server, temperature=1.5) == greedy  # still top_k 1: only temperature was overridden
    assert _sample(real_server, temperature=1.5, top_k=-1) != greedy  # the request's own top_k wins


def test_generation_config_defaults_reach_the_openai_routes(real_server):
    import openai

    client = openai.OpenAI(base_url=real_server.url + "/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT)
    greedy = client.completions.create(model=real_server.model, prompt=PROMPT, max_tokens=6, temperature=0.0,
                                       extra_body={"ignore_eos": True}).choices[0].text
    default = client.completions.create(model=real_server.model, prompt=PROMPT, max_tokens=6, seed=1,
                                        extra_body={"ignore_eos": True}).choices[0].text
    assert default == greedy
