"""The OpenAI API of `plait serve`, through the official `openai` client: every endpoint, streaming
and not, and greedy results equal to the offline Engine's."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.helpers import prompt_ids

GREEDY = {"temperature": 0.0}
TEXT_PROMPTS = ["Hello, my name is", "The capital of France is", "Once upon a time", "Café au lait, crème"]
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 42?"}]


def token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]


def chat_prompt_ids(tokenizer, messages, **kwargs) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
    return tokenizer.encode(text, add_special_tokens=False)


# --- /v1/models, /health, /metrics ----------------------------------------------------------------
def test_models_list_names_the_served_model(client, model_name):
    models = client.models.list().data
    assert [m.id for m in models] == [model_name]
    assert models[0].owned_by == "plait"
    assert models[0].model_extra["max_model_len"] == 2048
    assert models[0].model_extra["attention_backend"] == "torch_native"  # the effective name, not "auto"


def test_server_info_reports_the_attention_backend_of_the_model_card(server, client):
    info = httpx.get(server.url + "/server_info").json()
    assert info["attention_backend"] == client.models.list().data[0].model_extra["attention_backend"]
    assert info["attention_backend"] == info["scheduler"]["runner_info"]["attention_backend"]


def test_a_plan_checked_hybrid_reports_the_halves_that_serve(start_server):
    """PLAIT_CHECK_PLANS=1 wraps the (prefill, decode) hybrid: both endpoints still name the kernels
    that serve prefill and decode batches (plait.attention.hybrid.serving_backend_name)."""
    srv = start_server("checked-hybrid", env={"PLAIT_CHECK_PLANS": "1"}, decode_attention_backend="triton")
    card = httpx.get(srv.url + "/v1/models").json()["data"][0]
    info = httpx.get(srv.url + "/server_info").json()
    assert card["attention_backend"] == info["attention_backend"] == "hybrid(prefill=torch_native,decode=triton)"


def test_models_retrieve_returns_the_card_and_404s_unknown_names(client, model_name):
    assert client.models.retrieve(model_name).id == model_name
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_health_is_200_while_serving(server):
    r = httpx.get(server.url + "/health")
    assert r.status_code == 200 and r.json() == {"status": "ok"}


def test_metrics_use_vllm_names_with_the_plait_prefix(server, client, model_name):
    client.completions.create(model=model_name, prompt="Hello", max_tokens=3, **GREEDY)
    text = httpx.get(server.url + "/metrics").text
    for name in ("plait:num_requests_running", "plait:num_requests_waiting", "plait:kv_cache_usage_perc",
                 "plait:kv_slots_in_use", "plait:prompt_tokens_total", "plait:generation_tokens_total",
                 "plait:num_retractions_total", "plait:num_aborted_requests_total"):
        assert f'\n{name}{{model_name="{model_name}"}} ' in text, name
    for hist in ("plait:time_to_first_token_seconds", "plait:inter_token_latency_seconds",
                 "plait:e2e_request_latency_seconds"):
        assert f"# TYPE {hist} histogram" in text, hist
        assert f'{hist}_bucket{{le="+Inf",model_name="{model_name}"}}' in text
    m = server.metrics()
    assert m["plait:generation_tokens_total"] >= 3
    assert m["plait:e2e_request_latency_seconds_count"] >= 1


# --- /v1/completions ------------------------------------------------------------------------------
@pytest.mark.parametrize("prompt", TEXT_PROMPTS, ids=range(len(TEXT_PROMPTS)))
def test_greedy_text_completion_equals_the_offline_engine(client, model_name, offline_engine, prompt):
    ref = offline_engine.generate(prompt, {"max_new_tokens": 24, **GREEDY})
    out = client.completions.create(model=model_name, prompt=prompt, max_tokens=24, **GREEDY,
                                    extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert token_ids(choice) == ref.token_ids
    assert choice.text == ref.text
    assert choice.finish_reason == ref.finish_reason
    assert out.usage.prompt_tokens == ref.meta_info["prompt_tokens"]
    assert out.usage.completion_tokens == len(ref.token_ids)
    assert out.usage.total_tokens == out.usage.prompt_tokens + out.usage.completion_tokens


def test_a_batch_of_token_id_prompts_equals_the_offline_engine(client, model_name, offline_engine):
    prompts = prompt_ids(6)
    refs = offline_engine.generate(prompts, {"max_new_tokens": 16, "ignore_eos": True, **GREEDY})
    out = client.completions.create(model=model_name, prompt=prompts, max_tokens=16, **GREEDY,
                                    extra_body={"return_token_ids": True, "ignore_eos": True})
    assert [c.index for c in out.choices] == list(range(6))
    assert [token_ids(c) for c in out.choices] == [r.token_ids for r in refs]
    assert out.usage.prompt_tokens == sum(len(p) for p in prompts)
    assert out.usage.completion_tokens == 6 * 16


def test_streamed_completion_concatenates_to_the_non_streamed_one(client, model_name):
    full = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=20, **GREEDY)
    chunks = list(client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=20,
                                            stream=True, stream_options={"include_usage": True}, **GREEDY))
    text_chunks = [c for c in chunks if c.choices]
    assert "".join(c.choices[0].text for c in text_chunks) == full.choices[0].text
    assert text_chunks[-1].choices[0].finish_reason == full.choices[0].finish_reason
    assert all(c.choices[0].finish_reason is None for c in text_chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_continuous_usage_stats_put_the_usage_so_far_on_every_chunk(client, model_name):
    chunks = list(client.completions.create(
        model=model_name, prompt="Once upon a time", max_tokens=12, stream=True, extra_body={"ignore_eos": True},
        stream_options={"include_usage": True, "continuous_usage_stats": True}, **GREEDY))
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[-1] == 12
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_stream_ends_with_done_and_sends_usage_only_when_asked(server, model_name):
    body = {"model": model_name, "prompt": "Hello", "max_tokens": 4, "stream": True, **GREEDY}
    lines = [ln for ln in server.post("/v1/completions", json=body).text.split("\n") if ln]
    assert lines[-1] == "data: [DONE]"
    assert all(ln.startswith("data: ") for ln in lines)
    assert '"usage"' not in "".join(lines)


def test_stop_string_ends_the_completion_before_it(client, model_name):
    full = client.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=24,
                                     extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    out = client.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=24, stop=[stop],
                                    extra_body={"ignore_eos": True}, **GREEDY).choices[0]
    assert out.finish_reason == "stop"
    assert out.text == full[: full.index(stop)]


@pytest.mark.parametrize("field", ["include_stop_str_in_output", "no_stop_trim"])  # vLLM's name, SGLang's
def test_a_kept_stop_string_ends_the_completion_after_it(client, model_name, field):
    full = client.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=24,
                                     extra_body={"ignore_eos": True}, **GREEDY).choices[0].text
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    chunks = client.completions.create(model=model_name, prompt="Hello, my name is", max_tokens=24, stop=[stop],
                                       stream=True, extra_body={"ignore_eos": True, field: True}, **GREEDY)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full[: full.index(stop) + len(stop)]


def test_stop_token_ids_end_the_completion_at_that_token(client, model_name):
    first = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=8, **GREEDY,
                                      extra_body={"return_token_ids": True, "ignore_eos": True}).choices[0]
    stop_id = token_ids(first)[3]
    k = token_ids(first).index(stop_id)
    out = client.completions.create(model=model_name, prompt="Once upon a time", max_tokens=8, **GREEDY,
                                    extra_body={"return_token_ids": True, "ignore_eos": True,
                                                "stop_token_ids": [stop_id]}).choices[0]
    assert out.finish_reason == "stop"
    assert token_ids(out) == token_ids(first)[: k + 1]


def test_completion_logprobs_list_each_token_and_its_top_alternatives(client, model_name):
    out = client.completions.create(model=model_name, prompt="Hello", max_tokens=6, logprobs=3, **GREEDY)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 6
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert len(top) == 3
        assert val <= 0 and val == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the top token
        assert tok in top
    assert lp.text_offset == sorted(lp.text_offset)


def test_seeded_sampling_with_n_choices_is_reproducible(client, model_name):
    def run():
        return client.completions.create(model=model_name, prompt="Hello", max_tokens=12, n=3, temperature=1.0,
                                         top_p=0.95, seed=1234, extra_body={"top_k": 50, "min_p": 0.01,
                                                                            "return_token_ids": True})
    a, b = run(), run()
    assert [token_ids(c) for c in a.choices] == [token_ids(c) for c in b.choices]
    assert len({tuple(token_ids(c)) for c in a.choices}) > 1, "n choices must be drawn independently"
    assert a.usage.completion_tokens == sum(len(token_ids(c)) for c in a.choices)


def test_penalties_are_applied(client, model_name, offline_engine):
    params = {"frequency_penalty": 1.5, "presence_penalty": 0.5}
    ref = offline_engine.generate("Hello", {"max_new_tokens": 16, "repetition_penalty": 1.3, **params, **GREEDY})
    out = client.completions.create(model=model_name, prompt="Hello", max_tokens=16, **params, **GREEDY,
                                    extra_body={"repetition_penalty": 1.3, "return_token_ids": True})
    assert token_ids(out.choices[0]) == ref.token_ids


def test_unused_openai_fields_are_accepted(client, model_name):
    out = client.completions.create(model=model_name, prompt="Hello", max_tokens=2, user="someone",
                                    extra_body={"store": False, "metadata": {"k": "v"}}, **GREEDY)
    assert out.usage.completion_tokens == 2


# --- /v1/chat/completions -------------------------------------------------------------------------
def test_greedy_chat_equals_the_offline_engine_on_the_chat_template(client, model_name, offline_engine, tokenizer):
    ids = chat_prompt_ids(tokenizer, MESSAGES)
    ref = offline_engine.generate(ids, {"max_new_tokens": 24, **GREEDY})
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_completion_tokens=24, **GREEDY,
                                         extra_body={"return_token_ids": True})
    choice = out.choices[0]
    assert choice.model_extra["prompt_token_ids"] == ids
    assert token_ids(choice) == ref.token_ids
    assert choice.message.role == "assistant" and choice.message.content == ref.text
    assert out.usage.prompt_tokens == len(ids)
    assert out.object == "chat.completion"


def test_streamed_chat_starts_with_the_role_and_ends_with_usage(client, model_name):
    full = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=16, **GREEDY)
    chunks = list(client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=16, stream=True,
                                                 stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[0].object == "chat.completion.chunk"
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert content == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == [full.choices[0].finish_reason]
    assert chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_chat_template_kwargs_reach_the_template(client, model_name, tokenizer):
    with_prompt = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=1, **GREEDY)
    without = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=1, **GREEDY,
                                             extra_body={"chat_template_kwargs": {"add_generation_prompt": False}})
    text_without = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert without.usage.prompt_tokens == len(tokenizer.encode(text_without, add_special_tokens=False))
    assert without.usage.prompt_tokens < with_prompt.usage.prompt_tokens


def test_chat_text_parts_are_joined(client, model_name):
    parts = [{"role": "user", "content": [{"type": "text", "text": "What is"}, {"type": "text", "text": "42?"}]}]
    joined = [{"role": "user", "content": "What is\n42?"}]
    a = client.chat.completions.create(model=model_name, messages=parts, max_tokens=8, **GREEDY)
    b = client.chat.completions.create(model=model_name, messages=joined, max_tokens=8, **GREEDY)
    assert a.choices[0].message.content == b.choices[0].message.content
    assert a.usage.prompt_tokens == b.usage.prompt_tokens


def test_chat_logprobs_give_top_alternatives(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=MESSAGES, max_tokens=5, logprobs=True,
                                         top_logprobs=2, **GREEDY)
    content = out.choices[0].logprobs.content
    assert len(content) == out.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-5)
        if not entry.token.startswith("bytes:"):  # a whole character: its UTF-8
            assert entry.bytes == list(entry.token.encode())
