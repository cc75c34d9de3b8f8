"""A server safe to expose and to operate: the API key, CORS, request bounds, prompts kept out of
the logs, the request log, metric labels and SGLang's metric names, and the failures an operator
meets (a huge prompt or template, a client that stops reading). Real `plait serve` subprocesses:
the shared one, plus one started here once per session ("ops": every operator flag at once)."""

from __future__ import annotations

import json
import re
import socket
import time
import uuid
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.server.conftest import HTTP_TIMEOUT

API_KEY = "sk-test-0123456789"
GOOD_ORIGIN = "https://good.example"
BAD_ORIGIN = "https://evil.example"
MARKER = "ZQXJ-prompt-marker-7781"  # text that must not reach the log unless asked for
AUTH = {"Authorization": f"Bearer {API_KEY}"}
# A chat template that renders 12 MB from a 150-byte request.
HUGE_TEMPLATE = "{% for i in range(100000) %}" + "x" * 120 + "{% endfor %}"


@pytest.fixture(scope="session")
def ops(start_server):
    """An API key, one allowed origin, request lines (level 0) under debug logging (the most the
    server ever logs, for the prompt-leak check), SGLang's metric names, request chat templates
    allowed, a small stream buffer, and the default 16 MiB body limit."""
    return start_server("ops", api_key=API_KEY, allowed_origins=GOOD_ORIGIN, log_requests=True, log_level="debug",
                        sglang_metrics=True, trust_request_chat_template=True, max_stream_buffer=8,
                        context_length=2048)


def post(srv, path: str, body: dict) -> httpx.Response:
    return httpx.post(srv.url + path, json=body, headers=AUTH, timeout=HTTP_TIMEOUT)


def completion_body(model: str, prompt: str = "Hello", **extra) -> dict:
    return {"model": model, "prompt": prompt, "max_tokens": 3, "temperature": 0, **extra}


def assert_openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


# --- API key -------------------------------------------------------------------------------------
ROUTES = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"), ("GET", "/v1/models"),
          ("GET", "/server_info")]


def call(srv, method: str, path: str, headers: dict) -> httpx.Response:
    body = None
    if path == "/v1/completions":
        body = completion_body(srv.model)
    elif path == "/v1/chat/completions":
        body = {"model": srv.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2}
    return httpx.request(method, srv.url + path, json=body, headers=headers, timeout=HTTP_TIMEOUT)


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_without_the_api_key_every_route_is_a_401_in_openai_shape(ops, method, path):
    err = assert_openai_error(call(ops, method, path, {}), 401)
    assert err["code"] == "invalid_api_key" and "--api-key" in err["message"]


@pytest.mark.parametrize("header", [f"Bearer {API_KEY}x", "Bearer sk-wrong", API_KEY, f"Basic {API_KEY}"])
def test_a_wrong_key_or_scheme_is_a_401(ops, header):
    assert_openai_error(call(ops, "GET", "/v1/models", {"Authorization": header}), 401)


@pytest.mark.parametrize(("method", "path"), ROUTES)
def test_the_right_key_opens_every_route(ops, method, path):
    assert call(ops, method, path, AUTH).status_code == 200


@pytest.mark.parametrize("path", ["/health", "/metrics", "/health_generate"])
def test_health_and_metrics_need_no_key(ops, path):
    r = httpx.get(ops.url + path, timeout=HTTP_TIMEOUT)
    assert r.status_code != 401
    if path != "/health_generate":  # a route of the native API; here only its exemption matters
        assert r.status_code == 200


def test_the_openai_client_authenticates_with_the_key(ops):
    import openai as oa

    good = oa.OpenAI(base_url=ops.url + "/v1", api_key=API_KEY, max_retries=0, timeout=HTTP_TIMEOUT)
    assert good.completions.create(model=ops.model, prompt="Hi", max_tokens=2).usage.completion_tokens == 2
    bad = oa.OpenAI(base_url=ops.url + "/v1", api_key="sk-nope", max_retries=0, timeout=HTTP_TIMEOUT)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


# --- CORS ----------------------------------------------------------------------------------------
def preflight(srv, origin: str) -> httpx.Response:
    return httpx.options(srv.url + "/v1/completions", timeout=HTTP_TIMEOUT, headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})


def test_cors_allows_every_origin_by_default(server, model_name):
    r = preflight(server, BAD_ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "*"
    assert "POST" in r.headers["access-control-allow-methods"]
    plain = server.post("/v1/completions", json=completion_body(model_name), headers={"Origin": BAD_ORIGIN})
    assert plain.status_code == 200 and plain.headers["access-control-allow-origin"] == "*"


def test_cors_preflight_of_an_allowed_origin_passes_without_the_key(ops):
    r = preflight(ops, GOOD_ORIGIN)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == GOOD_ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()


def test_cors_preflight_of_an_origin_not_allowed_is_refused(ops):
    r = preflight(ops, BAD_ORIGIN)
    assert r.status_code == 400 and "access-control-allow-origin" not in r.headers


def test_a_401_carries_the_cors_headers_so_a_browser_can_read_it(ops):
    r = httpx.get(ops.url + "/v1/models", headers={"Origin": GOOD_ORIGIN}, timeout=HTTP_TIMEOUT)
    assert r.status_code == 401 and r.headers["access-control-allow-origin"] == GOOD_ORIGIN


# --- request bounds ------------------------------------------------------------------------------
@pytest.mark.parametrize(("fields", "param"), [
    ({"stop": [f"s{i}" for i in range(65)]}, "stop"),
    ({"stop": "x" * 1025}, "stop"),
    ({"stop_token_ids": list(range(1025))}, "stop_token_ids"),
    ({"n": 129}, "n"),
    ({"logprobs": 21}, "logprobs"),
])
def test_stop_lists_n_and_logprob_counts_are_bounded(server, model_name, fields, param):
    err = assert_openai_error(server.post("/v1/completions", json=completion_body(model_name, **fields)), 400)
    assert err["param"] == param


# --- logs ----------------------------------------------------------------------------------------
def test_prompts_never_reach_the_log_below_level_2(ops):
    chat = {"model": ops.model, "messages": [{"role": "user", "content": f"Say {MARKER}"}], "max_tokens": 2}
    bodies = [
        ("/v1/completions", completion_body(ops.model, f"Tell me {MARKER}", stop=[MARKER])),
        ("/v1/chat/completions", chat),
        ("/v1/completions", completion_body(ops.model, f"{MARKER}", temprature=1)),  # 400: unknown field
        ("/v1/completions", completion_body(ops.model, MARKER * 3000)),  # 400: over the context
        ("/v1/chat/completions", {**chat, "chat_template": MARKER + " {{ messages[0]['content'] }}"}),
    ]
    statuses = [post(ops, path, body).status_code for path, body in bodies]
    assert statuses == [200, 200, 400, 400, 200]
    time.sleep(0.2)
    log = ops.log()
    assert re.search(r"request \S+ status=\w+ prompt_tokens=\d+ output_tokens=\d+ ttft_ms=[\d.]+ latency_ms=[\d.]+",
                     log), log[-2000:]
    assert MARKER not in log


def request_lines(srv) -> list[str]:
    return [ln for ln in srv.log().splitlines() if "plait.requests" in ln]


def test_the_request_log_has_one_line_per_request_with_its_numbers(ops):
    before = len(request_lines(ops))
    r = post(ops, "/v1/completions", completion_body(ops.model, max_tokens=5, ignore_eos=True, n=2))
    assert r.status_code == 200
    time.sleep(0.2)
    lines = request_lines(ops)[before:]
    assert len(lines) == 2  # one per choice: each is a scheduler request
    for line in lines:
        m = re.search(r"request (\S+) status=(\w+) prompt_tokens=(\d+) output_tokens=(\d+) ttft_ms=([\d.]+) "
                      r"latency_ms=([\d.]+)$", line)
        assert m is not None, line
        assert m[2] == "length" and int(m[3]) == r.json()["usage"]["prompt_tokens"] and int(m[4]) == 5
        assert 0 < float(m[5]) <= float(m[6])


# --- metrics -------------------------------------------------------------------------------------
def samples(srv) -> list[str]:
    text = httpx.get(srv.url + "/metrics", timeout=HTTP_TIMEOUT).text
    return [ln for ln in text.splitlines() if ln and not ln.startswith("#")]


def test_every_metric_carries_the_model_name_label(server, model_name):
    lines = samples(server)
    assert lines
    label = f'model_name="{model_name}"'
    assert [ln for ln in lines if label not in ln] == []


def test_the_prefix_cache_counts_queries_and_hits(server, model_name):
    # A prefix no earlier test on the shared server can have cached: only the second request hits.
    # (Its first tokens may still match an earlier prompt's, e.g. a shared leading token: the second
    # request's hits are read on their own.)
    prompt = uuid.uuid4().hex + " the same long prefix, repeated so that the radix cache can serve it. " * 3
    counts = [server.wait_idle()]
    for _ in range(2):
        r = server.post("/v1/completions", json=completion_body(model_name, prompt, max_tokens=1))
        assert r.status_code == 200
        counts.append(server.wait_idle())
    n = r.json()["usage"]["prompt_tokens"]
    queries = [b["plait:prefix_cache_queries_total"] - a["plait:prefix_cache_queries_total"]
               for a, b in zip(counts, counts[1:], strict=False)]
    hits = [b["plait:prefix_cache_hits_total"] - a["plait:prefix_cache_hits_total"]
            for a, b in zip(counts, counts[1:], strict=False)]
    assert queries == [n, n]
    assert hits[0] < 16  # a new prompt: at most a leading token or a page in common with earlier ones
    assert n - 16 <= hits[1] < n  # the whole prompt again, but for its last token (and a page)
    assert 0 < counts[-1]["plait:prefix_cache_hit_rate"] <= 1


LOOP = ("iterations", "recv_seconds", "step_seconds", "collect_seconds", "send_seconds", "prefill_iterations",
        "prefill_step_seconds")


def test_the_scheduler_loop_times_its_phases_while_it_works_and_not_while_idle(server, model_name):
    before = server.wait_idle()
    r = server.post("/v1/completions", json=completion_body(model_name, max_tokens=12, ignore_eos=True))
    assert r.status_code == 200
    after = server.wait_idle()
    grew = {k: after[f"plait:scheduler_loop_{k}_total"] - before[f"plait:scheduler_loop_{k}_total"] for k in LOOP}
    # A step per generated token; the times ride with the updates, so the last iteration's may not have.
    assert grew["iterations"] >= 10
    assert grew["step_seconds"] > 0 and all(v >= 0 for v in grew.values())
    # One prompt: its prefill step (or chunks); the other steps decode.
    assert 1 <= grew["prefill_iterations"] < grew["iterations"]
    assert 0 < grew["prefill_step_seconds"] < grew["step_seconds"]
    time.sleep(0.3)  # idle: the loop adds nothing, so no snapshot changes them
    idle = server.metrics()
    assert all(idle[f"plait:scheduler_loop_{k}_total"] == after[f"plait:scheduler_loop_{k}_total"] for k in LOOP)


def test_sglang_metric_names_are_exported_on_request(ops):
    r = post(ops, "/v1/completions", completion_body(ops.model, max_tokens=16, ignore_eos=True))
    assert r.status_code == 200
    m = ops.metrics()
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:token_usage", "sglang:cache_hit_rate",
                 "sglang:num_used_tokens", "sglang:prompt_tokens_total", "sglang:generation_tokens_total",
                 "sglang:cached_tokens_total", "sglang:time_to_first_token_seconds_count",
                 "sglang:e2e_request_latency_seconds_count"):
        assert name in m, name
    assert m["sglang:generation_tokens_total"] == m["plait:generation_tokens_total"] >= 16
    assert m["sglang:e2e_request_latency_seconds_count"] == m["plait:e2e_request_latency_seconds_count"]
    assert m["sglang:gen_throughput"] > 0  # tokens were generated within the window
    assert all(f'model_name="{ops.model}"' in ln for ln in samples(ops) if ln.startswith("sglang:"))


def test_sglang_names_are_off_by_default(server):
    assert not any(ln.startswith("sglang:") for ln in samples(server))


# --- huge prompts and templates ------------------------------------------------------------------
def health_latencies_while(srv, work) -> tuple[object, float]:
    """Run ``work`` in a thread; poll /health meanwhile; return its result and the slowest /health."""
    worst = 0.0
    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(work)
        while not future.done():
            t0 = time.monotonic()
            assert httpx.get(srv.url + "/health", timeout=HTTP_TIMEOUT).status_code == 200
            worst = max(worst, time.monotonic() - t0)
            time.sleep(0.01)
        return future.result(), worst


@pytest.mark.parametrize("route", ["/v1/completions", "/generate"])
def test_a_15_mb_prompt_does_not_block_health_and_is_refused_quickly(ops, route):
    prompt = "All work and no play makes Jack a dull boy. " * 350_000  # 15.4 MB
    body = completion_body(ops.model, prompt) if route == "/v1/completions" else {
        "text": prompt, "sampling_params": {"max_new_tokens": 3}}
    payload = json.dumps(body).encode()

    def send():
        t0 = time.monotonic()
        r = httpx.post(ops.url + route, content=payload, timeout=HTTP_TIMEOUT,
                       headers={"Content-Type": "application/json", **AUTH})
        return r, time.monotonic() - t0

    (r, took), worst_health = health_latencies_while(ops, send)
    err = assert_openai_error(r, 400)
    assert err["code"] == "context_length_exceeded" and "maximum context length is 2048" in err["message"]
    assert took < 5.0  # tokenizing all of it takes ~10 s here; the prefix bound refuses it early
    assert worst_health < 1.0


def test_a_request_supplied_chat_template_is_refused_by_default(server, model_name):
    for extra in ({"chat_template": HUGE_TEMPLATE}, {"chat_template_kwargs": {"chat_template": HUGE_TEMPLATE}}):
        body = {"model": model_name, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **extra}
        t0 = time.monotonic()
        err = assert_openai_error(server.post("/v1/chat/completions", json=body), 400)
        assert time.monotonic() - t0 < 1.0
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


def test_an_allowed_request_template_that_renders_12_mb_is_bounded(ops):
    body = {"model": ops.model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "chat_template_kwargs": {"chat_template": HUGE_TEMPLATE}}
    assert len(json.dumps(body)) - len(ops.model) < 300

    def send():
        t0 = time.monotonic()
        return post(ops, "/v1/chat/completions", body), time.monotonic() - t0

    (r, took), worst_health = health_latencies_while(ops, send)
    err = assert_openai_error(r, 400)
    assert "context length" in err["message"] or "rendered" in err["message"]
    assert took < 5.0 and worst_health < 1.0
    small = {**body, "chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }} says"}}
    assert post(ops, "/v1/chat/completions", small).status_code == 200  # allowed templates work


# --- a client that stops reading -----------------------------------------------------------------
def open_unread_stream(srv, body: dict) -> socket.socket:
    """Send a streaming request on a socket with a tiny receive buffer, and never read from it."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    data = json.dumps({**body, "stream": True}).encode()
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Authorization: " + AUTH["Authorization"].encode() + b"\r\n"
                 b"Content-Length: " + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


def test_a_client_that_stops_reading_is_aborted_and_slows_no_one(ops):
    before = ops.wait_idle()
    # Four choices with 20 logprobs each: kilobytes per step, so the socket buffers fill in a few
    # hundred steps (the kernel's 128 KiB send buffer, uvicorn's 64 KiB), then the 8 updates per choice.
    stalled = open_unread_stream(ops, completion_body(ops.model, "Never read", max_tokens=1500, ignore_eos=True,
                                                      n=4, logprobs=20))
    try:
        client = openai.OpenAI(base_url=ops.url + "/v1", api_key=API_KEY, max_retries=0, timeout=HTTP_TIMEOUT)
        t0 = time.monotonic()
        results = []
        for i in range(4):  # others keep being served while the stalled stream fills its buffers
            out = client.completions.create(model=ops.model, prompt=f"Reader {i}", max_tokens=24, temperature=0,
                                            extra_body={"ignore_eos": True})
            results.append(out.usage.completion_tokens)
        assert results == [24] * 4
        deadline = time.monotonic() + 60
        while True:  # the stalled one is aborted once its buffer is full, with its socket still open
            m = ops.metrics()
            if m["plait:num_aborted_requests_total"] - before["plait:num_aborted_requests_total"] == 4:
                break
            assert time.monotonic() < deadline, "the unread stream was never aborted"
            time.sleep(0.05)
        aborted_after = time.monotonic() - t0
        after = ops.wait_idle()
        assert after["plait:kv_slots_in_use"] == 0 and after["plait:num_requests_running"] == 0
        assert after["plait:generation_tokens_total"] - before["plait:generation_tokens_total"] < 4 * 24 + 4 * 1000
        assert aborted_after < 60
    finally:
        stalled.close()
    assert "its client stopped reading" in ops.log()


# --- the request log's levels (the class itself; the server test above shows level 0) ------------
@pytest.mark.parametrize(("level", "shows_text", "shows_params"), [(0, False, False), (1, False, True),
                                                                   (2, True, True), (3, True, True)])
def test_request_log_levels_add_sampling_parameters_then_text(tokenizer, caplog, level, shows_text, shows_params):
    from plait.sampling import SamplingParams
    from plait.server.request_log import RequestLog, RequestRecord

    log = RequestLog(level, tokenizer)
    rec = RequestRecord("rid-1", tokenizer.encode(f"Tell me {MARKER}"), SamplingParams(max_new_tokens=7))
    rec.status, rec.output_tokens, rec.first_token = "stop", 2, rec.arrival + 0.01
    rec.output_text = ["out", "put"] if log.keeps_text else []
    with caplog.at_level("INFO", logger="plait.requests"):
        log.write(rec)
    (line,) = [r.getMessage() for r in caplog.records if r.name == "plait.requests"]
    assert line.startswith("request rid-1 status=stop prompt_tokens=") and "output_tokens=2 ttft_ms=10.0" in line
    assert (MARKER in line) == shows_text and ("'output'" in line) == shows_text
    assert ("max_new_tokens" in line) == shows_params


def test_request_log_level_2_cuts_long_prompts(tokenizer, caplog):
    from plait.sampling import SamplingParams
    from plait.server.request_log import PARTIAL_CHARS, RequestLog, RequestRecord

    rec = RequestRecord("rid-2", tokenizer.encode("word " * 5000), SamplingParams())
    with caplog.at_level("INFO", logger="plait.requests"):
        RequestLog(2, tokenizer).write(rec)
        RequestLog(3, tokenizer).write(rec)
    partial, full = (r.getMessage() for r in caplog.records if r.name == "plait.requests")
    assert PARTIAL_CHARS < len(partial) < PARTIAL_CHARS + 1000 < len(full)


# --- the prompt bounds themselves ---------------------------------------------------------------
@pytest.fixture
def small_frontend(tokenizer):
    from plait.engine.frontend import Frontend, RequestLimits

    return Frontend(tokenizer, RequestLimits(vocab_size=len(tokenizer), max_context_len=256, max_total_tokens=4096))


def test_a_text_far_over_the_limit_is_refused_on_its_prefix(small_frontend):
    from plait.server.prompt_work import PREFIX_CHARS_PER_TOKEN, PromptTooLong, encode_bounded

    text = "All work and no play makes Jack a dull boy. " * 100_000  # 4.4 MB
    t0 = time.monotonic()
    with pytest.raises(PromptTooLong, match="maximum context length is 256 tokens") as exc:
        encode_bounded(small_frontend, text, add_special_tokens=True)
    assert time.monotonic() - t0 < 1.0
    assert exc.value.min_tokens > 256
    assert f"first {256 * PREFIX_CHARS_PER_TOKEN} characters" in str(exc.value)


def test_texts_within_the_bound_tokenize_exactly(small_frontend, tokenizer):
    from plait.server.prompt_work import encode_bounded

    # Short; and over the token limit but under the prefix bound, so tokenized whole (the length
    # check then refuses it with the exact count).
    for text in ("Hello there", "x " * 1000):
        assert encode_bounded(small_frontend, text, add_special_tokens=True) == tokenizer.encode(text)
    assert len(tokenizer.encode("x " * 1000)) > 256


def test_a_rendering_over_the_body_limit_is_refused():
    from plait.server.prompt_work import check_rendered

    check_rendered("x" * 100, 100)
    with pytest.raises(ValueError, match="rendered 101 characters, over the limit of 100"):
        check_rendered("x" * 101, 100)
