"""The garbage collector around the engine's loops (plait.engine.heap): the startup heap stays out of
the collector's walks while the offline Engine generates, and the caller's collector is as it was after."""

from __future__ import annotations

import gc
import pathlib
import weakref
from collections.abc import Iterator

import pytest

from plait.engine.engine import Engine
from plait.engine.heap import startup_heap_frozen


class _Node:
    """A tracked object that can sit in a reference cycle (only the cycle collector frees it)."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def _cycle() -> weakref.ref[_Node]:
    a, b = _Node(), _Node()
    a.other, b.other = b, a
    return weakref.ref(a)


@pytest.fixture
def unfrozen() -> Iterator[None]:
    """A test starts with nothing frozen (an in-process server client of an earlier test froze this
    process's heap for good) and leaves the process as frozen as it found it."""
    was_frozen = gc.get_freeze_count() > 0
    gc.unfreeze()
    yield
    gc.unfreeze()
    if was_frozen:
        gc.freeze()


def test_objects_alive_on_entry_are_frozen_inside_the_block(unfrozen: None) -> None:
    live = _Node()
    with startup_heap_frozen():
        assert gc.get_freeze_count() > 0
        assert gc.is_tracked(live)
    assert gc.get_freeze_count() == 0


def test_garbage_frozen_on_entry_is_collected_after_the_block(unfrozen: None) -> None:
    ref = _cycle()  # unreachable but uncollected: in a young generation
    with startup_heap_frozen():
        gc.collect()
        assert ref() is not None  # frozen with the rest, so no walk reaches it
    gc.collect()
    assert ref() is None


def test_garbage_made_inside_the_block_is_collected_inside_it(unfrozen: None) -> None:
    with startup_heap_frozen():
        ref = _cycle()
        gc.collect()
        assert ref() is None


def test_a_heap_frozen_by_the_caller_stays_frozen(unfrozen: None) -> None:
    """The block neither unfreezes the caller's heap (the count would drop to 0) nor freezes again
    (the count would take the objects made since). The bounds leave room for a few frozen objects
    that another thread of the process (pytest-xdist's I/O) frees meanwhile."""
    gc.freeze()
    frozen = gc.get_freeze_count()
    made_since = [_Node() for _ in range(1000)]  # tracked, not frozen: a second freeze would take them
    with startup_heap_frozen():
        inside = gc.get_freeze_count()
    after = gc.get_freeze_count()
    del made_since  # alive through the block
    assert frozen - 100 < inside <= frozen
    assert frozen - 100 < after <= frozen


def _freeze_counts_while_generating(model: pathlib.Path, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The permanent generation's size at every request creation and scheduler step of one generate."""
    seen: list[int] = []
    with Engine(model=str(model), device="cpu", attention_backend="torch_native") as engine:
        for name in ("make_request", "step"):
            owner = engine if name == "make_request" else engine.scheduler
            method = getattr(owner, name)

            def recording(*args, _method=method, **kwargs):
                seen.append(gc.get_freeze_count())
                return _method(*args, **kwargs)

            monkeypatch.setattr(owner, name, recording)
        outs = engine.generate([[5, 6, 7, 8]] * 8, {"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
    assert all(len(o.token_ids) == 8 for o in outs)
    return seen


def test_generate_creates_and_steps_its_requests_with_the_startup_heap_frozen(
        one_layer: pathlib.Path, unfrozen: None, monkeypatch: pytest.MonkeyPatch) -> None:
    seen = _freeze_counts_while_generating(one_layer, monkeypatch)
    assert len(seen) > 8  # 8 requests created, then the steps
    assert all(n > 0 for n in seen)
    assert gc.get_freeze_count() == 0


def test_generate_leaves_the_collector_alone_with_gc_freeze_off(one_layer: pathlib.Path, unfrozen: None,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PLAIT_GC_FREEZE", "0")
    seen = _freeze_counts_while_generating(one_layer, monkeypatch)
    assert seen and all(n == 0 for n in seen)
