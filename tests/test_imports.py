"""The package's import graph: no circles, and every arrow points down the layers.

Every ``import`` in ``megatron_kd/`` counts, also those inside functions (a lazy import is still
a dependency; it only hides a circle until the day it runs). The layers, lowest first:

    errors, version, distributed,     what everything may use
    options
    ops, optim                        loss math and kernels, the optimizer
    cache                             the Zarr store and its codecs
    models                            GPT-OSS spec, attention, experts, documents, HF import
    console                           status lines (names the layer implementation)
    megatron                          args, flags, data, loss wiring, a run's hooks, plan
    data                              chat and text data rendering
    teacher                           the cache-building pass
    prune                             students cut from the teacher
    demo                              the CPU demo
    bridge                            Megatron-Bridge recipes distilled from the cache (an extra)
    commands                          one module per verb of ``megatron-kd``
    cli, train                        entry points

A module may import its own layer and those below it, never one above; packages import each
other without circles (a circle between two packages of one layer is as tangled as one that
climbs).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "megatron_kd"
LAYERS = [("errors", "version", "distributed", "options"), ("ops", "optim"), ("cache",), ("models",), ("console",),
          ("megatron",), ("data",), ("teacher",), ("prune",), ("demo",), ("bridge",), ("commands",), ("cli", "train")]
# the command line: what no library imports
ENTRY_UNITS = ("commands", "cli", "train")
RANK = {unit: rank for rank, units in enumerate(LAYERS) for unit in units}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def _imports(path: Path, name: str, modules: dict[str, Path]) -> set[str]:
    """The megatron_kd modules ``path`` imports (a ``from package import name`` of a submodule
    counts as that submodule)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base)
    return {m for m in found if m in modules and m != name}


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, name, modules) for name, path in modules.items()}


def _unit(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def test_every_unit_has_a_layer():
    units = {_unit(m) for m in _modules()} - {"__init__"}
    assert units <= set(RANK), f"megatron_kd units without a layer in this test: {sorted(units - set(RANK))}"


def test_imports_point_down_the_layers():
    upward = [f"{a} -> {b}" for a, targets in _graph().items() for b in targets
              if _unit(a) != "__init__" and _unit(b) != "__init__" and RANK[_unit(b)] > RANK[_unit(a)]]
    assert not upward, "imports that reach up a layer:\n  " + "\n  ".join(sorted(upward))


def test_libraries_never_import_the_commands():
    """``commands/`` imports the libraries, never the reverse: no module outside the entry units
    imports a command, ``cli`` or the ``train`` entry."""
    upward = [f"{a} -> {b}" for a, targets in _graph().items() for b in targets
              if _unit(a) not in ENTRY_UNITS and _unit(b) in ENTRY_UNITS]
    assert not upward, "libraries that import the command line:\n  " + "\n  ".join(sorted(upward))


def _circles(graph: dict[str, set[str]]) -> list[str]:
    circles = []
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node):
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                circles.append(" -> ".join(path[path.index(nxt):] + [nxt]))
            elif nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node)
    return circles


def test_no_import_circle():
    circles = _circles(_graph())
    assert not circles, "import circles:\n  " + "\n  ".join(circles)


def test_no_import_circle_between_packages():
    """The graph of units (a package, or a top-level module): an arrow where any module of one
    imports any module of the other."""
    units: dict[str, set[str]] = {}
    for a, targets in _graph().items():
        units.setdefault(_unit(a), set()).update(_unit(b) for b in targets)
    circles = _circles({unit: targets - {unit, "__init__"} for unit, targets in units.items() if unit != "__init__"})
    assert not circles, "import circles between packages:\n  " + "\n  ".join(circles)


def test_the_graph_sees_lazy_imports(tmp_path):
    """A function-level import is an arrow too (what hid the models <-> megatron circle)."""
    modules = {"megatron_kd.a": tmp_path / "a.py", "megatron_kd.b": tmp_path / "b.py"}
    modules["megatron_kd.a"].write_text("def f():\n    from megatron_kd.b import g\n    return g\n")
    assert _imports(modules["megatron_kd.a"], "megatron_kd.a", modules) == {"megatron_kd.b"}
