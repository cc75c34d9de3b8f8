"""What watches the scheduler process's loop (SGLang's ``--watchdog-timeout`` and
``--decode-log-interval``): a watchdog that ends the process when one step hangs, and the periodic
log line of the decode throughput and the pool's use."""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from plait.engine.messages import SchedulerSnapshot

logger = logging.getLogger(__name__)

# The exit code of a process the watchdog ended.
WATCHDOG_EXIT_CODE = 70


def _exit_hung(seconds: float) -> None:
    logger.error("a scheduler step has run for %.1f s (over --watchdog-timeout): exiting so that the server "
                 "fails instead of hanging; the threads' stacks follow", seconds)
    faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
    os._exit(WATCHDOG_EXIT_CODE)


class StepWatchdog:
    """Calls ``on_hang`` (default: log every thread's stack and exit the process) when one step runs
    longer than ``timeout`` seconds. The step itself cannot be interrupted (a hung kernel or
    collective holds the main thread), so the watchdog is a daemon thread that polls the start time
    ``begin`` set; ``end`` clears it. The HTTP process sees the scheduler process die and fails
    fast."""

    def __init__(self, timeout: float, on_hang: Callable[[float], None] = _exit_hung,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout = timeout
        self.on_hang = on_hang
        self.clock = clock
        self._started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="plait-step-watchdog", daemon=True)
        self._thread.start()

    def begin(self) -> None:
        self._started = self.clock()

    def end(self) -> None:
        self._started = None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        poll = min(1.0, self.timeout / 4)
        while not self._stop.wait(poll):
            started = self._started
            if started is not None and self.clock() - started > self.timeout:
                self.on_hang(self.clock() - started)
                return


class DecodeLog:
    """One log line every ``interval`` steps of the loop: the requests running and queued, the KV
    pool's use and the tokens generated per second since the last line (SGLang's "Decode batch"
    line). ``interval`` 0: never."""

    def __init__(self, interval: int, clock: Callable[[], float] = time.perf_counter) -> None:
        self.interval = interval
        self.clock = clock
        self._steps = 0
        self._last: tuple[float, int] | None = None  # (time, generation_tokens) at the last line

    def after_step(self, snap: SchedulerSnapshot) -> str | None:
        """The line to log after a step, or None."""
        if self.interval <= 0:
            return None
        self._steps += 1
        now, generated = self.clock(), snap.counters.generation_tokens
        if self._last is None:
            self._last = (now, generated)
        if self._steps % self.interval:
            return None
        then, before = self._last
        self._last = (now, generated)
        rate = (generated - before) / (now - then) if now > then else 0.0
        usage = snap.kv_slots_in_use / snap.max_total_tokens if snap.max_total_tokens else 0.0
        return (f"decode: {snap.num_running} running, {snap.num_waiting} queued, KV {snap.kv_slots_in_use} / "
                f"{snap.max_total_tokens} tokens ({usage:.2f}), gen throughput {rate:.1f} tok/s")
