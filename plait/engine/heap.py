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
from collections.abc import Iterator
from contextlib import contextmanager


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
