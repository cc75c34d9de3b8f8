"""SGLang launch flags beyond plait's own: --schedule-policy orders admission, --max-prefill-tokens
caps a step's prefill over its admissions, --cuda-graph-bs names the captured batch sizes (each
changes when a request runs, never its tokens); --grammar-backend none refuses constrained requests."""

from __future__ import annotations

import pytest

from plait.config import EngineConfig
from plait.executor.graph_utils import capture_batch_sizes, graph_batch_sizes
from plait.mem.radix_cache import RadixCache
from tests.helpers import GREEDY, assert_no_leaks, make_engine, prompt_ids

PROMPTS = prompt_ids(6)


@pytest.fixture(scope="module")
def model_path(tiny_model_dir):
    return tiny_model_dir("llama")


@pytest.fixture(scope="module")
def reference_tokens(model_path):
    return [o.token_ids for o in make_engine(model_path).generate(PROMPTS, GREEDY)]


def admission_order(engine) -> list[list[int]]:
    """Records the prompt of every request the scheduler admits, in admission order."""
    order: list[list[int]] = []
    admit = engine.scheduler.kv.admit

    def recording(req, match):
        ok = admit(req, match)
        if ok:
            order.append(list(req.origin_input_ids))
        return ok

    engine.scheduler.kv.admit = recording
    return order


@pytest.mark.parametrize("policy", ["fcfs", "lpm", "lof", "random"])
def test_every_policy_keeps_the_greedy_tokens(model_path, reference_tokens, policy):
    engine = make_engine(model_path, schedule_policy=policy, max_running_requests=2)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_tokens
    assert_no_leaks(engine)


def test_lpm_admits_the_request_with_the_longest_cached_prefix_first(model_path):
    cached, fresh = PROMPTS[4], PROMPTS[1]  # 20 and 7 tokens
    engine = make_engine(model_path, schedule_policy="lpm", max_running_requests=1)
    engine.generate(cached, {**GREEDY, "max_new_tokens": 2})
    order = admission_order(engine)
    engine.generate([fresh, cached + [5, 6]], {**GREEDY, "max_new_tokens": 2})
    assert order == [cached + [5, 6], fresh]
    assert_no_leaks(engine)


def test_fcfs_admits_in_arrival_order_whatever_is_cached(model_path):
    cached, fresh = PROMPTS[4], PROMPTS[1]
    engine = make_engine(model_path, schedule_policy="fcfs", max_running_requests=1)
    engine.generate(cached, {**GREEDY, "max_new_tokens": 2})
    order = admission_order(engine)
    engine.generate([fresh, cached + [5, 6]], {**GREEDY, "max_new_tokens": 2})
    assert order == [fresh, cached + [5, 6]]


def test_lof_admits_the_longest_output_first(model_path):
    engine = make_engine(model_path, schedule_policy="lof", max_running_requests=1)
    order = admission_order(engine)
    short, long_ = PROMPTS[0], PROMPTS[1]
    outs = engine.generate([short, long_], [{**GREEDY, "max_new_tokens": 2}, {**GREEDY, "max_new_tokens": 6}])
    assert order == [long_, short]
    assert [len(o.token_ids) for o in outs] == [2, 6]  # outputs still come back in request order


def test_prefix_len_reads_the_cache_without_splitting_or_touching_it():
    class Slots:
        def free(self, slots) -> None:
            pass

    import torch

    cache = RadixCache(Slots())
    cache.insert([1, 2, 3, 4], torch.arange(4))
    nodes_before = len(cache.root.children[1].children)
    stamp = cache.root.children[1].last_access
    assert [cache.prefix_len(ids) for ids in ([1, 2, 9], [1, 2, 3, 4, 5], [7], [])] == [2, 4, 0, 0]
    assert len(cache.root.children[1].children) == nodes_before  # no split at the partial match
    assert cache.root.children[1].last_access == stamp


def prefill_tokens_per_step(engine) -> list[list[int]]:
    """Each forward's prefill chunk lengths (decode rows left out)."""
    steps: list[list[int]] = []
    launch = engine.scheduler._launch

    def recording(batch):
        steps.append([e.extend_len for e in batch.entries if not e.is_decode])
        return launch(batch)

    engine.scheduler._launch = recording
    return steps


def test_max_prefill_tokens_caps_the_prefill_of_a_step(model_path, reference_tokens):
    engine = make_engine(model_path, max_prefill_tokens=16, chunked_prefill_size=64)
    steps = prefill_tokens_per_step(engine)
    outs = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == reference_tokens
    chunks = [s for s in steps if s]
    assert all(sum(s) <= 16 for s in chunks), chunks
    assert len(chunks) >= 4  # 56 prompt tokens at 16 a step
    assert_no_leaks(engine)


def test_a_prompt_over_max_prefill_tokens_runs_whole_as_the_first_of_its_step(model_path, reference_tokens):
    engine = make_engine(model_path, max_prefill_tokens=8, chunked_prefill_size=64)
    steps = prefill_tokens_per_step(engine)
    out = engine.generate(PROMPTS[4], GREEDY)  # 20 tokens
    assert out.token_ids == reference_tokens[4]
    assert [s for s in steps if s] == [[20]]


def test_without_max_prefill_tokens_the_chunk_alone_bounds_a_step(model_path):
    engine = make_engine(model_path, chunked_prefill_size=64)
    steps = prefill_tokens_per_step(engine)
    engine.generate(PROMPTS, GREEDY)
    assert [s for s in steps if s][0] == [len(p) for p in PROMPTS]  # 3 + 7 + 12 + 5 + 20 + 9 <= 64


def test_cuda_graph_bs_names_the_captured_sizes_and_the_limit():
    config = EngineConfig(model="m", cuda_graph_bs=(1, 3, 12))
    assert graph_batch_sizes(config) == [1, 3, 12]
    assert graph_batch_sizes(EngineConfig(model="m", cuda_graph_max_bs=20)) == capture_batch_sizes(20)


def test_grammar_backend_none_refuses_a_constrained_request_naming_its_field(model_path):
    engine = make_engine(model_path, grammar_backend="none")
    with pytest.raises(ValueError, match="^regex: constrained decoding is off"):
        engine.generate(PROMPTS[0], {**GREEDY, "regex": "[ab]+"})
    assert len(engine.generate(PROMPTS[0], GREEDY).token_ids) == GREEDY["max_new_tokens"]
    assert_no_leaks(engine)


def test_allow_auto_truncate_keeps_a_long_prompts_end_and_shrinks_max_new_tokens(model_path):
    engine = make_engine(model_path, allow_auto_truncate=True, context_length=32)
    plain = make_engine(model_path, context_length=32)
    long_prompt = PROMPTS[4] + PROMPTS[2] + PROMPTS[1]  # 39 tokens
    out = engine.generate(long_prompt, GREEDY)
    assert out.meta_info["prompt_tokens"] == 31 and len(out.token_ids) == 1
    assert out.token_ids == plain.generate(long_prompt[-31:], {**GREEDY, "max_new_tokens": 1}).token_ids
    short = engine.generate(PROMPTS[4], {**GREEDY, "min_new_tokens": 20})  # 20 + 32 over 32: 12 new tokens
    assert short.token_ids == plain.generate(PROMPTS[4], {**GREEDY, "max_new_tokens": 12}).token_ids
    with pytest.raises(ValueError, match="exceeds the limit of 32 tokens"):
        plain.generate(long_prompt, GREEDY)
    assert_no_leaks(engine)


def overridden_copy(model_path, tmp_path, rope: dict, **fields):
    """The checkpoint with its config.json edited as transformers 5 writes it: the reference."""
    import json
    import shutil

    copy = tmp_path / "overridden"
    shutil.copytree(model_path, copy)
    cfg = json.loads((copy / "config.json").read_text())
    cfg["rope_parameters"] = rope
    cfg.update(fields)
    (copy / "config.json").write_text(json.dumps(cfg))
    return copy


def test_a_rope_theta_override_gives_transformers_tokens_on_the_edited_config(model_path, hf_reference, tmp_path):
    import json

    reference = overridden_copy(model_path, tmp_path, {"rope_type": "default", "rope_theta": 50.0})
    engine = make_engine(model_path, json_model_override_args=json.dumps({"rope_theta": 50.0}))
    out = engine.generate(PROMPTS[4], GREEDY)
    assert out.token_ids == hf_reference(reference, PROMPTS[4], GREEDY["max_new_tokens"]).tokens
    assert out.token_ids != make_engine(model_path).generate(PROMPTS[4], GREEDY).token_ids


def test_a_yarn_override_extends_the_context_and_matches_transformers(model_path, hf_reference, tmp_path):
    import json

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 2048}
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings 2048"):
        make_engine(model_path, context_length=8192)
    overrides = {"rope_scaling": yarn, "max_position_embeddings": 8192}
    engine = make_engine(model_path, context_length=8192, max_total_tokens=8192,
                         json_model_override_args=json.dumps(overrides))
    reference = overridden_copy(model_path, tmp_path, {**yarn, "rope_theta": 10000.0}, max_position_embeddings=8192)
    out = engine.generate(PROMPTS[4], GREEDY)
    assert out.token_ids == hf_reference(reference, PROMPTS[4], GREEDY["max_new_tokens"]).tokens


@pytest.mark.parametrize(("fields", "message"), [
    ({"json_model_override_args": "[1, 2]"}, "json_model_override_args must be a JSON object"),
    ({"json_model_override_args": "{rope"}, "json_model_override_args must be a JSON object"),
    ({"grammar_backend": "outlines"}, "grammar_backend must be one of"),
    ({"cuda_graph_bs": (4, 2)}, "ascending"),
    ({"cuda_graph_bs": (2, 2)}, "distinct"),
    ({"cuda_graph_bs": (0, 2)}, ">= 1"),
    ({"cuda_graph_bs": (2, 4), "cuda_graph_max_bs": 8}, "disagree"),
    ({"schedule_policy": "dfs-weight"}, "schedule_policy must be one of"),
    ({"max_prefill_tokens": 0}, "max_prefill_tokens must be >= 1"),
])
def test_bad_scheduling_flags_fail_at_construction_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **fields)
