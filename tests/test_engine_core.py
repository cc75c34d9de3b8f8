"""The engine core: one function builds the runner and scheduler for a config, both front ends (the
offline Engine and the scheduler process) build through it, and one LiveRequest turns a request's
progress into the increments either reports."""

from __future__ import annotations

import pathlib

import pytest

import plait.engine.engine as engine_module
import plait.engine.scheduler_process as process_module
from plait.config import EngineConfig
from plait.engine.core import EngineCore, LiveRequest, build_engine_core
from plait.engine.messages import Ready, RequestUpdate
from plait.executor.model_runner import ModelRunner
from plait.scheduler.scheduler import Scheduler
from tests.helpers import make_engine

OPTIONS = {"device": "cpu", "max_total_tokens": 8192}
GREEDY4 = {"max_new_tokens": 4, "temperature": 0.0, "ignore_eos": True}


@pytest.fixture
def model(tiny_model_dir) -> pathlib.Path:
    return tiny_model_dir("llama")


@pytest.fixture
def engine(model):
    with make_engine(model) as e:
        yield e


def _spy_on_build(monkeypatch: pytest.MonkeyPatch, module: object) -> list[EngineConfig]:
    calls: list[EngineConfig] = []

    def spy(config: EngineConfig) -> EngineCore:
        calls.append(config)
        return build_engine_core(config)

    monkeypatch.setattr(module, "build_engine_core", spy)
    return calls


def test_one_device_gets_a_model_runner_and_a_scheduler_over_it(model):
    core = build_engine_core(EngineConfig.from_kwargs(model=str(model), **OPTIONS))
    try:
        assert type(core.runner) is ModelRunner and type(core.scheduler) is Scheduler
        assert core.scheduler.runner is core.runner
        assert core.limits.max_total_tokens == core.runner.max_total_tokens == 8192
        assert core.limits.vocab_size == core.model_config.vocab_size
    finally:
        core.close()


def test_the_engine_builds_through_the_core(monkeypatch, model):
    calls = _spy_on_build(monkeypatch, engine_module)
    with make_engine(model) as engine:
        assert calls == [engine.config]
        assert engine.runner is engine.core.runner and engine.scheduler is engine.core.scheduler
        assert engine.frontend.limits == engine.core.limits


def test_the_scheduler_process_builds_through_the_core_and_reports_its_limits(monkeypatch, model, tmp_path):
    import zmq

    calls = _spy_on_build(monkeypatch, process_module)
    ctx = zmq.Context()
    outputs = ctx.socket(zmq.PULL)
    outputs_addr = f"ipc://{tmp_path}/outputs"
    outputs.bind(outputs_addr)
    config = EngineConfig.from_kwargs(model=str(model), **OPTIONS)
    proc = process_module.SchedulerProcess(config, [f"ipc://{tmp_path}/requests"], [outputs_addr], None)
    try:
        proc.load()
        assert calls == [config]
        assert proc.scheduler is proc.core.scheduler and proc.runner is proc.core.runner
        assert outputs.poll(10_000), "no Ready message"
        ready = outputs.recv_pyobj()
        assert isinstance(ready, Ready)
        limits = proc.core.limits
        assert (ready.vocab_size, ready.max_context_len, ready.max_total_tokens) == (
            limits.vocab_size, limits.max_context_len, limits.max_total_tokens)
    finally:
        if hasattr(proc, "core"):
            proc.core.close()
        proc.close()
        outputs.close(0)
        ctx.term()


def test_a_request_with_nothing_new_has_no_update(engine):
    live = LiveRequest(engine.make_request([1, 2, 3], GREEDY4))
    assert live.take_update() is None


def _updates_until_finished(engine, live: LiveRequest) -> list[RequestUpdate]:
    """Step the scheduler and take the live request's updates, as the front ends do."""
    engine.scheduler.add_request(live.req)
    updates: list[RequestUpdate] = []
    while not updates or not updates[-1].finished:
        if not live.req.finished:
            engine.scheduler.step()
        update = live.take_update()
        if update is not None:
            updates.append(update)
    engine.scheduler.flush()
    return updates


def test_updates_add_up_to_the_output_and_only_the_last_one_finishes(engine):
    live = LiveRequest(engine.make_request([1, 2, 3], GREEDY4))
    updates = _updates_until_finished(engine, live)
    req = live.req
    assert [t for u in updates for t in u.token_ids] == req.output_ids
    assert "".join(u.text for u in updates) == req.detokenizer.final_text()
    assert [u.finish_reason for u in updates] == [None] * (len(updates) - 1) + ["length"]
    assert updates[-1].completion_tokens == len(req.output_ids) == 4


def test_a_request_that_does_not_stream_reports_its_first_token_then_the_rest_at_the_finish(engine):
    live = LiveRequest(engine.make_request([1, 2, 3], {**GREEDY4, "max_new_tokens": 9}), stream=False)
    updates = _updates_until_finished(engine, live)
    assert [len(u.token_ids) for u in updates] == [1, 8]
    assert [u.token_ids for u in updates] == [live.req.output_ids[:1], live.req.output_ids[1:]]
    assert [u.finish_reason for u in updates] == [None, "length"]


def test_a_request_that_does_not_stream_gets_its_text_once_at_the_finish(engine):
    live = LiveRequest(engine.make_request([1, 2, 3], GREEDY4), stream=False)
    updates = _updates_until_finished(engine, live)
    assert [u.text for u in updates[:-1]] == [""] * (len(updates) - 1)
    assert updates[-1].text == live.req.detokenizer.final_text() != ""
