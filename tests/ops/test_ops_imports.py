"""The ops package's modules import one another one way (no import circle).

Parses every module of megatron_kd/ops and its subpackages (imports inside functions included: a
lazy import is still a dependency) and checks that the graph of ops -> ops imports is acyclic, that
no submodule takes names from a package's __init__ (which imports the submodules), and that the
teacher's package never imports the loss's (what they share sits below both). Then imports each
module first in a fresh interpreter, the order in which a circle would show as an ImportError.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_kd.ops

OPS_DIR = Path(megatron_kd.ops.__file__).parent
PACKAGE = "megatron_kd.ops"
# dotted names below the package ("common", "kl.loss", "teacher.topk"); the (sub)packages apart
MODULES = sorted(".".join(p.relative_to(OPS_DIR).with_suffix("").parts)
                 for p in OPS_DIR.rglob("*.py") if p.stem != "__init__")
SUBPACKAGES = sorted(p.parent.name for p in OPS_DIR.glob("*/__init__.py"))


def ops_imports(module: str) -> set[str]:
    """The ops modules ``module`` imports ("__init__" for names taken from a package's __init__)."""
    tree = ast.parse((OPS_DIR / f"{module.replace('.', '/')}.py").read_text())
    found = set()

    def add(name: str) -> None:  # a dotted name below the package: a module, or a package's __init__
        found.add(name if name in MODULES else "__init__")

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    add(alias.name[len(PACKAGE) + 1:])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE or node.module[len(PACKAGE) + 1:] in SUBPACKAGES:
                sub = node.module[len(PACKAGE) + 1:]
                for a in node.names:
                    add(f"{sub}.{a.name}" if sub else a.name)
            elif node.module.startswith(PACKAGE + "."):
                add(node.module[len(PACKAGE) + 1:])
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.add("__init__")  # the package's modules import absolutely
    return found


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path [a, b, ..., a], or None."""
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == "open":
                return stack[stack.index(dep):] + [dep]
            if dep not in state and (cycle := visit(dep)):
                return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_sees_a_circle():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None


def test_ops_import_graph_is_acyclic():
    graph = {m: ops_imports(m) for m in MODULES}
    from_package = sorted(m for m, deps in graph.items() if "__init__" in deps)
    assert not from_package, f"{from_package} import names from megatron_kd.ops itself; import the submodule"
    cycle = find_cycle(graph)
    assert cycle is None, "import circle in megatron_kd.ops: " + " -> ".join(cycle)
    # the layering the package promises
    assert "kl.function" in graph["kl.loss"]
    assert "kl.loss" not in graph["kl.function"]
    assert {"kl.loss", "kl.function"}.isdisjoint(graph["kl.options"] | graph["kl.value_checks"])
    # the two ops meet only in the modules below both
    teacher_imports = set().union(*(deps for m, deps in graph.items() if m.startswith("teacher.")))
    assert not {d for d in teacher_imports if d.startswith("kl.")}, teacher_imports
    shared_imports = set().union(*(deps for m, deps in graph.items() if "." not in m))
    assert all("." not in d for d in shared_imports), shared_imports


@pytest.mark.parametrize("module", ["kl.function", "kl.options", "kl.value_checks", "kl.reference", "teacher.sample"])
def test_each_module_imports_first(module):
    code = (f"import {PACKAGE}.{module}; from megatron_kd.ops.kl.options import TopKKLOptions; "
            "from megatron_kd.ops.common import resolve_impl; from megatron_kd.ops.kl.value_checks import HostCopy")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
