"""The package keeps the shape the architecture guide describes: no cycles, the plan below the loader. No size cap:
a module is as long as its job."""

from __future__ import annotations

import ast
import pathlib

from conftest import REPO

PKG = REPO / "streambatch"


def modules() -> dict[str, pathlib.Path]:
    out = {}
    for path in sorted(PKG.rglob("*.py")):
        parts = list(path.relative_to(PKG.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def imports(name: str, path: pathlib.Path, known: set[str]) -> set[str]:
    """Package modules ``name`` imports, at module level or inside functions (lazy imports count)."""
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.add(sub if sub in known else target)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m in known and m != name}


def test_no_import_cycles_and_plan_below_loader():
    mods = modules()
    known = set(mods)
    graph = {m: imports(m, p, known) - {"streambatch"} for m, p in mods.items()}
    assert not [m for m in graph if m.startswith("streambatch.plan") and "streambatch.loader" in graph[m]]
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(m: str, path: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            if state.get(n) == 1 and not cycle:
                cycle.extend(path[path.index(n) :] + [m, n] if n in path else [m, n])
            elif n not in state:
                visit(n, path + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycle, " -> ".join(cycle)


def test_verify_and_training_read_with_the_same_parser():
    verify = (PKG / "write" / "verify.py").read_text()
    assert "tarfile" not in verify and "format.tar import" in verify
