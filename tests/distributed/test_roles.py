"""Every layout's front objects answer the calls the engine core makes (plait.parallel.roles), each
declared on the class itself: nothing reaches them through attribute forwarding."""

from __future__ import annotations

import pytest

from plait.executor.model_runner import ModelRunner
from plait.parallel.data_parallel import DataParallelRunner, DataParallelScheduler
from plait.parallel.dp_attention import DPAttentionLeader, DPAttentionScheduler
from plait.parallel.launch import TPLeaderRunner
from plait.parallel.roles import EngineRunner, EngineScheduler
from plait.scheduler.scheduler import Scheduler


def _declared_calls(protocol: type) -> set[str]:
    """The methods and properties a Protocol declares (its data members are set per instance)."""
    return {name for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


@pytest.mark.parametrize("cls", [ModelRunner, TPLeaderRunner, DPAttentionLeader, DataParallelRunner])
def test_every_runner_layout_declares_the_engine_runner_calls(cls):
    assert _declared_calls(EngineRunner) <= set(dir(cls))


@pytest.mark.parametrize("cls", [DataParallelScheduler, DPAttentionScheduler])
def test_every_front_scheduler_declares_the_engine_scheduler_calls(cls):
    # The plain Scheduler sets its lists and hooks per instance; the front schedulers answer with
    # methods and properties on the class.
    assert _declared_calls(EngineScheduler) | {"on_logits"} <= set(dir(cls))


def test_the_plain_scheduler_declares_the_engine_scheduler_methods():
    methods = {n for n in _declared_calls(EngineScheduler) if not isinstance(vars(EngineScheduler)[n], property)}
    assert methods <= set(dir(Scheduler))


def test_no_front_object_forwards_unknown_attributes():
    for cls in (DataParallelRunner, DataParallelScheduler, DPAttentionScheduler, DPAttentionLeader):
        assert "__getattr__" not in vars(cls)
