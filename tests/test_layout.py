"""Architecture rules that can be checked by reading the source (imports inside functions
count too: they hide a circle rather than remove it):

- the engine imports neither rich nor typer;
- engine modules import each other without circles;
- only the backend modules of engine/backend/ import a WebGPU binding, each its own
  (wgpu_native.py wgpu, dawn.py wgpudawn; the package's __init__ neither);
- only engine/train/distributed.py imports torch, and only inside its functions (lazily);
- an architecture folder under engine/models/ imports no other architecture;
- options are frozen once resolved (a write into one raises);
- options are validated once, as they are made: nothing in engine/ or cli/ calls
  `.validate()` on them again.
"""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ENGINE = ROOT / "engine"
PREFIX = "memengine.engine"


def _module_name(path: Path) -> str:
    rel = path.relative_to(ENGINE).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or "__init__"


def _known() -> set:
    return {_module_name(p) for p in ENGINE.rglob("*.py")}


def _imports(path: Path, known: set | None = None) -> tuple[set[str], set[str]]:
    """(engine modules imported, top-level packages imported) by one file.  `from P import
    name` counts the module P.name when there is one, else P."""
    known = _known() if known is None else known
    tree = ast.parse(path.read_text(encoding="utf-8"))
    here = _module_name(path).split(".")
    pkg = here[:-1] if path.name != "__init__.py" else here
    engine, external = set(), set()

    def add(mod: str, names) -> None:
        for a in names:
            sub = f"{mod}.{a.name}" if mod else a.name
            if sub in known:
                engine.add(sub)
            elif mod:
                engine.add(mod)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith(PREFIX + "."):
                    engine.add(a.name[len(PREFIX) + 1:])
                external.add(a.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = pkg[: len(pkg) - (node.level - 1)] if node.level > 1 else pkg
                add(".".join(base + ([node.module] if node.module else [])), node.names)
            elif node.module:
                if node.module == PREFIX:
                    add("", node.names)
                elif node.module.startswith(PREFIX + "."):
                    add(node.module[len(PREFIX) + 1:], node.names)
                external.add(node.module.split(".")[0])
    return engine, external


def _graph() -> dict[str, set[str]]:
    known = _known()
    graph = {}
    for p in ENGINE.rglob("*.py"):
        deps, _ = _imports(p, known)
        graph[_module_name(p)] = {d for d in deps if d in known and d != _module_name(p)}
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
    assert "io.codec" in graph["io.safetensors_io"] and "io.checkpoint" in graph["app.quantize"]


BINDINGS = {"wgpu_native.py": "wgpu", "dawn.py": "wgpudawn"}


def test_only_the_backend_imports_wgpu():
    backend = ENGINE / "backend"
    for p in [*ENGINE.rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        tree = ast.parse(p.read_text(encoding="utf-8"))
        ext = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        ext |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and not n.level}
        own = {BINDINGS[p.name]} if p.parent == backend and p.name in BINDINGS else set()
        assert ({"wgpu", "wgpudawn"} & ext) == own, p
        if backend in p.parents:
            continue
        # nor reaches the binding through an attribute (`rt.wgpu.BufferUsage`)
        assert not re.search(r"\.wgpu(dawn)?\b", p.read_text(encoding="utf-8")), p
    # the check sees real imports (it can fail)
    assert "wgpu" in _imports(backend / "wgpu_native.py")[1]
    assert "wgpudawn" in _imports(backend / "dawn.py")[1]
    # every registered backend is one of these modules
    from memengine.engine.backend import REGISTRY

    assert {m.rsplit(".", 1)[1] + ".py" for m in REGISTRY.values()} == set(BINDINGS)


def test_only_the_distributed_module_imports_torch_and_lazily():
    dist = ENGINE / "train" / "distributed.py"
    for p in [*ENGINE.rglob("*.py"), *(ROOT / "cli").rglob("*.py")]:
        tree = ast.parse(p.read_text(encoding="utf-8"))
        top = {a.name.split(".")[0] for n in tree.body if isinstance(n, ast.Import) for a in n.names}
        top |= {(n.module or "").split(".")[0] for n in tree.body if isinstance(n, ast.ImportFrom)}
        assert "torch" not in top, p   # never at import time
        anywhere = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
        anywhere |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        assert ("torch" in anywhere) == (p == dist), p   # the check sees real imports (it can fail)


def test_a_command_line_without_ranks_never_imports_torch():
    import subprocess
    import sys

    code = ("import sys; import memengine.cli.main, memengine.engine.app.run, memengine.engine.train.loop; "
            "print('torch' in sys.modules)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "False", r.stderr


def _architectures() -> list:
    """The architecture folders under engine/models/."""
    return sorted(p.name for p in (ENGINE / "models").iterdir() if p.is_dir() and (p / "__init__.py").is_file())


def test_an_architecture_folder_imports_no_other_architecture():
    archs = _architectures()
    assert "mamba1" in archs
    graph = _graph()
    for arch in archs:
        for mod, deps in graph.items():
            if mod.startswith(f"models.{arch}"):
                others = {d for d in deps if d.startswith("models.") and d.split(".")[1] in set(archs) - {arch}}
                assert not others, f"{mod} imports {others}"


def test_only_an_architecture_folder_imports_its_modules():
    """The shell, the plan, the commands and LoRA reach an architecture through the registry
    (engine.models.of / architecture): none imports an architecture folder, so adding one
    changes no line outside it but its registry line."""
    archs = set(_architectures())
    graph = _graph()
    for mod, deps in graph.items():
        here = mod.split(".")[1] if mod.startswith("models.") and len(mod.split(".")) > 1 else None
        bad = {d for d in deps if d.startswith("models.") and len(d.split(".")) > 1 and d.split(".")[1] in archs
               and d.split(".")[1] != here}
        assert not bad, f"{mod} imports {bad}"
    # the memory plan reads the model's own tables, not the kernels of one architecture
    assert not {d for d in graph["app.plan"] if d in ("kernels.scan", "kernels.conv1d")}, graph["app.plan"]
    assert "models" in graph["app.plan"] and "models.lm" in graph["app.plan"]


def _option_classes():
    from memengine.engine.app import options as eo

    return [eo.InfoOptions, eo.EvalOptions, eo.TrainOptions, eo.AdaptOptions, eo.SamplingOptions,
            eo.GenerateOptions]


@pytest.mark.parametrize("cls", _option_classes(), ids=lambda c: c.__name__)
def test_options_are_frozen_once_resolved(cls):
    from memengine.engine.app.options import resolve_options

    name = "seq_len" if "seq_len" in {f.name for f in cls.option_fields()} else "top_k"
    made = cls()
    resolved = resolve_options(cls, {name: 8})
    for o in (made, resolved):
        for f in cls.option_fields():
            with pytest.raises(dataclasses.FrozenInstanceError):
                setattr(o, f.name, getattr(o, f.name))
        with pytest.raises(dataclasses.FrozenInstanceError):
            o.config_file = Path("x")
    # a changed copy is made, and checked, as any options are
    assert getattr(dataclasses.replace(resolved, **{name: 3}), name) == 3


def _names_options(node) -> bool:
    """An expression that holds options: o, opts, options, self.o, <X>Options(...)."""
    if isinstance(node, ast.Name):
        return node.id in ("o", "opts", "options")
    if isinstance(node, ast.Attribute):
        return node.attr in ("o", "opts", "options")
    if isinstance(node, ast.Call):
        f = node.func
        name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
        return name.endswith("Options")
    return False


def _validate_calls(path: Path) -> list:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
            and n.func.attr in ("validate", "_check_values") and _names_options(n.func.value)]


def test_options_are_validated_once():
    """Options check themselves as they are made (`__post_init__`); no caller checks them
    again (a run checks only that its inputs are given: `check_inputs`)."""
    options = ENGINE / "app" / "options.py"
    for p in sorted(ENGINE.rglob("*.py")) + sorted((ROOT / "cli").rglob("*.py")):
        if p != options:
            assert not _validate_calls(p), f"{p.relative_to(ROOT)}:{_validate_calls(p)} validates options again"
    src = options.read_text(encoding="utf-8")
    assert "def __post_init__" in src and "self._check_values()" in src


def test_every_package_is_in_pyproject():
    """A non-editable install ships exactly the packages pyproject.toml lists: each folder of
    cli/ and engine/ with an __init__.py must be there."""
    import tomllib

    root = Path(__file__).resolve().parents[1]
    listed = set(tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {"memengine." + ".".join(p.parent.relative_to(root).parts) for d in ("cli", "engine")
             for p in (root / d).rglob("__init__.py")}
    assert found <= listed, sorted(found - listed)
