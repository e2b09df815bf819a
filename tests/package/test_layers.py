"""The package's layers import in one direction, read from the source with ``ast`` (function-level imports too).

``plan/`` is "lengths in, batches out, no I/O": it imports nothing of the package but itself and the leaf value
modules (:mod:`streambatch.errors`, :mod:`streambatch.units`, :mod:`streambatch.stats`). ``format/``, the on-disk
contract, imports nothing of the planner; the planner takes indexes through the ``LengthIndex`` protocol, never
by importing ``format/``. Across the package no two modules or sub-packages import each other.
"""

from __future__ import annotations

import ast
from pathlib import Path

import streambatch

PACKAGE = Path(streambatch.__file__).parent
#: what plan/ may import of the package
PLAN_MAY_IMPORT = ("streambatch.plan", "streambatch.errors", "streambatch.units", "streambatch.stats")


def _module(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The absolute names of the package's modules ``path`` imports anywhere in it (relative ones resolved)."""
    package = _module(path) if path.name == "__init__.py" else _module(path).rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                out.add(".".join(base + ([node.module] if node.module else [])))
            else:
                out.add(node.module or "")
    return {m for m in out if m == "streambatch" or m.startswith("streambatch.")}


def _files() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def _layer(module: str) -> str:
    """A module's node in the layer graph: its sub-package (``streambatch.plan``) or the top-level module."""
    return ".".join(module.split(".")[:2])


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE.parent).as_posix()


def test_plan_imports_only_itself_and_the_leaf_value_modules():
    plan = [p for p in _files() if _layer(_module(p)) == "streambatch.plan"]
    assert plan, "no plan/ modules found"
    found = {
        (_rel(p), m)
        for p in plan
        for m in _imports(p)
        if not any(m == ok or m.startswith(ok + ".") for ok in PLAN_MAY_IMPORT)
    }
    assert found == set(), "plan/ must not import these (it takes lengths, not files)"


def test_the_leaf_value_modules_import_nothing_above_them():
    leaves = {"streambatch.errors", "streambatch.units"}
    for name in ("errors", "units", "stats", "limits"):
        got = _imports(PACKAGE / f"{name}.py")
        assert got <= leaves - {f"streambatch.{name}"}, f"streambatch/{name}.py imports {sorted(got)}"


def test_no_two_layers_import_each_other():
    """The sub-packages and top-level modules form a graph without cycles (the package root, which imports
    everything to export it, is left out)."""
    edges: dict[str, set[str]] = {}
    for path in _files():
        source = _layer(_module(path))
        if source == "streambatch":
            continue
        for target in _imports(path):
            if _layer(target) not in (source, "streambatch"):
                edges.setdefault(source, set()).add(_layer(target))
    assert "streambatch.io" in edges.get("streambatch.format", set()), "the graph lost format/ -> io/"
    assert "streambatch.plan" not in edges["streambatch.format"], "the on-disk contract imports the planner"
    cycle = _cycle(edges)
    assert cycle is None, "an import cycle: " + " -> ".join(cycle or [])


def _cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as a path of nodes, or None (depth-first search)."""
    state: dict[str, int] = {}  # 1: on the path, 2: done
    path: list[str] = []

    def visit(n: str) -> list[str] | None:
        state[n] = 1
        path.append(n)
        for m in sorted(edges.get(n, ())):
            if state.get(m) == 1:
                return path[path.index(m) :] + [m]
            if m not in state and (found := visit(m)) is not None:
                return found
        path.pop()
        state[n] = 2
        return None

    for n in sorted(edges):
        if n not in state and (found := visit(n)) is not None:
            return found
    return None
