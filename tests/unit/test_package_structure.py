"""The runtime package's house rules: no import cycle between its modules, no module over ~600 lines."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from distflow.planner import find_cycle

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parents[2] / "worker_image" / "distflow"
MAX_LINES = 600


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.AST, modules: set[str]) -> set[str]:
    """distflow modules ``tree`` imports at run time (module level or in functions; not for type checkers)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node):
            return
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in modules)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:  # `from distflow.data import wire` imports the module distflow.data.wire
                child = f"{node.module}.{alias.name}"
                found.add(child if child in modules else node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found & modules


def _graph() -> dict[str, set[str]]:
    files = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    modules = set(files)
    graph = {}
    for name, path in files.items():
        deps = _imports(ast.parse(path.read_text()), modules) - {name}
        # importing a.b.c runs a/__init__ and a/b/__init__ first
        graph[name] = {p for d in deps for p in _parents(d) if p != name and not name.startswith(p + ".")} | deps
    return graph


def _parents(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    return find_cycle({v: sorted(graph[v]) for v in sorted(graph)})


def test_no_import_cycle_between_distflow_modules():
    graph = _graph()
    assert "distflow.stages.scoring" in graph["distflow.stages.group_filter"]
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_the_cycle_finder_finds_a_cycle_through_a_package():
    graph = {"p": {"p.a"}, "p.a": {"p.b"}, "p.b": {"q"}, "q": {"p"}}
    assert _find_cycle(graph) == ["p", "p.a", "p.b", "q", "p"]
    assert _find_cycle({"p": {"p.a"}, "p.a": set()}) is None


def test_an_import_only_for_type_checkers_is_not_an_edge():
    code = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from distflow.spec import JobSpec\nimport distflow.fields\n"
    assert _imports(ast.parse(code), {"distflow.spec", "distflow.fields"}) == {"distflow.fields"}


def test_no_module_is_over_600_lines():
    sizes = {str(p.relative_to(PACKAGE)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert len(sizes) > 50
    assert {p: n for p, n in sizes.items() if n > MAX_LINES} == {}
