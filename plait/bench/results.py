"""One JSON object per workload and shape (docs/benchmarks.md), written under benchmarks/results/."""

from __future__ import annotations

import datetime
import json
import os
import pathlib
import platform
import subprocess
from typing import Any

import torch

from plait import envs
from plait.executor.graph_utils import device_total_memory


def _versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"torch": torch.__version__}
    for name in ("triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except ImportError:
            out[name] = None
    return out


def host_info() -> dict[str, Any]:
    """The machine's CPU as results record it: host-bound work (the scheduler's loop, the HTTP process)
    moves with it, so two runs compare only on like hosts. ``cpu``: /proc/cpuinfo's model name (the
    platform's processor string elsewhere), ``model``: its CPU model number, ``cpus``: logical CPUs."""
    fields: dict[str, str] = {}
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return {"cpu": fields.get("model name") or platform.processor() or None,
            "model": int(fields["model"]) if fields.get("model", "").isdigit() else None,
            "cpus": os.cpu_count()}


def git_commit() -> str | None:
    """HEAD of the checkout; PLAIT_COMMIT when the run is from an exported tree without .git (the
    device machine gets `git archive` output)."""
    commit = envs.COMMIT.get()
    if commit:
        return commit
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def write_result(out_dir: str | pathlib.Path, workload: str, shape: str, metric: str, plait_value: float,
                 peer_name: str | None, peer_value: float | None, floor: float | None,
                 config: dict[str, Any], tag: str | None = None, **details: Any) -> pathlib.Path:
    """``tag`` (e.g. the attention backends of a comparison run) is appended to the file name so runs
    of one workload with different settings do not overwrite each other."""
    date = datetime.date.today().isoformat()
    dev = device_name()
    record = {
        "workload": workload, "shape": shape, "device": dev, "device_memory_bytes": device_total_memory(),
        "commit": git_commit(), "date": date,
        "versions": _versions(), "host": host_info(), "metric": metric, "plait": plait_value, "peer_name": peer_name,
        "peer": peer_value,
        "ratio_vs_peer": (plait_value / peer_value) if peer_value else None,
        "floor": floor, "fraction_of_floor": (plait_value / floor) if floor else None,
        "config": config, "plait_env": {v.name: v.get() for v in envs.ALL if v.get() != v.default}, **details,
    }
    path = pathlib.Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    safe_dev = dev.replace(" ", "-").replace("/", "-")
    suffix = f"-{tag}" if tag else ""
    file = path / f"{date}-{workload}-{shape}-{safe_dev}{suffix}.json"
    file.write_text(json.dumps(record, indent=2, default=str) + "\n")
    print(json.dumps({k: record[k] for k in ("workload", "shape", "metric", "plait", "peer", "ratio_vs_peer",
                                             "floor", "fraction_of_floor")}))
    return file
