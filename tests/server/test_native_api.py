"""SGLang's native API on a real `plait serve`, called with `requests` as SGLang's scripts do:
/generate (single, batch, n, stream, logprobs, prompt scoring), tokenize / detokenize, and the
operations routes (/health_generate, /get_model_info, /get_server_info, /flush_cache,
/abort_request). Shapes are SGLang's (io_struct.GenerateReqInput, the tokenizer manager's
meta_info and finish_reason objects)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest
import requests

from tests.helpers import prompt_ids
from tests.server.conftest import HTTP_TIMEOUT

GREEDY = {"temperature": 0.0}
META_KEYS = {"id", "finish_reason", "prompt_tokens", "completion_tokens", "cached_tokens", "e2e_latency"}


def generate(server, **body: Any) -> requests.Response:
    return requests.post(server.url + "/generate", json=body, timeout=HTTP_TIMEOUT)


def stream_events(server, **body: Any) -> list[Any]:
    """The parsed data: events of a streamed /generate, "[DONE]" kept as is."""
    r = requests.post(server.url + "/generate", json={**body, "stream": True}, stream=True, timeout=HTTP_TIMEOUT)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = []
    for line in r.iter_lines():
        if not line:
            continue
        assert line.startswith(b"data: "), line
        data = line[len(b"data: "):].decode()
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_400(r: requests.Response, param: str, contains: str) -> None:
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param, err
    assert contains in err["message"], err


# --- /generate ------------------------------------------------------------------------------------
def test_generate_returns_sglangs_shape_and_the_engines_tokens(server, offline_engine):
    params = {"max_new_tokens": 12, "ignore_eos": True, **GREEDY}
    ref = offline_engine.generate("The capital of France is", params)
    r = generate(server, text="The capital of France is", sampling_params=params)
    assert r.status_code == 200, r.text
    out = r.json()
    assert set(out) == {"text", "output_ids", "meta_info"}
    assert out["output_ids"] == ref.token_ids and out["text"] == ref.text
    meta = out["meta_info"]
    assert set(meta) == META_KEYS
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert meta["prompt_tokens"] == ref.meta_info["prompt_tokens"] and meta["completion_tokens"] == 12
    assert meta["e2e_latency"] > 0 and isinstance(meta["id"], str)


def test_generate_batch_of_input_ids_returns_a_list_in_order(server, offline_engine):
    prompts = prompt_ids(3, seed=4)
    params = {"max_new_tokens": 6, "ignore_eos": True, **GREEDY}
    refs = offline_engine.generate(prompts, params)
    out = generate(server, input_ids=prompts, sampling_params=params).json()
    assert isinstance(out, list) and len(out) == 3
    assert [o["output_ids"] for o in out] == [r.token_ids for r in refs]
    assert [o["meta_info"]["prompt_tokens"] for o in out] == [len(p) for p in prompts]
    assert len({o["meta_info"]["id"] for o in out}) == 3


def test_generate_batch_takes_one_sampling_params_per_prompt(server):
    per_prompt = [{"max_new_tokens": 2, "ignore_eos": True, **GREEDY}, {"max_new_tokens": 5, "ignore_eos": True}]
    out = generate(server, text=["Hello", "Goodbye"], sampling_params=per_prompt).json()
    assert [o["meta_info"]["completion_tokens"] for o in out] == [2, 5]


def test_generate_n_samples_each_prompt(server):
    out = generate(server, text="Hello", sampling_params={"max_new_tokens": 4, "n": 3, "temperature": 1.0,
                                                          "sampling_seed": 7, "ignore_eos": True}).json()
    assert isinstance(out, list) and len(out) == 3
    assert len({tuple(o["output_ids"]) for o in out}) > 1  # seeds 7, 8, 9: different samples


def test_generate_stop_finish_reasons_name_what_matched(server):
    params = {"max_new_tokens": 10, "ignore_eos": True, **GREEDY}
    full = generate(server, text="Once upon a time", sampling_params=params).json()
    stop_id = full["output_ids"][2]
    by_id = generate(server, text="Once upon a time", sampling_params={**params, "stop_token_ids": [stop_id]}).json()
    assert by_id["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    stop = full["text"][3:5]
    by_str = generate(server, text="Once upon a time", sampling_params={**params, "stop": [stop]}).json()
    assert by_str["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert by_str["text"] == full["text"][: full["text"].index(stop)]
    kept = generate(server, text="Once upon a time", sampling_params={**params, "stop": [stop],
                                                                       "no_stop_trim": True}).json()
    assert kept["text"] == full["text"][: full["text"].index(stop) + len(stop)]


def test_generate_stream_sends_cumulative_text_then_done(server):
    params = {"max_new_tokens": 32, "ignore_eos": True, **GREEDY}
    whole = generate(server, text="Hello there", sampling_params=params).json()
    events = stream_events(server, text="Hello there", sampling_params=params)
    assert events[-1] == "[DONE]"
    # How many events carry the 32 tokens is the server's choice (a stream that lags gets its waiting
    # tokens merged into one event); each extends the one before.
    chunks = events[:-1]
    assert chunks
    for a, b in zip(chunks, chunks[1:], strict=False):
        assert b["text"].startswith(a["text"]) and b["output_ids"][: len(a["output_ids"])] == a["output_ids"]
        assert a["meta_info"]["finish_reason"] is None
    assert chunks[-1]["text"] == whole["text"] and chunks[-1]["output_ids"] == whole["output_ids"]
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 32}


def test_generate_batch_stream_events_carry_their_index(server):
    events = stream_events(server, text=["Hi", "Bye"], sampling_params={"max_new_tokens": 3, "ignore_eos": True,
                                                                        **GREEDY})
    assert events[-1] == "[DONE]"
    last = {e["index"]: e for e in events[:-1]}
    assert set(last) == {0, 1}
    assert all(e["meta_info"]["finish_reason"] == {"type": "length", "length": 3} for e in last.values())


def test_generate_logprobs_in_sglangs_layout(server):
    r = generate(server, input_ids=[5, 9, 40, 77, 120], sampling_params={"max_new_tokens": 4, **GREEDY},
                 return_logprob=True, top_logprobs_num=2, return_text_in_logprobs=True)
    meta = r.json()["meta_info"]
    out_ids = r.json()["output_ids"]
    assert meta["input_token_logprobs"] == [] and meta["input_top_logprobs"] == []  # logprob_start_len -1
    entries = meta["output_token_logprobs"]
    assert [tid for _, tid, _ in entries] == out_ids
    assert all(lp <= 0 and isinstance(text, str) for lp, _, text in entries)
    tops = meta["output_top_logprobs"]
    assert len(tops) == len(out_ids) and all(len(t) == 2 for t in tops)
    assert [t[0][1] for t in tops] == out_ids  # greedy: the chosen token is the best one
    assert all(t[0][0] == pytest.approx(e[0]) for t, e in zip(tops, entries, strict=True))


def test_generate_scores_the_prompt_from_logprob_start_len(server, offline_engine):
    ids = prompt_ids(5, seed=9)[4]  # 20 tokens
    ref = offline_engine.generate(ids, {"max_new_tokens": 1, **GREEDY}, return_logprob=True, logprob_start_len=0)
    ref_lps = [lp for lp, _, _ in ref.meta_info["input_token_logprobs"]]
    whole = generate(server, input_ids=ids, sampling_params={"max_new_tokens": 1, **GREEDY}, return_logprob=True,
                     logprob_start_len=0).json()["meta_info"]["input_token_logprobs"]
    assert [tid for _, tid, _ in whole] == ids and whole[0] == [None, ids[0], None]
    assert [lp for lp, _, _ in whole[1:]] == pytest.approx(ref_lps[1:], abs=1e-5)
    tail = generate(server, input_ids=ids, sampling_params={"max_new_tokens": 1, **GREEDY}, return_logprob=True,
                    logprob_start_len=15, top_logprobs_num=1).json()["meta_info"]
    assert [tid for _, tid, _ in tail["input_token_logprobs"]] == ids[15:]
    assert [lp for lp, _, _ in tail["input_token_logprobs"]] == pytest.approx(ref_lps[15:], abs=1e-5)
    assert len(tail["input_top_logprobs"]) == 5 and all(len(t) == 1 for t in tail["input_top_logprobs"])


def test_generate_streams_prompt_logprobs_too(server):
    events = stream_events(server, input_ids=[5, 9, 40, 77], sampling_params={"max_new_tokens": 2, **GREEDY},
                           return_logprob=True, logprob_start_len=1)
    assert [tid for _, tid, _ in events[-2]["meta_info"]["input_token_logprobs"]] == [9, 40, 77]


BAD_GENERATE = [
    ({"text": "hi", "input_ids": [1, 2]}, "input_ids", "exclusive"),
    ({"sampling_params": {"max_new_tokens": 2}}, "text", "one of text or input_ids is required"),
    ({"text": "hi", "sampling_params": {"logit_bias": {"100000": 5}}}, "sampling_params.logit_bias",
     "logit_bias keys must be token ids in [0, 512)"),
    ({"text": "hi", "sampling_params": {"logit_bias": {"5": 500}}}, "sampling_params.logit_bias",
     "logit_bias values must be in [-100, 100]"),
    ({"text": "hi", "sampling_params": {"temperature": -1}}, "sampling_params.temperature", "temperature must be >= 0"),
    ({"text": "hi", "sampling_params": {"max_new_tokens": 100000}}, "sampling_params.max_new_tokens",
     "exceeds the limit of 2048 tokens"),
    ({"text": "hi", "sampling_params": {"temprature": 0}}, "sampling_params.temprature",
     "unknown sampling parameter(s) 'temprature'"),
    ({"text": "hi", "sampling_params": {"n": 0}}, "sampling_params.n", "n must be an integer in [1, 128]"),
    ({"text": "hi", "sampling_params": {"regex": "a("}}, "sampling_params.regex", "regex is not a valid grammar"),
    ({"text": "hi", "sampling_params": {"regex": "a", "ebnf": 'root ::= "a"'}}, "sampling_params.regex",
     "regex is set with ebnf: at most one of json_schema, regex, ebnf, structural_tag"),
    ({"input_ids": [1, 99999]}, "input_ids", "must be in [0, 512)"),
    ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 2}, "logprob_start_len",
     "logprob_start_len (2) must be < the prompt length (2 tokens)"),
    ({"text": "hi", "return_logprob": True, "top_logprobs_num": 21}, "top_logprobs_num",
     "top_logprobs_num must be in [0, 20]"),
    ({"text": ["a", "b"], "sampling_params": [{}]}, "sampling_params", "has 1 entries for 2 prompts"),
    ({"text": "hi", "image_data": "x.png"}, "image_data", "Unrecognized request argument supplied: image_data"),
    ({"text": 5}, "text", "expected one of str, list[str]"),
]


@pytest.mark.parametrize(("body", "param", "contains"), BAD_GENERATE, ids=range(len(BAD_GENERATE)))
def test_bad_generate_request_is_a_400_naming_the_field(server, body, param, contains):
    assert_400(generate(server, **body), param, contains)


def test_generate_bad_input_leaves_the_server_serving(server):
    assert generate(server, text="hi", input_ids=[1]).status_code == 400
    ok = generate(server, text="hi", sampling_params={"max_new_tokens": 2, **GREEDY})
    assert ok.status_code == 200
    m = server.wait_idle()
    assert m["plait:kv_slots_in_use"] == 0


# --- /abort_request -------------------------------------------------------------------------------
def test_abort_request_by_rid_ends_the_request_with_abort(server):
    result: dict[str, Any] = {}

    def long_request() -> None:
        result["out"] = generate(server, text="Go", rid="native-abort-1",
                                 sampling_params={"max_new_tokens": 1500, "ignore_eos": True}).json()

    worker = threading.Thread(target=long_request)
    worker.start()
    deadline = time.monotonic() + 30
    aborted: list[str] = []
    while not aborted and time.monotonic() < deadline:  # until the request is in flight
        aborted = requests.post(server.url + "/abort_request", json={"rid": "native-abort-1"},
                                timeout=HTTP_TIMEOUT).json()["aborted"]
        time.sleep(0.05)
    worker.join(HTTP_TIMEOUT)
    assert aborted == ["native-abort-1"]
    meta = result["out"]["meta_info"]
    assert meta["id"] == "native-abort-1"
    assert meta["finish_reason"]["type"] == "abort" and meta["completion_tokens"] < 1500
    assert server.wait_idle()["plait:kv_slots_in_use"] == 0


def test_abort_request_needs_a_rid_or_abort_all(server):
    r = requests.post(server.url + "/abort_request", json={}, timeout=HTTP_TIMEOUT)
    assert_400(r, "rid", "rid is required")


# --- tokenize / detokenize ------------------------------------------------------------------------
@pytest.mark.parametrize("prefix", ["/v1", ""])
def test_tokenize_and_detokenize_round_trip(server, model_name, tokenizer, prefix):
    text = "Hello, world!"
    body = {"model": model_name, "prompt": text, "add_special_tokens": False}
    tok = requests.post(server.url + prefix + "/tokenize", json=body, timeout=HTTP_TIMEOUT).json()
    assert tok["tokens"] == tokenizer.encode(text, add_special_tokens=False)
    assert tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 2048
    back = requests.post(server.url + prefix + "/detokenize", json={"model": model_name, "tokens": tok["tokens"]},
                         timeout=HTTP_TIMEOUT).json()
    assert back == {"text": text}


def test_tokenize_a_list_of_prompts_gives_lists(server):
    tok = requests.post(server.url + "/v1/tokenize", json={"prompt": ["a b", "c"]}, timeout=HTTP_TIMEOUT).json()
    assert tok["count"] == [len(t) for t in tok["tokens"]] and len(tok["tokens"]) == 2


def test_detokenize_rejects_ids_outside_the_vocabulary(server):
    r = requests.post(server.url + "/v1/detokenize", json={"tokens": [1, 10**6]}, timeout=HTTP_TIMEOUT)
    assert_400(r, "tokens", "tokens must be in [0, ")


# --- operations routes ----------------------------------------------------------------------------
def test_health_generate_runs_a_generation(server):
    before = server.metrics()["plait:generation_tokens_total"]
    r = requests.get(server.url + "/health_generate", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200
    assert server.metrics()["plait:generation_tokens_total"] >= before + 1


def test_get_model_info_and_server_info(server):
    info = requests.get(server.url + "/get_model_info", timeout=HTTP_TIMEOUT).json()
    assert info["model_path"] == server.model and info["is_generation"] is True
    assert info["default_sampling_params"] == {}  # the tiny checkpoint's generation_config has none
    sinfo = requests.get(server.url + "/get_server_info", timeout=HTTP_TIMEOUT).json()
    assert sinfo["internal_states"][0]["max_total_num_tokens"] == 16384
    assert sinfo["config"]["model"] == server.model and "version" in sinfo


def test_flush_cache_empties_the_prefix_cache_when_idle(server):
    generate(server, text="A prompt that lands in the prefix cache", sampling_params={"max_new_tokens": 2})
    server.wait_idle()
    r = requests.post(server.url + "/flush_cache", timeout=HTTP_TIMEOUT)
    assert r.status_code == 200 and "Cache flushed" in r.text
    again = generate(server, text="A prompt that lands in the prefix cache", sampling_params={"max_new_tokens": 2})
    assert again.json()["meta_info"]["cached_tokens"] == 0
