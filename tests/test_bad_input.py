"""Bad input: ValueError naming the field and the limit, raised before anything is scheduled; the
engine keeps serving and a good request submitted alongside still completes."""

from __future__ import annotations

import pytest

from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

GOOD = prompt_ids(1)[0]


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    return make_engine(tiny_model_dir("llama"), context_length=256)


BAD_PARAMS = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"temperature": -0.5}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_k": 0}, "top_k"),
    ({"top_k": -2}, "top_k"),
    ({"min_p": -0.1}, "min_p"),
    ({"min_p": 1.1}, "min_p"),
    ({"repetition_penalty": 0.0}, "repetition_penalty"),
    ({"frequency_penalty": 3.0}, "frequency_penalty"),
    ({"presence_penalty": -2.5}, "presence_penalty"),
    ({"min_new_tokens": 40, "max_new_tokens": 10}, "min_new_tokens"),
    ({"stop_token_ids": [10**9]}, "stop_token_ids"),
    ({"temprature": 0.5}, "temprature"),
]


@pytest.mark.parametrize(("params", "field"), BAD_PARAMS, ids=[f for _, f in BAD_PARAMS])
def test_bad_sampling_parameter_names_the_field(engine, params, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(GOOD, params)
    assert not engine.scheduler.has_work()


def test_empty_text_prompt_is_rejected(engine):
    with pytest.raises(ValueError, match="prompt"):
        engine.generate("", GREEDY)


def test_empty_token_prompt_is_rejected(engine):
    with pytest.raises(ValueError, match="prompt"):
        engine.generate([[]], GREEDY)


def test_token_ids_outside_the_vocabulary_are_rejected(engine):
    vocab = engine.model_config.vocab_size
    with pytest.raises(ValueError, match=rf"input_ids must be in \[0, {vocab}\)"):
        engine.generate([1, 2, vocab], GREEDY)
    with pytest.raises(ValueError, match="input_ids"):
        engine.generate([1, -1, 3], GREEDY)


def test_prompt_plus_max_new_tokens_over_context_is_rejected(engine):
    with pytest.raises(ValueError, match=r"max_new_tokens .*exceeds the limit of 256"):
        engine.generate(GOOD, {"max_new_tokens": 256 - len(GOOD) + 1})


def test_one_bad_prompt_in_a_batch_schedules_nothing(engine):
    with pytest.raises(ValueError, match="top_p"):
        engine.generate([GOOD, GOOD], [GREEDY, {"top_p": 2.0}])
    assert not engine.scheduler.has_work()
    assert_no_leaks(engine)


def test_bad_request_while_another_is_in_flight_leaves_it_intact(engine, hf_reference, tiny_model_dir):
    ref = hf_reference(tiny_model_dir("llama"), GOOD, 32).tokens
    good = engine.make_request(GOOD, GREEDY)
    engine.scheduler.add_request(good)
    engine.scheduler.step()
    for params, _ in BAD_PARAMS:
        with pytest.raises(ValueError):
            engine.make_request(GOOD, params)
    with pytest.raises(ValueError):
        engine.make_request([engine.model_config.vocab_size + 5], GREEDY)
    while not good.finished:
        engine.scheduler.step()
    assert good.output_ids == ref
    assert_no_leaks(engine)


def test_engine_keeps_serving_after_bad_input(engine):
    with pytest.raises(ValueError):
        engine.generate(GOOD, {"top_k": 0})
    out = engine.generate(GOOD, GREEDY)
    assert out.finish_reason == "length" and len(out.token_ids) == 32


def test_unknown_engine_option_is_rejected(tiny_model_dir):
    with pytest.raises(ValueError, match="max_tokens_total"):
        make_engine(tiny_model_dir("llama"), max_tokens_total=10)


def test_invalid_engine_option_names_field_and_limit(tiny_model_dir):
    with pytest.raises(ValueError, match=r"mem_fraction_static must be in \(0, 1\)"):
        make_engine(tiny_model_dir("llama"), mem_fraction_static=1.5)
