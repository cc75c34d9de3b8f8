"""The start-up warm-up: its request plan follows the config (chunked-prefill size, the graphs' batch
sizes, the radix cache, speculation), running it leaves the engine as it was built (KV free in its
initial order, radix cache empty, counters zero) and serving unchanged, and it is off by default on
the CPU and under the Triton interpreter."""

from __future__ import annotations

import pathlib
from typing import Any

import pytest
import torch

from plait.cli import build_parser, engine_options
from plait.config import EngineConfig
from plait.engine.warmup import (
    SHORT_EXTEND_MAX_TOKENS,
    WarmupPhase,
    WarmupShape,
    gemv_token_classes,
    run_warmup,
    runner_shape,
    should_warm_up,
    warmup_plan,
)
from plait.forward_batch import ForwardBatch
from plait.scheduler.stats import SchedulerStats
from tests.helpers import make_engine, prompt_ids

SMALL = {"device": "cpu", "max_total_tokens": 2048, "chunked_prefill_size": 128, "max_running_requests": 4}
SHAPE = WarmupShape(max_context_len=2048, max_total_tokens=8192, graph_max_bs=None, decode_large_bs=None)


def config(**options: Any) -> EngineConfig:
    return EngineConfig.from_kwargs(model="/m", **options)


def phases_named(plan: list[WarmupPhase], prefix: str) -> list[WarmupPhase]:
    return [p for p in plan if p.name.startswith(prefix)]


def single_prefill_lengths(plan: list[WarmupPhase]) -> list[int]:
    return [p.requests[0].input_len for p in phases_named(plan, "prefill-") if not p.name.startswith("prefill-batch")]


def decode_batch_sizes(plan: list[WarmupPhase]) -> list[int]:
    return [len(p.requests) for p in phases_named(plan, "decode-bs")]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    from plait.testing import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("warm"), "llama", seed=0, num_hidden_layers=1)


# --- when it runs -----------------------------------------------------------------------------------
def test_warmup_is_off_by_default_on_the_cpu():
    assert not should_warm_up(config(device="cpu"))


def test_warmup_auto_is_off_under_the_triton_interpreter(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert not should_warm_up(config(device="cuda"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert should_warm_up(config(device="cuda"))


def test_warmup_on_and_off_override_the_device():
    assert should_warm_up(config(device="cpu", warmup="on"))
    assert not should_warm_up(config(device="cuda", warmup="off"))


def test_bad_warmup_mode_names_the_field_and_its_values():
    with pytest.raises(ValueError, match=r"warmup must be one of \('auto', 'on', 'off'\)"):
        config(warmup="yes")


@pytest.mark.parametrize(("argv", "mode"), [(["--skip-warmup"], "off"), (["--skip-server-warmup"], "off"),
                                            (["--warmup", "on"], "on")])
def test_warmup_flags_set_the_config_field(argv: list[str], mode: str):
    args = build_parser().parse_args(["serve", *argv])
    assert engine_options(args)["warmup"] == mode


def test_default_engine_on_the_cpu_runs_no_warmup(model):
    with make_engine(model, **{k: v for k, v in SMALL.items() if k != "device"}) as engine:
        assert engine.core.warmup is None


# --- the plan ---------------------------------------------------------------------------------------
def test_prefill_lengths_reach_the_chunked_prefill_size_and_straddle_the_short_extend_limit():
    for chunk in (256, 8192):
        lengths = single_prefill_lengths(warmup_plan(config(chunked_prefill_size=chunk), SHAPE))
        assert max(lengths) == min(chunk, SHAPE.max_context_len - 3)
        assert {1, SHORT_EXTEND_MAX_TOKENS, SHORT_EXTEND_MAX_TOKENS + 1} <= set(lengths)
    assert single_prefill_lengths(warmup_plan(config(chunked_prefill_size=256), SHAPE)) == [1, 17, 64, 65, 256]


def test_small_m_gemv_classes_are_prefilled_where_the_gemv_runs():
    assert gemv_token_classes() == (1, 2, 3, 4, 5, 8, 9, 16)
    gpu = WarmupShape(2048, 8192, graph_max_bs=None, decode_large_bs=None, small_m_tokens=gemv_token_classes())
    assert set(gemv_token_classes()) <= set(single_prefill_lengths(warmup_plan(config(), gpu)))
    assert not {2, 3, 5, 9} & set(single_prefill_lengths(warmup_plan(config(), SHAPE)))


def test_a_prompt_longer_than_a_chunk_is_planned_when_the_context_allows():
    plan = warmup_plan(config(chunked_prefill_size=256), SHAPE)
    (chunked,) = phases_named(plan, "chunked-prefill")
    assert chunked.requests[0].input_len > 256
    assert not phases_named(warmup_plan(config(chunked_prefill_size=-1), SHAPE), "chunked-prefill")


def test_decode_is_planned_only_at_batch_sizes_outside_the_graphs():
    eager = decode_batch_sizes(warmup_plan(config(max_running_requests=32), SHAPE))
    assert eager[0] == 1 and max(eager) == 32
    graphs = WarmupShape(2048, 8192, graph_max_bs=8, decode_large_bs=None)
    beyond = decode_batch_sizes(warmup_plan(config(max_running_requests=32), graphs))
    assert beyond and min(beyond) == 9 and max(beyond) == 32
    full = WarmupShape(2048, 8192, graph_max_bs=32, decode_large_bs=None)
    assert decode_batch_sizes(warmup_plan(config(max_running_requests=32), full)) == []


def test_decode_plan_holds_the_large_batch_tile_class():
    shape = WarmupShape(2048, 8192, graph_max_bs=None, decode_large_bs=66)
    assert 66 in decode_batch_sizes(warmup_plan(config(max_running_requests=256), shape))


def test_radix_phases_follow_the_radix_cache_setting():
    hits = phases_named(warmup_plan(config(), SHAPE), "radix-hit")
    assert hits and all(r.prefix_key == "radix" and r.input_len > r.prefix_len > 0 for r in hits[0].requests)
    assert not phases_named(warmup_plan(config(disable_radix_cache=True), SHAPE), "radix")


def test_speculative_verify_is_planned_only_with_speculation():
    assert not phases_named(warmup_plan(config(), SHAPE), "spec-verify")
    plan = warmup_plan(config(speculative_algorithm="NGRAM"), SHAPE)
    (seed,) = phases_named(plan, "spec-seed")
    verify = phases_named(plan, "spec-verify")
    assert [len(p.requests) for p in verify] == [1, 16]
    # The verify phases repeat the seeding prompts (an n-gram drafter proposes what it saw).
    assert all(r in seed.requests for p in verify for r in p.requests)


def test_every_planned_request_fits_the_pool_and_the_running_limit():
    tight = WarmupShape(max_context_len=2048, max_total_tokens=300, graph_max_bs=None, decode_large_bs=None)
    cfg = config(max_running_requests=3, speculative_algorithm="NGRAM")
    for phase in warmup_plan(cfg, tight):
        assert len(phase.requests) <= 3, phase.name
        for r in phase.all_requests:
            assert r.input_len + r.max_new_tokens < 300, phase.name


def test_phase_names_are_unique_when_the_running_limit_merges_classes():
    names = [p.name for p in warmup_plan(config(max_running_requests=3, speculative_algorithm="NGRAM"), SHAPE)]
    assert len(names) == len(set(names))


def test_plan_samples_with_every_sampling_variant():
    kinds = {r.sampling for p in warmup_plan(config(), SHAPE) for r in p.requests}
    assert kinds == {"greedy", "sample", "penalties", "logprobs", "input_logprobs"}


# --- running it -------------------------------------------------------------------------------------
def test_forced_warmup_leaves_the_engine_in_its_initial_state(model):
    with make_engine(model, warmup="on", **SMALL) as engine:
        report = engine.core.warmup
        assert report is not None and report.requests > 0 and report.forward_steps > 0
        assert report.cached_tokens > 0  # the radix-hit phase was served from the cache
        sched = engine.scheduler
        assert sched.stats == SchedulerStats()
        assert sched.tree_cache.total_size() == 0
        assert sched.kv_tokens_in_use() == 0
        assert sched.kv.allocator.available_size() == engine.runner.max_total_tokens
        pool = engine.runner.req_to_token_pool
        assert pool.available_size() == pool.size
        # Slots and rows come out in a new pool's order.
        assert sched.kv.allocator.alloc(4).tolist() == [1, 2, 3, 4]
        assert pool.alloc() == pool.size


def test_output_after_the_warmup_equals_output_without_it(model):
    prompts = prompt_ids(4)
    greedy = {"max_new_tokens": 6, "temperature": 0.0, "ignore_eos": True}
    sampled = {"max_new_tokens": 6, "temperature": 0.8, "top_p": 0.9, "ignore_eos": True}  # unseeded
    outputs = []
    for mode in ("off", "on"):
        with make_engine(model, warmup=mode, **SMALL) as engine:
            outputs.append([o.token_ids for o in engine.generate(prompts, greedy)]
                           + [o.token_ids for o in engine.generate(prompts, sampled)])
    assert outputs[0] == outputs[1]


def test_warmup_runs_chunked_mixed_and_prefix_hit_steps(model):
    with make_engine(model, **SMALL) as engine:
        seen: list[tuple[list[int], list[int]]] = []  # (extend lengths, prefix lengths) per extend batch
        forward_batch = engine.runner.forward_batch

        def spy(fb: ForwardBatch, *args: Any, **kwargs: Any) -> Any:
            if fb.extend is not None:
                seen.append((list(fb.extend.seq_lens_cpu), list(fb.extend.prefix_lens_cpu)))
            return forward_batch(fb, *args, **kwargs)

        engine.runner.forward_batch = spy
        run_warmup(engine.core)
    chunk = SMALL["chunked_prefill_size"]
    assert any(lens == [chunk] and prefix == [0] for lens, prefix in seen)  # a first chunk
    assert any(len(lens) == 1 and prefix[0] == chunk for lens, prefix in seen)  # the rest, after it
    assert any(1 in lens and max(lens) > 1 for lens, _ in seen)  # decode rows beside a prefill
    assert any(p > 0 and n > 1 for lens, prefix in seen for n, p in zip(lens, prefix, strict=True)
               if n != chunk or p != chunk)


def test_speculative_warmup_verifies_then_forgets_it(model):
    with make_engine(model, warmup="on", speculative_algorithm="NGRAM", **SMALL) as engine:
        report = engine.core.warmup
        assert report is not None and report.verify_steps > 0
        worker = engine.scheduler.spec_worker
        assert worker.stats.verify_steps == 0 and not worker.accept_ema
        assert len(worker.drafter.cache) == 0 and not worker.drafter.indices


def test_warmup_restores_the_global_rng(model):
    with make_engine(model, **SMALL) as engine:
        torch.manual_seed(123)
        expected = torch.rand(3)
        torch.manual_seed(123)
        run_warmup(engine.core)
        assert torch.equal(torch.rand(3), expected)


def test_every_data_parallel_replica_is_warmed_and_reset(model):
    with make_engine(model, warmup="on", dp_size=2, **SMALL) as engine:
        report = engine.core.warmup
        replicas = engine.scheduler.replicas
        one = len(warmup_plan(engine.config, runner_shape(replicas[0].runner)))
        assert report is not None and len(report.phases) == 2 * one
        for sched in replicas:
            assert sched.stats == SchedulerStats() and sched.tree_cache.total_size() == 0
            assert sched.kv.allocator.available_size() == sched.runner.max_total_tokens
        assert sum(engine.scheduler.assigned.values()) == 0  # the balancer saw none of it
