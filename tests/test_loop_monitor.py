"""The scheduler process's loop monitors: the step watchdog (--watchdog-timeout) and the periodic
decode log line (--decode-log-interval)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time

from plait.engine.loop_monitor import WATCHDOG_EXIT_CODE, DecodeLog, StepWatchdog
from plait.engine.messages import SchedulerSnapshot
from plait.scheduler.stats import SchedulerStats


def test_a_step_over_the_timeout_calls_on_hang():
    hung = threading.Event()
    watchdog = StepWatchdog(0.2, on_hang=lambda seconds: hung.set())
    watchdog.begin()
    assert hung.wait(5.0)
    watchdog.close()


def test_steps_that_end_in_time_never_call_on_hang():
    calls: list[float] = []
    watchdog = StepWatchdog(0.3, on_hang=calls.append)
    for _ in range(5):
        watchdog.begin()
        time.sleep(0.1)
        watchdog.end()
    time.sleep(0.5)  # idle between steps is not a step
    watchdog.close()
    assert calls == []


def test_the_default_watchdog_exits_the_process_with_every_threads_stack():
    code = ("import time; from plait.engine.loop_monitor import StepWatchdog\n"
            "w = StepWatchdog(0.3)\nw.begin()\ntime.sleep(30)\n")
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == WATCHDOG_EXIT_CODE
    assert time.monotonic() - start < 20
    assert "over --watchdog-timeout" in proc.stderr
    assert 'File "<string>", line 4' in proc.stderr  # the main thread's stack, at its sleep


def snapshot(generated: int, running: int = 3, waiting: int = 1) -> SchedulerSnapshot:
    return SchedulerSnapshot(num_running=running, num_waiting=waiting, kv_slots_in_use=250, max_total_tokens=1000,
                             counters=SchedulerStats(generation_tokens=generated))


def test_the_decode_log_writes_a_line_every_interval_with_the_throughput_since_the_last():
    now = [0.0]
    log = DecodeLog(2, clock=lambda: now[0])
    lines = []
    for step in range(1, 7):
        now[0] = float(step)
        lines.append(log.after_step(snapshot(generated=100 * step)))
    assert [line is not None for line in lines] == [False, True, False, True, False, True]
    assert lines[3] == ("decode: 3 running, 1 queued, KV 250 / 1000 tokens (0.25), "
                        "gen throughput 100.0 tok/s")


def test_a_decode_log_interval_of_0_never_logs():
    log = DecodeLog(0)
    assert all(log.after_step(snapshot(generated=n)) is None for n in range(100))
