"""Sampling through the whole engine: seeds, top_k=1, stop strings, min_new_tokens, penalties, logprobs."""

from __future__ import annotations

import math
from collections import Counter

import pytest

from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(6, seed=7)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir("qwen2"))


def test_seeded_request_is_reproducible_across_batch_compositions(engine):
    params = {"temperature": 1.0, "top_p": 0.95, "seed": 1234, "max_new_tokens": 24}
    alone = engine.generate(PROMPTS[0], params).token_ids
    others = {"temperature": 0.8, "max_new_tokens": 30}
    in_batch = engine.generate([PROMPTS[3], PROMPTS[0], PROMPTS[1]], [others, params, others])[1].token_ids
    reordered = engine.generate([PROMPTS[0], *PROMPTS[1:]], [params] + [others] * 5)[0].token_ids
    assert alone == in_batch == reordered
    assert len(set(alone)) > 4  # it really sampled
    assert_no_leaks(engine)


def test_different_seeds_give_different_samples(engine):
    a = engine.generate(PROMPTS[0], {"temperature": 1.0, "seed": 1, "max_new_tokens": 24}).token_ids
    b = engine.generate(PROMPTS[0], {"temperature": 1.0, "seed": 2, "max_new_tokens": 24}).token_ids
    assert a != b


def test_top_k_one_equals_greedy(engine):
    greedy = engine.generate(PROMPTS, GREEDY)
    top1 = engine.generate(PROMPTS, {"temperature": 1.3, "top_k": 1, "max_new_tokens": 32})
    assert [o.token_ids for o in top1] == [o.token_ids for o in greedy]


def test_stop_string_ends_generation_and_is_trimmed(engine):
    full = engine.generate(PROMPTS[1], GREEDY)
    # Pick a stop string from the middle of the greedy text.
    text = full.text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), "need a visible stop string"
    out = engine.generate(PROMPTS[1], {**GREEDY, "stop": [stop]})
    assert out.finish_reason == "stop"
    assert out.text == text[: text.index(stop)]
    assert stop not in out.text
    assert len(out.token_ids) < len(full.token_ids)


def test_stop_token_id_ends_generation(engine):
    full = engine.generate(PROMPTS[2], GREEDY).token_ids
    stop_id = full[10]
    out = engine.generate(PROMPTS[2], {**GREEDY, "stop_token_ids": [stop_id]})
    assert out.finish_reason == "stop"
    assert out.token_ids == full[: full.index(stop_id) + 1]


def test_min_new_tokens_suppresses_early_stop(engine):
    full = engine.generate(PROMPTS[2], GREEDY).token_ids
    stop_id = full[2]
    first = full.index(stop_id)
    out = engine.generate(PROMPTS[2], {**GREEDY, "stop_token_ids": [stop_id], "min_new_tokens": first + 5})
    assert len(out.token_ids) >= first + 5
    assert stop_id not in out.token_ids[: first + 4]


def test_max_new_tokens_is_respected_with_length_reason(engine):
    out = engine.generate(PROMPTS[0], {"temperature": 0.0, "max_new_tokens": 7})
    assert len(out.token_ids) == 7 and out.finish_reason == "length"


def _repeat_fraction(tokens: list[int]) -> float:
    counts = Counter(tokens)
    return sum(c - 1 for c in counts.values()) / len(tokens)


def test_frequency_and_repetition_penalties_reduce_repetition(engine):
    base = {"temperature": 1.0, "max_new_tokens": 48}
    plain = [engine.generate(p, {**base, "seed": i}).token_ids for i, p in enumerate(PROMPTS)]
    penal = [engine.generate(p, {**base, "seed": i, "frequency_penalty": 2.0, "repetition_penalty": 1.8}).token_ids
             for i, p in enumerate(PROMPTS)]
    assert sum(map(_repeat_fraction, penal)) < sum(map(_repeat_fraction, plain))


def test_negative_presence_penalty_increases_repetition(engine):
    base = {"temperature": 1.0, "max_new_tokens": 48}
    plain = [engine.generate(p, {**base, "seed": i}).token_ids for i, p in enumerate(PROMPTS)]
    sticky = [engine.generate(p, {**base, "seed": i, "presence_penalty": -2.0}).token_ids
              for i, p in enumerate(PROMPTS)]
    assert sum(map(_repeat_fraction, sticky)) > sum(map(_repeat_fraction, plain))


def test_logprobs_are_returned_for_each_token(engine):
    out = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 8, "logprobs": True, "top_logprobs": 3})
    lps = out.meta_info["output_token_logprobs"]  # SGLang's [logprob, token id, text] entries
    assert [t for _, t, _ in lps] == out.token_ids
    assert all(lp <= 0.0 and math.isfinite(lp) for lp, _, _ in lps)
    tops = out.meta_info["output_top_logprobs"]
    assert len(tops) == 8 and all(len(t) == 3 for t in tops)
    # Greedy: the chosen token is the top-1 alternative.
    assert [t[0][1] for t in tops] == out.token_ids


def test_streaming_yields_the_same_text_and_tokens(engine):
    full = engine.generate(PROMPTS[4], GREEDY)
    chunks = list(engine.generate_stream(PROMPTS[4], GREEDY))
    assert "".join(c.delta_text for c in chunks) == full.text
    assert [t for c in chunks for t in c.delta_token_ids] == full.token_ids
    assert chunks[-1].finish_reason == "length"
    assert chunks[-1].meta_info["completion_tokens"] == 32
