"""SamplingParams: validation rules, normalisation, from_dict and derived properties."""

from __future__ import annotations

import dataclasses
import math

import pytest

from plait.sampling import SamplingParams

# (field, bad value, fragment the message must contain besides the field name)
BAD_VALUES = [
    ("max_new_tokens", 0, ">= 1"),
    ("max_new_tokens", -5, ">= 1"),
    ("max_new_tokens", 1.5, "int"),
    ("max_new_tokens", True, "int"),
    ("min_new_tokens", -1, ">= 0"),
    ("min_new_tokens", "3", "int"),
    ("temperature", -0.1, ">= 0"),
    ("temperature", math.nan, "finite"),
    ("temperature", math.inf, "finite"),
    ("temperature", "hot", "number"),
    ("temperature", False, "number"),
    ("top_p", 0.0, "(0, 1]"),
    ("top_p", 1.5, "(0, 1]"),
    ("top_p", math.nan, "finite"),
    ("top_k", 0, "-1 (disabled) or >= 1"),
    ("top_k", -2, "-1 (disabled) or >= 1"),
    ("top_k", 2.0, "int"),
    ("top_k", True, "int"),
    ("min_p", -0.01, "[0, 1]"),
    ("min_p", 1.01, "[0, 1]"),
    ("repetition_penalty", 0.0, "> 0"),
    ("repetition_penalty", -1.0, "> 0"),
    ("repetition_penalty", math.inf, "finite"),
    ("frequency_penalty", 2.5, "[-2, 2]"),
    ("frequency_penalty", -2.5, "[-2, 2]"),
    ("presence_penalty", 2.01, "[-2, 2]"),
    ("presence_penalty", -math.inf, "finite"),
    ("seed", 1.0, "int"),
    ("seed", True, "int"),
    ("seed", 1 << 64, "64 bits"),
    ("stop", [""], "empty"),
    ("stop", 5, "str"),
    ("stop", ["ok", 3], "str"),
    ("stop_token_ids", [1, -1], ">= 0"),
    ("stop_token_ids", [1, True], "int"),
    ("stop_token_ids", 7, "list"),
    ("ignore_eos", 1, "bool"),
    ("logprobs", "yes", "bool"),
    ("skip_special_tokens", None, "bool"),
    ("top_logprobs", 21, "[0, 20]"),
    ("top_logprobs", -1, "[0, 20]"),
]


def test_defaults_are_valid_and_sample_with_temperature_one() -> None:
    p = SamplingParams()
    assert p.max_new_tokens == 128 and p.temperature == 1.0 and p.top_k == -1
    assert not p.is_greedy and not p.has_penalties


@pytest.mark.parametrize(("field", "value", "fragment"), BAD_VALUES, ids=[f"{f}={v!r}" for f, v, _ in BAD_VALUES])
def test_invalid_value_is_rejected_naming_field_and_limit(field: str, value: object, fragment: str) -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams(**{field: value})
    message = str(excinfo.value)
    assert field in message
    assert fragment in message


def test_top_p_message_has_interval_and_value() -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got 1\.5"):
        SamplingParams(top_p=1.5)


def test_min_new_tokens_above_max_new_tokens_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"min_new_tokens must be <= max_new_tokens \(4\), got 5"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5)


def test_min_new_tokens_equal_to_max_new_tokens_is_accepted() -> None:
    assert SamplingParams(max_new_tokens=4, min_new_tokens=4).min_new_tokens == 4


def test_boundary_values_are_accepted() -> None:
    p = SamplingParams(
        temperature=0.0,
        top_p=1.0,
        top_k=1,
        min_p=1.0,
        repetition_penalty=1e-3,
        frequency_penalty=-2.0,
        presence_penalty=2.0,
        top_logprobs=20,
        seed=-(1 << 63),
    )
    assert p.top_logprobs == 20 and p.seed == -(1 << 63)


def test_int_floats_are_normalised_to_float() -> None:
    p = SamplingParams(temperature=1, top_p=1, repetition_penalty=2)
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)
    assert isinstance(p.repetition_penalty, float)


def test_stop_string_and_list_are_normalised_to_tuple() -> None:
    assert SamplingParams(stop="</s>").stop == ("</s>",)
    assert SamplingParams(stop=["a", "b"]).stop == ("a", "b")
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)


def test_params_are_frozen_and_hashable() -> None:
    p = SamplingParams(stop=["x"], stop_token_ids=[1])
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.temperature = 0.5  # type: ignore[misc]
    assert hash(p) == hash(SamplingParams(stop=("x",), stop_token_ids=(1,)))


def test_replace_revalidates() -> None:
    with pytest.raises(ValueError, match="top_k"):
        dataclasses.replace(SamplingParams(), top_k=0)


def test_from_dict_builds_and_normalises() -> None:
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": "END", "stop_token_ids": [2], "seed": 7})
    assert p == SamplingParams(temperature=0.5, stop=("END",), stop_token_ids=(2,), seed=7)


def test_from_dict_none_means_default() -> None:
    p = SamplingParams.from_dict({"temperature": None, "stop": None, "seed": None})
    assert p == SamplingParams()


def test_from_dict_unknown_key_lists_it_and_accepted_keys() -> None:
    with pytest.raises(ValueError) as excinfo:
        SamplingParams.from_dict({"top-p": 0.5, "temperature": 0.3})
    message = str(excinfo.value)
    assert "'top-p'" in message
    assert "accepted keys" in message
    for name in ("max_new_tokens", "top_p", "stop_token_ids", "skip_special_tokens"):
        assert name in message


def test_from_dict_invalid_value_still_names_field() -> None:
    with pytest.raises(ValueError, match="min_p"):
        SamplingParams.from_dict({"min_p": 2})


def test_from_dict_rejects_non_mapping() -> None:
    with pytest.raises(ValueError, match="mapping"):
        SamplingParams.from_dict([("temperature", 1.0)])  # type: ignore[arg-type]


def test_to_dict_round_trips_through_from_dict() -> None:
    p = SamplingParams(temperature=0.3, top_k=5, stop=("a",), logprobs=True, top_logprobs=2)
    assert SamplingParams.from_dict(p.to_dict()) == p


@pytest.mark.parametrize(
    ("kwargs", "greedy"),
    [
        ({"temperature": 0.0}, True),
        ({"top_k": 1}, True),
        ({"temperature": 0.0, "top_k": 50}, True),
        ({"temperature": 0.7}, False),
        ({"top_k": 2}, False),
    ],
)
def test_is_greedy_means_temperature_zero_or_top_k_one(kwargs: dict, greedy: bool) -> None:
    assert SamplingParams(**kwargs).is_greedy is greedy


@pytest.mark.parametrize(
    ("kwargs", "penalised"),
    [
        ({}, False),
        ({"repetition_penalty": 1.1}, True),
        ({"frequency_penalty": -0.5}, True),
        ({"presence_penalty": 0.2}, True),
        ({"temperature": 0.0, "top_p": 0.5}, False),
    ],
)
def test_has_penalties_is_true_when_any_penalty_is_active(kwargs: dict, penalised: bool) -> None:
    assert SamplingParams(**kwargs).has_penalties is penalised


def test_validate_against_accepts_ids_inside_vocab() -> None:
    SamplingParams(stop_token_ids=(0, 99)).validate_against(100)


def test_validate_against_rejects_stop_token_id_outside_vocab() -> None:
    with pytest.raises(ValueError, match=r"stop_token_ids must be in \[0, 100\), got 100"):
        SamplingParams(stop_token_ids=(5, 100)).validate_against(100)


def test_validate_against_rejects_bad_vocab_size() -> None:
    with pytest.raises(ValueError, match="vocab_size"):
        SamplingParams().validate_against(0)
