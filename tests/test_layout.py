"""Architecture rules that can be checked by reading the source: the engine imports
neither rich nor typer, and engine modules import each other without circles (counting
imports inside functions too, which hide a circle rather than remove it)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ENGINE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or "__init__"


def _imports(path: Path) -> tuple[set[str], set[str]]:
    """(engine modules imported, top-level packages imported) by one file."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = _module_name(path).split(".")
    pkg = here[:-1] if path.name != "__init__.py" else here
    engine, external = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("memengine.engine."):
                    engine.add(a.name[len("memengine.engine."):])
                external.add(a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                mod = ".".join(base + ([node.module] if node.module else []))
                if node.module is None:  # from . import x
                    for a in node.names:
                        engine.add(".".join(base + [a.name]))
                else:
                    engine.add(mod)
            elif node.module:
                if node.module.startswith("memengine.engine."):
                    engine.add(node.module[len("memengine.engine."):])
                external.add(node.module.split(".")[0])
    return engine, external


def _graph() -> dict[str, set[str]]:
    files = [p for p in ENGINE.rglob("*.py")]
    names = {_module_name(p) for p in files}
    graph = {}
    for p in files:
        deps, _ = _imports(p)
        graph[_module_name(p)] = {d for d in deps if d in names and d != _module_name(p)}
    return graph


def test_engine_never_imports_rich_or_typer():
    for p in ENGINE.rglob("*.py"):
        _, ext = _imports(p)
        assert not ({"rich", "typer", "click"} & ext), p


def test_engine_modules_have_no_import_circle():
    graph = _graph()
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if state.get(d) == 1:
                cycle = stack[stack.index(d):] + [d]
                raise AssertionError("import circle: " + " -> ".join(cycle))
            if d not in state:
                visit(d)
        stack.pop()
        state[n] = 2

    for n in sorted(graph):
        if n not in state:
            visit(n)
    # the check sees real edges (it can fail)
    assert "codec" in graph["safetensors_io"] and "checkpoint" in graph["quantize"]
