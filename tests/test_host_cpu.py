"""plait.bench.host_cpu: CPU use read from /proc over an interval, for host-bound benchmarks."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from plait.bench.host_cpu import cpu_use, process_cpu_s, process_tree, read_counters

SPAWN_SLEEPER = ("import subprocess, sys, time; "
                 "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(5)']); time.sleep(5)")
BURN = "import time\nend = time.time() + 0.5\nwhile time.time() < end: pass"


def _wait_for(pred, timeout: float = 5.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_process_tree_holds_a_child_and_the_child_it_started():
    child = subprocess.Popen([sys.executable, "-c", SPAWN_SLEEPER])
    try:
        assert _wait_for(lambda: len(process_tree(child.pid)) == 2)
        tree = process_tree(os.getpid())
        assert tree[0] == os.getpid() and child.pid in tree and process_tree(child.pid)[1] in tree
    finally:
        for pid in process_tree(child.pid)[::-1]:
            os.kill(pid, 9)
        child.wait()


def test_a_busy_process_shows_its_cpu_seconds_and_a_gone_one_none():
    burner = subprocess.Popen([sys.executable, "-c", BURN])
    before = read_counters([burner.pid])
    time.sleep(0.3)
    after = read_counters([burner.pid])
    burner.wait()
    use = cpu_use(before, after, {"burner": [burner.pid], "gone": [burner.pid + 1_000_000]})
    assert use["burner_cpus"] > 0.05 and use["gone_cpus"] is None
    assert 0 < use["busy_cpus"] <= use["cpus"] + 0.05 and use["wall_s"] > 0.2
    assert process_cpu_s(burner.pid) is None  # reaped: nothing left to read


def test_cpu_use_is_empty_without_both_readings():
    assert cpu_use(None, read_counters(), {}) == {}
    assert cpu_use(read_counters(), None, {}) == {}
