"""OpenAI request fields SGLang and vLLM accept, through the real `openai` client: logit_bias (chat
and completions) and echo on completions (the prompt's text, and its logprobs when asked)."""

from __future__ import annotations

import openai
import pytest

GREEDY = {"temperature": 0.0}
FORCED = 77  # a token id of the tiny vocabulary


def test_logit_bias_forces_a_token_in_chat(client, model_name):
    out = client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                         max_tokens=5, temperature=0.9, seed=3, logit_bias={str(FORCED): 100},
                                         extra_body={"return_token_ids": True, "ignore_eos": True})
    assert out.choices[0].model_extra["token_ids"] == [FORCED] * 5


def test_logit_bias_forces_a_token_in_completions(client, model_name):
    out = client.completions.create(model=model_name, prompt="Hello", max_tokens=4, logit_bias={str(FORCED): 100},
                                    extra_body={"return_token_ids": True, "ignore_eos": True}, **GREEDY)
    assert out.choices[0].model_extra["token_ids"] == [FORCED] * 4


def test_negative_logit_bias_bans_the_greedy_token(client, model_name):
    plain = client.completions.create(model=model_name, prompt="Hello", max_tokens=1,
                                      extra_body={"return_token_ids": True}, **GREEDY)
    first = plain.choices[0].model_extra["token_ids"][0]
    banned = client.completions.create(model=model_name, prompt="Hello", max_tokens=1, logit_bias={str(first): -100},
                                       extra_body={"return_token_ids": True}, **GREEDY)
    assert banned.choices[0].model_extra["token_ids"][0] != first


@pytest.mark.parametrize(("bias", "contains"), [
    ({"5000": 1}, "logit_bias keys must be token ids in [0, 512)"),
    ({"5": 101}, "logit_bias values must be in [-100, 100], got 101 for token 5"),
    ({"five": 1}, "logit_bias keys must be token ids (integers), got 'five'"),
])
def test_bad_logit_bias_is_a_400_naming_the_field(client, model_name, bias, contains):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                       logit_bias=bias)
    assert e.value.body["param"] == "logit_bias"
    assert contains in e.value.body["message"]


def test_echo_puts_the_prompt_before_the_completion(client, model_name):
    plain = client.completions.create(model=model_name, prompt="Once upon", max_tokens=5, **GREEDY)
    echoed = client.completions.create(model=model_name, prompt="Once upon", max_tokens=5, echo=True, **GREEDY)
    assert echoed.choices[0].text == "Once upon" + plain.choices[0].text
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens


def test_echo_with_logprobs_scores_the_prompt_tokens_first(client, model_name, tokenizer):
    prompt_ids = tokenizer.encode("Once upon")
    out = client.completions.create(model=model_name, prompt="Once upon", max_tokens=3, echo=True, logprobs=2,
                                    **GREEDY)
    lp = out.choices[0].logprobs
    n = len(prompt_ids)
    assert len(lp.tokens) == n + 3
    assert lp.tokens[:n] == [tokenizer.decode([t]) for t in prompt_ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token follows nothing
    assert all(v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(t) == 2 for t in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0


def test_echo_of_token_prompts_decodes_them(client, model_name, tokenizer):
    ids = [40, 41, 42, 43]
    out = client.completions.create(model=model_name, prompt=ids, max_tokens=2, echo=True, **GREEDY)
    assert out.choices[0].text.startswith(tokenizer.decode(ids))


def test_streamed_echo_sends_the_prompt_first(client, model_name):
    full = client.completions.create(model=model_name, prompt="Once upon", max_tokens=5, echo=True, **GREEDY)
    chunks = list(client.completions.create(model=model_name, prompt="Once upon", max_tokens=5, echo=True,
                                            stream=True, **GREEDY))
    assert chunks[0].choices[0].text.startswith("Once upon")
    assert "".join(c.choices[0].text for c in chunks) == full.choices[0].text
