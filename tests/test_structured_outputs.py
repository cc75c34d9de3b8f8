"""Constrained decoding on tiny random models (float32, CPU): greedy output equals transformers'
greedy with xgrammar's own logits processor, a length cut is a grammar-valid prefix, constrained and
unconstrained requests share a batch, and every scheduling path (overlap, radix hits, chunked
prefill, retraction, decode graphs, n-gram speculation) gives the same constrained greedy output.
Bad grammars fail with a ValueError before anything is scheduled."""

from __future__ import annotations

import json
import math
import pathlib
from concurrent.futures import Future

import pytest
import torch
import xgrammar as xgr

import plait
from plait.sampling import SamplingParams
from plait.sampling.grammar import MAX_JSON_SCHEMA_DEPTH
from plait.scheduler.req import Req
from tests.helpers import assert_no_leaks, make_engine, prompt_ids

SCHEMA = {"type": "object", "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 999},
                                           "tag": {"enum": ["ab", "cd"]}},
          "required": ["id", "tag"], "additionalProperties": False}
GRAMMARS: list[dict[str, str | dict]] = [
    {"json_schema": SCHEMA},
    {"regex": r"[a-z]{2,6}@[a-z]{2,6}\.(com|org)"},
    {"ebnf": 'root ::= item (", " item)*\nitem ::= "x" [0-9]+ | "y"'},
    {"json_schema": json.dumps({"type": "array", "items": {"type": "boolean"}})},
]
PROMPTS = prompt_ids(8, seed=5)
N = 12


def _params(i: int, **extra) -> dict:
    """Prompt i's request: grammar i % 4 on even prompts, unconstrained on odd ones."""
    base = {"temperature": 0.0, "max_new_tokens": N, **extra}
    return {**base, **GRAMMARS[(i // 2) % len(GRAMMARS)]} if i % 2 == 0 else base


@pytest.fixture(scope="module")
def path(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def engine(path) -> plait.Engine:
    return make_engine(path, dtype="float32")


@pytest.fixture(scope="module")
def reference(engine) -> list[list[int]]:
    """Constrained greedy tokens of the plain engine (overlap on, radix cache on, no speculation)."""
    outs = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    return [o.token_ids for o in outs]


def _compiled(engine: plait.Engine, params: dict) -> xgr.CompiledGrammar:
    backend = engine.scheduler.grammar_backend
    key = SamplingParams.from_dict(params).grammar
    assert backend is not None and key is not None
    return backend.compile(key)


def _walk(compiled: xgr.CompiledGrammar, tokens: list[int]) -> xgr.GrammarMatcher:
    """A fresh matcher fed ``tokens``; asserts each one is allowed."""
    m = xgr.GrammarMatcher(compiled)
    for i, t in enumerate(tokens):
        assert m.accept_token(t), f"token {i} ({t}) breaks the grammar"
    return m


def test_greedy_equals_transformers_with_xgrammar_logits_processor(engine, path, reference):
    from xgrammar.contrib.hf import LogitsProcessor

    from tests.conftest import hf_model

    hf = hf_model(path)
    for i in range(0, len(PROMPTS), 2):
        params = _params(i)
        proc = LogitsProcessor(_compiled(engine, params))
        ids = torch.tensor([PROMPTS[i]])
        with torch.no_grad():
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=N, do_sample=False,
                              logits_processor=[proc], pad_token_id=0)
        ref = out[0, ids.shape[1]:].tolist()
        assert reference[i] == ref, f"prompt {i} {params}"


def test_length_cut_is_a_grammar_valid_prefix_with_finish_reason_length(engine):
    params = {"temperature": 0.0, "max_new_tokens": 6, "json_schema": SCHEMA}
    out = engine.generate(PROMPTS[0], params)
    assert out.finish_reason == "length" and len(out.token_ids) == 6
    m = _walk(_compiled(engine, params), out.token_ids)
    assert not m.is_terminated()
    assert_no_leaks(engine)


def test_grammar_that_completes_stops_with_finish_reason_stop(engine):
    # The tiny model keeps going where a grammar allows it; this one allows nothing after "yes" but EOS.
    out = engine.generate(PROMPTS[1], {"temperature": 0.0, "max_new_tokens": 8, "ebnf": 'root ::= "yes"'})
    assert out.finish_reason == "stop"
    assert out.text == "yes"
    assert out.token_ids[-1] in engine.model_config.eos_token_ids


def test_32_constrained_and_32_unconstrained_requests_in_one_batch(engine):
    prompts = prompt_ids(16, seed=9) * 4
    params = [{"temperature": 0.0, "max_new_tokens": 6, **GRAMMARS[(i // 2) % 4]} if i % 2 == 0
              else {"temperature": 0.0, "max_new_tokens": 6} for i in range(64)]
    batched = engine.generate(prompts, params)
    alone = engine.generate(prompts[1::2], params[1::2])  # the unconstrained ones without the others
    for i, out in enumerate(batched):
        if i % 2 == 0:
            _walk(_compiled(engine, params[i]), out.token_ids)
        else:
            assert out.token_ids == alone[i // 2].token_ids
    # The unconstrained rows are free: they leave the grammars' tokens behind somewhere.
    assert any(not _accepts_all(_compiled(engine, GRAMMARS[0]), o.token_ids) for o in batched[1::2])
    assert_no_leaks(engine)


def _accepts_all(compiled: xgr.CompiledGrammar, tokens: list[int]) -> bool:
    m = xgr.GrammarMatcher(compiled)
    return all(m.accept_token(t) for t in tokens)


SCHED_PATHS = {
    "overlap_off": {"disable_overlap_schedule": True},
    "chunked_prefill": {"chunked_prefill_size": 8},
    "ngram_chain": {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1},
    "ngram_tree": {"speculative_algorithm": "NGRAM", "speculative_ngram_min_match_window_size": 1,
                   "speculative_eagle_topk": 2, "speculative_num_draft_tokens": 6},
}


@pytest.mark.parametrize("case", sorted(SCHED_PATHS))
def test_constrained_greedy_is_identical_on_every_scheduling_path(path, reference, case, monkeypatch):
    if case.startswith("ngram"):
        monkeypatch.setenv("PLAIT_CHECK_PLANS", "1")
    engine = make_engine(path, dtype="float32", **SCHED_PATHS[case])
    spec = engine.scheduler.spec_worker
    if spec is not None:
        # Seed the n-gram cache with the answers, half of them corrupted: drafts are accepted and
        # rejected, some against the grammar.
        for i, (p, ref) in enumerate(zip(PROMPTS, reference, strict=True)):
            spec.drafter.cache.insert(p + (ref if i % 4 < 2 else [(t + 1) % 400 + 4 for t in ref]))
    outs = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])
    assert [o.token_ids for o in outs] == reference
    if spec is not None:
        assert spec.stats.verify_steps > 0 and max(spec.stats.accept_histogram) >= 2
    assert_no_leaks(engine)


def test_retraction_keeps_constrained_greedy(engine, path):
    # Grammars that may always go on, and min_new_tokens holding EOS back, keep every request decoding
    # for 20 tokens: 120 KV slots cannot hold them all.
    grammars = [GRAMMARS[2], {"regex": "[a-z0-9 ]+"}]
    params = [{"temperature": 0.0, "max_new_tokens": 20, "min_new_tokens": 20, **grammars[i % 2]}
              for i in range(len(PROMPTS))]
    reference = [o.token_ids for o in engine.generate(PROMPTS, params)]
    small = make_engine(path, dtype="float32", max_total_tokens=120, disable_radix_cache=True)
    outs = small.generate(PROMPTS, params)
    assert small.scheduler.stats.num_retractions >= 1
    assert [o.token_ids for o in outs] == reference
    assert_no_leaks(small)


def test_radix_cache_hits_keep_constrained_greedy(engine, reference):
    outs = engine.generate(PROMPTS, [_params(i) for i in range(len(PROMPTS))])  # prompts cached by reference
    assert [o.token_ids for o in outs] == reference
    assert all(o.meta_info["cached_tokens"] > 0 for o in outs)
    assert_no_leaks(engine)


def test_decode_graphs_keep_constrained_greedy(one_layer, monkeypatch):
    # The mask is applied by the sampler, outside the captured forward (EagerGraph stand-in, Triton
    # attention in the interpreter).
    pytest.importorskip("triton")
    params = [{"temperature": 0.0, "max_new_tokens": 4, **GRAMMARS[0]}]
    prompts = [PROMPTS[0][:4]]
    eager = make_engine(one_layer, dtype="float32", attention_backend="triton", max_total_tokens=512)
    expected = [o.token_ids for o in eager.generate(prompts, params)]
    monkeypatch.setenv("PLAIT_CPU_GRAPHS", "1")
    graphs = make_engine(one_layer, dtype="float32", attention_backend="triton", max_total_tokens=512,
                         cuda_graph_max_bs=1)
    runner = graphs.runner.graph_runner
    assert runner is not None
    assert [o.token_ids for o in graphs.generate(prompts, params)] == expected
    assert sum(g.replays for g in runner.graphs.values()) > 0


def test_sampled_requests_with_penalties_and_logprobs_obey_their_grammar(engine):
    params = [{**g, "temperature": 0.9, "top_p": 0.95, "seed": 7 + i, "max_new_tokens": 12,
               "repetition_penalty": 1.2, "frequency_penalty": 0.5, "logprobs": True, "top_logprobs": 3}
              for i, g in enumerate(GRAMMARS)]
    outs = engine.generate(PROMPTS[:4], params)
    for p, out in zip(params, outs, strict=True):
        _walk(_compiled(engine, p), out.token_ids)
        logprobs = [entry[0] for entry in out.meta_info["output_token_logprobs"]]
        assert len(logprobs) == len(out.token_ids) and all(math.isfinite(lp) and lp <= 0 for lp in logprobs)
    # Seeded: the same requests give the same tokens again.
    assert [o.token_ids for o in engine.generate(PROMPTS[:4], params)] == [o.token_ids for o in outs]


def test_compiled_grammars_are_cached_by_key(engine):
    stats = engine.scheduler.stats
    before_compiles, before_hits = stats.grammar_compiles, stats.grammar_cache_hits
    engine.generate(PROMPTS[:2], [{"max_new_tokens": 2, "regex": "[0-9]{4}z"}] * 2)
    stats = engine.scheduler.stats
    assert stats.grammar_compiles == before_compiles + 1
    assert stats.grammar_cache_hits == before_hits + 1
    assert sum(stats.grammar_compile_seconds.counts) == stats.grammar_compiles
    assert stats.grammar_compile_seconds_sum > 0


def test_request_waits_for_its_grammar_while_others_are_scheduled(engine):
    sched = engine.scheduler
    slow: Req = engine.make_request(PROMPTS[0], {"max_new_tokens": 4, "regex": "q[0-9]{3}"})
    fast: Req = engine.make_request(PROMPTS[1], {"max_new_tokens": 4, "temperature": 0.0})
    # Hold the request's compile back: the future it waits on is not done until released.
    pending: Future = Future()
    sched.add_request(slow)
    assert slow.grammar_future is not None
    slow.grammar_future, real = pending, slow.grammar_future
    sched.add_request(fast)
    for _ in range(3):
        sched.step()
    assert fast.output_ids and not slow.output_ids and slow in sched.waiting
    pending.set_result(real.result())
    while not (slow.finished and fast.finished):
        sched.step()
    sched.flush()
    assert slow.detokenizer.final_text().startswith("q")
    assert_no_leaks(engine)


@pytest.mark.parametrize(("params", "field", "message"), [
    ({"regex": "(ab"}, "regex", "parenthesis"),
    ({"ebnf": "root ::= missing"}, "ebnf", "not defined"),
    ({"json_schema": {"type": "frobnicate"}}, "json_schema", "frobnicate"),
    ({"json_schema": "{not json"}, "json_schema", "not valid JSON"),
    ({"structural_tag": '{"type": "structural_tag", "format": {"type": "bogus"}}'}, "structural_tag", "bogus"),
    ({"regex": "a", "ebnf": 'root ::= "a"'}, "regex", "regex is set with ebnf: at most one of"),
], ids=["regex", "ebnf", "schema_type", "schema_json", "structural_tag", "two_fields"])
def test_bad_grammar_raises_value_error_before_scheduling(engine, params, field, message):
    with pytest.raises(ValueError, match=field) as err:
        engine.generate(PROMPTS[0], {"max_new_tokens": 4, **params})
    assert message in str(err.value)
    assert not engine.scheduler.has_work()
    assert engine.generate(PROMPTS[0], {"max_new_tokens": 2}).finish_reason == "length"


def test_schema_too_deep_to_compile_is_refused(engine):
    schema: dict = {"type": "integer"}
    for _ in range(MAX_JSON_SCHEMA_DEPTH):
        schema = {"type": "object", "properties": {"a": schema}, "required": ["a"]}
    with pytest.raises(ValueError, match=f"json_schema is too deep to compile.*limit of {MAX_JSON_SCHEMA_DEPTH}"):
        engine.generate(PROMPTS[0], {"max_new_tokens": 4, "json_schema": schema})
    assert not engine.scheduler.has_work()


def test_padding_beyond_the_tokenizer_is_never_allowed(engine):
    vocab = engine.model_config.vocab_size
    assert vocab > len(engine.tokenizer)  # the tiny model pads its vocabulary
    backend = engine.scheduler.grammar_backend
    m = backend.new_matcher(backend.compile(("regex", ".*")))
    mask = backend.fill_vocab_mask([m])
    logits = torch.zeros(1, vocab)
    from plait.sampling.grammar import apply_vocab_mask

    apply_vocab_mask(logits, mask)
    assert torch.isinf(logits[0, len(engine.tokenizer):]).all()
    assert torch.isfinite(logits[0, : len(engine.tokenizer)]).sum() > len(engine.tokenizer) // 2
