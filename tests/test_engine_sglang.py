"""The offline Engine as SGLang users call it: model_path=, generate(stream=True), dict-readable
outputs, prompt-token logprobs (logprob_start_len) against transformers, logit_bias, sampling
defaults from generation_config.json, leaving a stream early, and Engine.load()."""

from __future__ import annotations

import dataclasses
import json
import pathlib
import shutil

import pytest
import torch

import plait
from plait.config import EngineConfig
from plait.engine.generation_config import sampling_defaults
from plait.engine.outputs import EngineLoad
from plait.sampling.params import SamplingParams
from tests.conftest import hf_model
from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(4, seed=11)


@pytest.fixture(scope="module")
def engine(one_layer):
    # A small prefill budget: a 31-token prompt is scored over several chunks.
    eng = make_engine(one_layer, chunked_prefill_size=8)
    yield eng
    eng.shutdown()


def hf_prompt_logprobs(path: pathlib.Path, ids: list[int]) -> list[float]:
    """log p(ids[q + 1] | ids[: q + 1]) for every prompt position q, by transformers (fp32)."""
    with torch.no_grad():
        logits = hf_model(path)(torch.tensor([ids])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [logp[q, ids[q + 1]].item() for q in range(len(ids) - 1)]


# --- prompt-token logprobs ------------------------------------------------------------------------
def test_prompt_logprobs_from_zero_match_transformers_over_chunks(engine, one_layer):
    ids = prompt_ids(7, seed=3)[6]  # 31 tokens: four prefill chunks of at most 8
    out = engine.generate(ids, {**GREEDY, "max_new_tokens": 2}, return_logprob=True, logprob_start_len=0)
    entries = out["meta_info"]["input_token_logprobs"]
    assert [tid for _, tid, _ in entries] == ids
    assert entries[0][0] is None  # the first prompt token follows nothing
    got = torch.tensor([lp for lp, _, _ in entries[1:]])
    torch.testing.assert_close(got, torch.tensor(hf_prompt_logprobs(one_layer, ids)), atol=1e-4, rtol=0)
    assert_no_leaks(engine)


def test_prompt_logprobs_from_a_start_skip_the_cache_only_before_it(engine, one_layer):
    ids = PROMPTS[2]  # 12 tokens
    engine.generate(ids, {**GREEDY, "max_new_tokens": 2})  # the whole prompt is now in the prefix cache
    out = engine.generate(ids, {**GREEDY, "max_new_tokens": 2, "logprobs": True, "logprob_start_len": 5,
                                "top_logprobs": 3})
    meta = out.meta_info
    # Position 4 scores token 5, so positions 0..3 may come from the cache and no more.
    assert meta["cached_tokens"] == 4
    assert [tid for _, tid, _ in meta["input_token_logprobs"]] == ids[5:]
    got = torch.tensor([lp for lp, _, _ in meta["input_token_logprobs"]])
    torch.testing.assert_close(got, torch.tensor(hf_prompt_logprobs(one_layer, ids)[4:]), atol=1e-4, rtol=0)
    tops = meta["input_top_logprobs"]
    assert len(tops) == len(ids) - 5 and all(len(t) == 3 for t in tops)
    assert all(t[0][0] >= lp for t, (lp, _, _) in zip(tops, meta["input_token_logprobs"], strict=True))
    assert_no_leaks(engine)


def test_prompt_logprobs_are_off_by_default(engine):
    out = engine.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 3, "logprobs": True})
    assert out.meta_info["input_token_logprobs"] == []
    assert len(out.meta_info["output_token_logprobs"]) == 3


def test_logprob_start_len_past_the_prompt_is_refused(engine):
    with pytest.raises(ValueError, match=r"logprob_start_len \(3\) must be < the prompt length \(3 tokens\)"):
        engine.generate(PROMPTS[0], {**GREEDY, "logprobs": True, "logprob_start_len": 3})
    assert_no_leaks(engine)


# --- logit_bias -----------------------------------------------------------------------------------
def test_logit_bias_forces_a_token(engine):
    forced = 77
    out = engine.generate(PROMPTS[1], {"temperature": 0.8, "seed": 1, "max_new_tokens": 6, "ignore_eos": True,
                                       "logit_bias": {str(forced): 100}})
    assert out.token_ids == [forced] * 6


def test_logit_bias_bans_the_greedy_token(engine):
    greedy = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 1}).token_ids[0]
    banned = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 1, "logit_bias": {greedy: -100}})
    assert banned.token_ids[0] != greedy


def test_logit_bias_applies_per_request_in_a_batch(engine):
    outs = engine.generate(PROMPTS[:2], [{**GREEDY, "max_new_tokens": 4, "ignore_eos": True, "logit_bias": {"9": 100}},
                                         {**GREEDY, "max_new_tokens": 4, "ignore_eos": True}])
    alone = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 4, "ignore_eos": True})
    assert outs[0].token_ids == [9] * 4
    assert outs[1].token_ids == alone.token_ids


@pytest.mark.parametrize(("bias", "message"), [
    ({"600": 1.0}, r"logit_bias keys must be token ids in \[0, 512\)"),
    ({"5": 100.5}, r"logit_bias values must be in \[-100, 100\], got 100.5 for token 5"),
    ({"x": 1.0}, r"logit_bias keys must be token ids \(integers\), got 'x'"),
    ({"-1": 1.0}, r"logit_bias keys must be token ids >= 0"),
])
def test_bad_logit_bias_is_refused_naming_the_limit(engine, bias, message):
    with pytest.raises(ValueError, match=message):
        engine.generate(PROMPTS[0], {"logit_bias": bias})
    assert_no_leaks(engine)


# --- the SGLang-style Engine API -----------------------------------------------------------------
def test_model_path_is_accepted_and_outputs_read_as_dicts(one_layer):
    with plait.Engine(model_path=str(one_layer), device="cpu", max_total_tokens=1024) as eng:
        out = eng.generate(PROMPTS[0], {**GREEDY, "max_new_tokens": 3, "ignore_eos": True})
        assert out["text"] == out.text and out["output_ids"] == out.token_ids
        assert set(out) == {"text", "output_ids", "meta_info"}
        meta = out["meta_info"]
        assert meta["finish_reason"] == {"type": "length", "length": 3}
        assert meta["id"] == out.rid and meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 3
        assert meta["e2e_latency"] > 0


def test_generate_takes_sglangs_keywords(engine):
    params = {**GREEDY, "max_new_tokens": 3}
    by_ids = engine.generate(input_ids=PROMPTS[0], sampling_params=params)
    assert engine.generate(prompt=PROMPTS[0], sampling_params=params).token_ids == by_ids.token_ids
    batch = engine.generate(input_ids=PROMPTS[:2], sampling_params=params, return_logprob=True, top_logprobs_num=1)
    assert batch[0].token_ids == by_ids.token_ids
    assert all(len(o["meta_info"]["output_top_logprobs"][0]) == 1 for o in batch)
    with pytest.raises(ValueError, match="pass exactly one of prompt .* and input_ids"):
        engine.generate(PROMPTS[0], input_ids=PROMPTS[0])


def test_model_and_model_path_must_agree(one_layer):
    with pytest.raises(ValueError, match="model .* and model_path .* name the same setting"):
        plait.Engine(model=str(one_layer), model_path="/elsewhere", device="cpu")


def test_stop_finish_reason_names_what_matched(engine):
    first = engine.generate(PROMPTS[3], {**GREEDY, "max_new_tokens": 3}).token_ids
    by_token = engine.generate(PROMPTS[3], {**GREEDY, "max_new_tokens": 8, "stop_token_ids": [first[1]]})
    assert by_token["meta_info"]["finish_reason"] == {"type": "stop", "matched": first[1]}
    text = engine.generate(PROMPTS[3], {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}).text
    stop = text[2:4]
    by_string = engine.generate(PROMPTS[3], {**GREEDY, "max_new_tokens": 8, "stop": ["never-there", stop]})
    assert by_string["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}


def test_generate_with_stream_true_returns_an_iterator_of_cumulative_chunks(engine):
    params = {**GREEDY, "max_new_tokens": 6, "ignore_eos": True}
    whole = engine.generate(PROMPTS[2], params)
    chunks = list(engine.generate(PROMPTS[2], params, stream=True))
    assert "".join(c.delta_text for c in chunks) == whole.text
    assert chunks[-1]["text"] == whole.text and chunks[-1]["output_ids"] == whole.token_ids
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    texts = [c["text"] for c in chunks]
    assert all(b.startswith(a) for a, b in zip(texts, texts[1:], strict=False))  # cumulative


def test_stream_true_takes_one_prompt(engine):
    with pytest.raises(ValueError, match="stream=True takes one prompt, got 2"):
        engine.generate(PROMPTS[:2], GREEDY, stream=True)


# --- leaving a stream early -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def no_cache_engine(one_layer):
    # Without the prefix cache a finished request's KV goes straight back to the free list, so the
    # allocator's free count is exact.
    eng = make_engine(one_layer, max_total_tokens=2048, disable_radix_cache=True)
    yield eng
    eng.shutdown()


def _free(eng: plait.Engine) -> int:
    return eng.runner.allocator.available_size()


@pytest.mark.parametrize("leave", ["break", "close"])
def test_leaving_generate_stream_aborts_and_frees_the_kv(no_cache_engine, leave):
    eng = no_cache_engine
    free_before, made_before = _free(eng), eng.scheduler.stats.generation_tokens
    stream = eng.generate_stream(PROMPTS[1], {**GREEDY, "max_new_tokens": 400, "ignore_eos": True})
    for i, _ in enumerate(stream):
        if i == 2:
            assert _free(eng) < free_before
            if leave == "break":
                break
            stream.close()
    if leave == "break":
        del stream  # the consumer dropped it: the generator closes
    assert _free(eng) == free_before
    assert not eng.scheduler.has_work()
    # It stopped where the consumer left, not at max_new_tokens.
    assert eng.scheduler.stats.generation_tokens - made_before < 10
    assert_no_leaks(eng)


def test_load_reports_running_waiting_and_kv_in_use(no_cache_engine):
    eng = no_cache_engine
    idle = eng.load()
    assert idle == EngineLoad(0, 0, 0, eng.runner.total_kv_tokens)
    with pytest.raises(dataclasses.FrozenInstanceError):
        idle.num_running = 1  # type: ignore[misc]
    stream = eng.generate_stream(PROMPTS[2], {**GREEDY, "max_new_tokens": 50, "ignore_eos": True})
    next(stream)
    busy = eng.load()
    assert busy.num_running == 1 and busy.num_waiting == 0
    assert len(PROMPTS[2]) <= busy.kv_tokens_in_use <= len(PROMPTS[2]) + 4
    assert 0 < busy.token_usage < 1
    stream.close()
    assert eng.load() == idle


# --- sampling defaults from generation_config.json ----------------------------------------------
@pytest.fixture(scope="module")
def model_with_defaults(one_layer, tmp_path_factory) -> pathlib.Path:
    """The one-layer model whose generation_config.json asks for top_k 1 (greedy under any
    temperature) and a mild repetition penalty it reports back."""
    d = tmp_path_factory.mktemp("gen_defaults")
    for f in one_layer.iterdir():
        shutil.copy(f, d / f.name)
    gen = json.loads((d / "generation_config.json").read_text())
    gen.update(top_k=1, temperature=0.7, top_p=0.9, do_sample=True)
    (d / "generation_config.json").write_text(json.dumps(gen))
    return d


SAMPLED = {"seed": 5, "max_new_tokens": 8, "ignore_eos": True}  # temperature unset: 1.0 in plait


def test_generation_config_defaults_apply_when_a_request_omits_them(model_with_defaults, engine):
    greedy = engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 8, "ignore_eos": True}).token_ids
    plain = engine.generate(PROMPTS[1], SAMPLED).token_ids
    assert plain != greedy  # without defaults this request samples
    with make_engine(model_with_defaults, max_total_tokens=1024) as eng:
        assert eng.frontend.sampling_defaults == {"temperature": 0.7, "top_p": 0.9, "top_k": 1}
        assert eng.generate(PROMPTS[1], SAMPLED).token_ids == greedy  # top_k 1 from the file
        # The request's own value wins.
        assert eng.generate(PROMPTS[1], {**SAMPLED, "top_k": -1, "temperature": 1.0, "top_p": 1.0}
                            ).token_ids == plain
        # A SamplingParams object is taken as it is.
        assert eng.generate(PROMPTS[1], SamplingParams(**SAMPLED)).token_ids == plain


@pytest.mark.parametrize("option", [{"sampling_defaults": "openai"}, {"generation_config": "vllm"}])
def test_generation_config_defaults_can_be_turned_off(model_with_defaults, option):
    assert sampling_defaults(EngineConfig(model=str(model_with_defaults), **option)) == {}


def test_override_generation_config_goes_over_the_files_defaults(model_with_defaults):
    config = EngineConfig(model=str(model_with_defaults), generation_config="auto",
                          override_generation_config='{"top_k": 5, "max_new_tokens": 3}')
    assert sampling_defaults(config) == {"temperature": 0.7, "top_p": 0.9, "top_k": 5, "max_new_tokens": 3}
    off = EngineConfig(model=str(model_with_defaults), generation_config="vllm",
                       override_generation_config='{"temperature": 0.0}')
    assert sampling_defaults(off) == {"temperature": 0.0}


def test_override_generation_config_reaches_requests_that_omit_the_fields(one_layer, engine):
    with make_engine(one_layer, max_total_tokens=1024,
                     override_generation_config='{"temperature": 0, "max_new_tokens": 4}') as eng:
        out = eng.generate(PROMPTS[1], {"ignore_eos": True})
    assert out.token_ids == engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 4, "ignore_eos": True}).token_ids


@pytest.mark.parametrize(("raw", "message"), [("[1]", "must be a JSON object"),
                                              ('{"do_sample": true}', r"unknown field\(s\) \['do_sample'\]")])
def test_a_bad_override_generation_config_fails_at_start_naming_it(one_layer, raw, message):
    with pytest.raises(ValueError, match=message):
        sampling_defaults(EngineConfig(model=str(one_layer), override_generation_config=raw))


def test_generation_config_can_come_from_another_directory(model_with_defaults, one_layer):
    config = EngineConfig(model=str(one_layer), generation_config=str(model_with_defaults))
    assert sampling_defaults(config)["top_k"] == 1
    assert sampling_defaults(EngineConfig(model=str(one_layer))) == {}  # its own file has none


def test_sampling_defaults_openai_with_a_generation_config_directory_is_refused(one_layer):
    with pytest.raises(ValueError, match="--sampling-defaults openai ignores them: drop one of the two"):
        EngineConfig(model=str(one_layer), sampling_defaults="openai", generation_config="/somewhere")


def test_sampling_default_flags_parse_to_the_config(one_layer):
    from plait.cli import build_parser, engine_options

    args = build_parser().parse_args(["serve", "--model", str(one_layer), "--sampling-defaults", "openai",
                                      "--generation-config", "vllm"])
    config = EngineConfig.from_kwargs(model=str(one_layer), **engine_options(args))
    assert (config.sampling_defaults, config.generation_config) == ("openai", "vllm")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--sampling-defaults", "hf"])


def test_flush_cache_empties_the_prefix_cache_so_a_repeat_hits_nothing(engine):
    engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 2})
    assert engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 2}).meta_info["cached_tokens"] > 0
    assert engine.flush_cache()
    assert engine.generate(PROMPTS[1], {**GREEDY, "max_new_tokens": 2}).meta_info["cached_tokens"] == 0
