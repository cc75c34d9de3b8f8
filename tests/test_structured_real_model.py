"""Constrained decoding on the real trained model (SmolLM2-135M-Instruct, float32): for 30 JSON
schemas, 10 regexes and 5 EBNF grammars, greedy and sampled, every output is complete
(finish_reason "stop") and valid (jsonschema with format checks, re.fullmatch). All 90 requests run
in one batch of one engine, once per test session."""

from __future__ import annotations

import json
import pathlib
import re
from typing import NamedTuple

import jsonschema
import pytest

import plait
from plait.bench.grammars import EBNF_GRAMMARS, JSON_SCHEMAS, REGEXES

MAX_NEW = 64
SAMPLED = {"temperature": 0.7, "top_p": 0.9}


def _cases() -> list[tuple[str, dict, str]]:
    """(case id, grammar field, instruction), one per grammar."""
    cases = [(f"schema-{name}", {"json_schema": schema}, f"Give an example of a {name.replace('_', ' ')} as JSON.")
             for name, schema in JSON_SCHEMAS]
    cases += [(f"regex-{i}", {"regex": rx}, "Give an example answer.") for i, (rx, _) in enumerate(REGEXES)]
    cases += [(f"ebnf-{i}", {"ebnf": g}, "Give an example answer.") for i, (g, _) in enumerate(EBNF_GRAMMARS)]
    return cases


CASES = _cases()


def _check(case_id: str, text: str) -> None:
    kind, _, rest = case_id.partition("-")
    if kind == "schema":
        schema = dict(JSON_SCHEMAS)[rest]
        jsonschema.validate(json.loads(text), schema, format_checker=jsonschema.FormatChecker())
    elif kind == "regex":
        assert re.fullmatch(REGEXES[int(rest)][1], text), text
    else:
        assert re.fullmatch(EBNF_GRAMMARS[int(rest)][1], text), text


class Result(NamedTuple):
    text: str
    finish_reason: str
    finish_message: str | None


def _run_batch(real_model_dir: pathlib.Path) -> dict[str, Result]:
    """Every (case, mode) request in one batch of one engine: ``"case|mode"`` -> what the tests read."""
    with plait.Engine(model=str(real_model_dir), dtype="float32", device="cpu", max_total_tokens=32768,
                      max_running_requests=128) as engine:
        tok = engine.tokenizer
        prompts, params, keys = [], [], []
        for case_id, grammar, instruction in CASES:
            prompt = tok.apply_chat_template([{"role": "user", "content": instruction}], tokenize=False,
                                             add_generation_prompt=True)
            for mode, extra in (("greedy", {"temperature": 0.0}), ("sampled", {**SAMPLED, "seed": len(keys)})):
                prompts.append(prompt)
                params.append({"max_new_tokens": MAX_NEW, **grammar, **extra})
                keys.append(f"{case_id}|{mode}")
        outs = engine.generate(prompts, params)
        assert engine.scheduler.stats.grammar_compiles == len(CASES)
        return {key: Result(o.text, o.finish_reason, o.meta_info.get("finish_message"))
                for key, o in zip(keys, outs, strict=True)}


@pytest.fixture(scope="module")
def outputs(real_model_dir: pathlib.Path) -> dict[str, Result]:
    """The batch's results (the suite runs with ``--dist loadscope``: the module's tests share one
    worker, so the batch runs once per session)."""
    return _run_batch(real_model_dir)


def test_corpus_has_30_schemas_10_regexes_5_ebnf() -> None:
    assert (len(JSON_SCHEMAS), len(REGEXES), len(EBNF_GRAMMARS)) == (30, 10, 5)


@pytest.mark.parametrize("mode", ["greedy", "sampled"])
@pytest.mark.parametrize("case_id", [c[0] for c in CASES])
def test_output_is_complete_and_valid(outputs, case_id: str, mode: str) -> None:
    out = outputs[f"{case_id}|{mode}"]
    assert out.finish_reason == "stop", (out.text, out.finish_message)
    _check(case_id, out.text)
