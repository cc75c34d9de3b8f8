"""plait.envs declares every PLAIT_* environment variable; no other module names one to read it."""

from __future__ import annotations

import ast
import pathlib
import re

import pytest

from plait import envs

ROOT = pathlib.Path(__file__).resolve().parents[1]
NAME = re.compile(r"PLAIT_[A-Z0-9_]+")


def _sources(*folders: str) -> list[pathlib.Path]:
    return [p for folder in folders for p in sorted((ROOT / folder).rglob("*.py"))]


def test_only_envs_names_a_plait_variable_as_a_string():
    """A string that is exactly a PLAIT_ name is how a module reads the environment (os.environ,
    getenv, a constant holding the name): only plait/envs.py may hold one."""
    offenders = []
    for path in _sources("plait"):
        if path == ROOT / "plait" / "envs.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and NAME.fullmatch(node.value):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.value}")
    assert offenders == [], "read it through plait.envs instead:\n" + "\n".join(offenders)


def test_every_plait_variable_mentioned_in_code_or_tests_is_declared():
    declared = {var.name for var in envs.ALL}
    mentioned = {m for path in _sources("plait", "tests") for m in NAME.findall(path.read_text())}
    assert mentioned - declared == set()


def test_every_declared_variable_is_listed_once_with_a_meaning():
    module_vars = [v for v in vars(envs).values() if isinstance(v, envs.EnvVar)]
    assert sorted(v.name for v in module_vars) == sorted(v.name for v in envs.ALL)
    assert len({v.name for v in envs.ALL}) == len(envs.ALL)
    for var in envs.ALL:
        assert NAME.fullmatch(var.name), var.name
        assert len(var.meaning.split()) >= 5, f"{var.name} needs a meaning"


def test_a_variable_is_read_at_call_time(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("PLAIT_FAULT_INJECT_TOKEN", raising=False)
    assert envs.FAULT_INJECT_TOKEN.get() is None
    monkeypatch.setenv("PLAIT_FAULT_INJECT_TOKEN", "511")
    assert envs.FAULT_INJECT_TOKEN.get() == 511


@pytest.mark.parametrize(("raw", "on"), [("1", True), ("0", False), ("true", False), ("", False)])
def test_a_flag_is_on_only_for_the_value_one(monkeypatch: pytest.MonkeyPatch, raw: str, on: bool):
    monkeypatch.setenv("PLAIT_CPU_GRAPHS", raw)
    assert envs.CPU_GRAPHS.get() is on


def test_an_empty_value_counts_as_unset(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PLAIT_CACHE", "")
    assert envs.CACHE.get() is None
