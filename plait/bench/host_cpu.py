"""The host's CPU use over an interval, read from /proc (Linux): beside a host-bound benchmark's wall time,
it tells a slow step from a saturated or shared machine (a guest's CPUs taken by the hypervisor show as
steal time). Elsewhere the counters read as absent and the report is empty."""

from __future__ import annotations

import os
import pathlib
from collections.abc import Iterable
from dataclasses import dataclass

PROC = pathlib.Path("/proc")


@dataclass(frozen=True)
class CpuCounters:
    """CPU seconds at one moment. Machine-wide (summed over CPUs): ``busy_s`` (user, nice, system, irq,
    softirq), ``idle_s`` (idle, iowait), ``steal_s`` (time the hypervisor gave this guest's CPUs to others);
    ``process_s``: user + system seconds of each listed process still alive (all its threads);
    ``children_s``: this process's reaped children (``os.times``); ``cpus``: the CPUs /proc/stat counts."""

    cpus: int
    busy_s: float
    idle_s: float
    steal_s: float
    process_s: dict[int, float]
    children_s: float


def _tick() -> float:
    return 1.0 / os.sysconf("SC_CLK_TCK")


def _stat_fields(pid: int) -> list[str] | None:
    """/proc/<pid>/stat after the command name (which may hold spaces): state, ppid, ..., or None."""
    try:
        text = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()


def process_cpu_s(pid: int) -> float | None:
    """User + system seconds ``pid`` has run (None: gone or unreadable)."""
    fields = _stat_fields(pid)
    return None if fields is None else (int(fields[11]) + int(fields[12])) * _tick()


def process_tree(root: int) -> list[int]:
    """``root`` and every live descendant of it, parents before children."""
    children: dict[int, list[int]] = {}
    for entry in PROC.iterdir() if PROC.is_dir() else ():
        if entry.name.isdigit() and (fields := _stat_fields(int(entry.name))) is not None:
            children.setdefault(int(fields[1]), []).append(int(entry.name))
    tree, todo = [], [root]
    while todo:
        pid = todo.pop(0)
        tree.append(pid)
        todo.extend(sorted(children.get(pid, [])))
    return tree


def read_counters(pids: Iterable[int] = ()) -> CpuCounters | None:
    """The counters now, with ``pids``' own CPU seconds; None where /proc/stat is not readable."""
    try:
        lines = (PROC / "stat").read_text().splitlines()
        first = lines[0].split()
    except (OSError, IndexError):
        return None
    cpus = sum(1 for line in lines if line.startswith("cpu") and line[3:4].isdigit())
    user, nice, system, idle, iowait, irq, softirq, steal = (int(v) * _tick() for v in first[1:9])
    times = os.times()
    procs = {pid: s for pid in pids if (s := process_cpu_s(pid)) is not None}
    return CpuCounters(cpus, user + nice + system + irq + softirq, idle + iowait, steal, procs,
                       times.children_user + times.children_system)


def cpu_use(before: CpuCounters | None, after: CpuCounters | None, groups: dict[str, list[int]]
            ) -> dict[str, float | int | None]:
    """CPUs' worth of use between two readings (CPU seconds over the wall seconds between them, measured
    by the machine's own counters): ``busy_cpus`` and ``steal_cpus`` machine-wide, ``<group>_cpus`` per
    named group of processes (those alive at both readings), ``children_cpus`` for this process's
    children reaped in between. Empty where either reading is missing."""
    if before is None or after is None:
        return {}
    cpus = after.cpus
    wall = ((after.busy_s + after.idle_s + after.steal_s) - (before.busy_s + before.idle_s + before.steal_s)) / cpus
    if wall <= 0:
        return {}
    use: dict[str, float | int | None] = {
        "cpus": cpus, "wall_s": wall, "busy_cpus": (after.busy_s - before.busy_s) / wall,
        "steal_cpus": (after.steal_s - before.steal_s) / wall,
        "children_cpus": (after.children_s - before.children_s) / wall}
    for name, pids in groups.items():
        both = [p for p in pids if p in before.process_s and p in after.process_s]
        use[f"{name}_cpus"] = sum(after.process_s[p] - before.process_s[p] for p in both) / wall if both else None
    return use
