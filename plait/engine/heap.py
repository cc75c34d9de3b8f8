"""The garbage collector around the engine's loops.

A process serving a model holds hundreds of thousands of long-lived tracked objects (modules, the
model's parameters and buffers, the tokenizer, compiled-kernel caches). CPython's full collection
walks every one of them, a stall of tens to hundreds of milliseconds that the GPU waits through: a
share of a short offline run, or a token gap in every stream of a server. Objects in the permanent
generation (``gc.freeze``) are never walked, so both paths below move the startup heap there: a
server's processes once, for their lifetime; the offline ``Engine`` for each ``generate`` call,
putting it back after, so the caller's own garbage stays collectable between calls. ``gc.freeze``
and ``gc.unfreeze`` splice lists: O(1).
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any


def freeze_startup_heap() -> None:
    """Collect once, then move every object alive now into the permanent generation for good: a
    full collection while serving walks only the objects that serving made. Call it once a process
    has finished starting."""
    gc.collect()
    gc.freeze()


@contextmanager
def startup_heap_frozen() -> Iterator[None]:
    """Every tracked object alive on entry stays out of the collector's walks inside the block (it is
    put back, into the oldest generation, on exit). A no-op where the heap is frozen already (an
    enclosing block, a caller's own ``gc.freeze``), which keeps its freeze. Objects that die inside
    the block are collected as usual; garbage frozen on entry waits until the exit."""
    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextmanager
def gc_pauses() -> Iterator[dict[str, dict[str, float]]]:
    """The garbage collector's collections while the block runs, per generation: how many, and the
    seconds they stalled the process (a full collection walks every tracked object the heap holds
    outside the permanent generation)."""
    pauses: dict[str, dict[str, float]] = {}
    started: list[float] = []

    def callback(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            started.append(time.perf_counter())
        elif started:
            row = pauses.setdefault(f"gen{info['generation']}", {"collections": 0, "seconds": 0.0})
            row["collections"] += 1
            row["seconds"] += time.perf_counter() - started.pop()

    gc.callbacks.append(callback)
    try:
        yield pauses
    finally:
        gc.callbacks.remove(callback)


def paused_seconds(pauses: dict[str, dict[str, float]]) -> float:
    """The seconds every generation's collections stalled the process, of a ``gc_pauses`` record."""
    return sum(row["seconds"] for row in pauses.values())
