"""The package's floors (docs/architecture.md): every import in plait/, at runtime or under
TYPE_CHECKING, points at its own floor or a lower one, and no modules import each other in a cycle."""

from __future__ import annotations

import ast
import pathlib
import re
from collections.abc import Iterable

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "plait"

# Bottom up. A module belongs to the longest prefix listed here. Mirrored by the table in
# docs/architecture.md (a test below keeps the two equal).
FLOORS: dict[int, tuple[str, ...]] = {
    1: ("plait.config", "plait.envs", "plait.forward_batch", "plait.mem", "plait.transfer", "plait.triton_utils",
        "plait.two_batch_overlap"),
    2: ("plait.distributed",),
    3: ("plait.layers", "plait.attention", "plait.models"),
    4: ("plait.sampling", "plait.executor"),
    5: ("plait.scheduler",),
    6: ("plait.speculative",),
    7: ("plait.parallel",),
    8: ("plait.engine",),
    9: ("plait.server", "plait.bench"),
    10: ("plait.cli", "plait.cli_aliases", "plait.__main__", "plait"),
    # Tests and benchmarks only: no production module may import it.
    11: ("plait.testing",),
}

def module_name(path: pathlib.Path, root: pathlib.Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def floor_of(module: str) -> int:
    best, floor = -1, None
    for level, prefixes in FLOORS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), level
    if floor is None:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS and docs/architecture.md")
    return floor


def import_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """Module -> the plait modules it imports (every import statement, wherever it stands)."""
    modules = {module_name(p, root): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                candidates = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([node.module] if node.module else []))
                candidates = [f"{base}.{alias.name}" for alias in node.names] + [base]
            else:
                continue
            for candidate in candidates:
                while candidate and candidate not in modules and "." in candidate:
                    candidate = candidate.rpartition(".")[0]
                if candidate in modules and candidate != name and candidate.startswith(root.name):
                    targets.add(candidate)
                    break
        graph[name] = targets
    return graph


def upward_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(src, dst) for src, dsts in graph.items() for dst in dsts if floor_of(dst) > floor_of(src)}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The same edges between top-level packages (``plait.scheduler``, ``plait.config``, ...)."""

    def top(module: str) -> str:
        return ".".join(module.split(".")[:2])

    out: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        out.setdefault(top(src), set()).update(top(d) for d in dsts if top(d) != top(src))
    return out


def _fmt(pairs: Iterable[tuple[str, str]]) -> str:
    return "\n".join(f"  {a} -> {b} (floor {floor_of(a)} -> {floor_of(b)})" for a, b in sorted(pairs))


def test_every_module_is_on_a_floor() -> None:
    for name in import_graph(PACKAGE):
        floor_of(name)


def test_no_import_runs_to_a_higher_floor() -> None:
    upward = upward_imports(import_graph(PACKAGE))
    assert not upward, "imports of a higher floor (declare a Protocol on the lower floor instead):\n" + _fmt(upward)


def test_no_module_import_cycles() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_no_package_import_cycles() -> None:
    assert cycles(package_graph(import_graph(PACKAGE))) == []


def test_production_code_never_imports_the_test_helpers() -> None:
    graph = import_graph(PACKAGE)
    users = {src for src, dsts in graph.items() if not src.startswith("plait.testing")
             for dst in dsts if dst.startswith("plait.testing")}
    assert users == set()


def _write(root: pathlib.Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_the_checks_catch_a_planted_upward_import_and_cycle(tmp_path: pathlib.Path) -> None:
    """The twin of the tests above: a ground-floor module importing the scheduler under
    TYPE_CHECKING, and two modules importing each other, are both reported."""
    root = tmp_path / "plait"
    _write(root, {
        "__init__.py": "",
        "config.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from plait.scheduler.loop import X\n",
        "scheduler/__init__.py": "",
        "scheduler/loop.py": "from plait.scheduler import policy\nX = 1\n",
        "scheduler/policy.py": "from . import loop\n",
    })
    graph = import_graph(root)
    assert upward_imports(graph) == {("plait.config", "plait.scheduler.loop")}
    assert cycles(graph) == [["plait.scheduler.loop", "plait.scheduler.policy"]]


def test_the_floor_table_in_the_docs_matches_this_one() -> None:
    doc = (ROOT / "docs" / "architecture.md").read_text()
    documented: dict[int, set[str]] = {}
    for floor, packages in re.findall(r"^\|\s*(\d+)\s*\|([^|]*)\|", doc, re.M):
        for path in re.findall(r"`plait/([\w/.]*)`", packages):
            module = ".".join(["plait", *path.strip("/").removesuffix(".py").split("/")]).removesuffix(".__init__")
            documented.setdefault(int(floor), set()).add(module)
    assert documented == {floor: set(prefixes) for floor, prefixes in FLOORS.items() if floor in documented}
    assert set(documented) == set(range(1, 11)), "docs/architecture.md lists floors 1 to 10"
