"""The package's import graph: no module imports itself back through others, and the engine layer
imports no worker. Function-level imports count (a cycle hidden inside a function still runs
both ways), and so do the package ``__init__`` modules an import runs on its way; imports under
``TYPE_CHECKING`` do not (they never run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SOURCE = Path(__file__).resolve().parents[1] / "python"


def modules() -> dict[str, Path]:
    found = {}
    for path in SOURCE.rglob("*.py"):
        parts = path.relative_to(SOURCE).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    hidden: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            hidden |= {id(n) for n in ast.walk(node)}
    return hidden


def import_graph() -> dict[str, set[str]]:
    """Module -> the package modules it imports when it runs."""
    known = modules()

    def owner(name: str) -> str | None:
        if name.startswith("asyncflow._native"):
            return None  # the native extension imports nothing of the package
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        tree = ast.parse(path.read_text())
        hidden = _type_checking_nodes(tree)
        targets: set[str | None] = set()
        for node in ast.walk(tree):
            if id(node) in hidden:
                continue
            if isinstance(node, ast.Import):
                targets |= {owner(a.name) for a in node.names if a.name.startswith("asyncflow")}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("asyncflow"):
                targets |= {owner(f"{node.module}.{a.name}") for a in node.names}
        # Importing ``a.b.c`` first runs the packages ``a`` and ``a.b``: their imports count too
        # (but not the packages this module is itself inside, already being imported).
        for target in list(targets):
            package = (target or "").rpartition(".")[0]
            while package.count("."):
                if not name.startswith(package + "."):
                    targets.add(package)
                package = package.rpartition(".")[0]
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_no_package_module_imports_itself_back() -> None:
    assert cycles(import_graph()) == []


@pytest.mark.parametrize("layer", ["asyncflow.engines", "asyncflow.models", "asyncflow.algorithms"])
def test_lower_layers_import_no_worker_and_not_the_job(layer: str) -> None:
    wrong = {
        (name, target)
        for name, targets in import_graph().items()
        if name.startswith(layer)
        for target in targets
        if target.startswith("asyncflow.workers") or target == "asyncflow.train"
    }
    assert not wrong, f"{layer} reaches up into the workers or the job: {sorted(wrong)}"
