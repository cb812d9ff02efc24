"""The ops package's modules import one another one way (no import circle).

Parses every module of megatron_kd/ops (imports inside functions included: a lazy import is still a
dependency) and checks that the graph of ops -> ops imports is acyclic, and that no submodule takes
names from the package's own __init__ (which imports the submodules). Then imports each module first
in a fresh interpreter, the order in which a circle would show as an ImportError.
"""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import megatron_kd.ops

OPS_DIR = Path(megatron_kd.ops.__file__).parent
PACKAGE = "megatron_kd.ops"
MODULES = sorted(p.stem for p in OPS_DIR.glob("*.py") if p.stem != "__init__")


def ops_imports(module: str) -> set[str]:
    """The ops modules ``module`` imports ("__init__" for names taken from the package itself)."""
    tree = ast.parse((OPS_DIR / f"{module}.py").read_text())
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(PACKAGE + "."):
                    found.add(alias.name[len(PACKAGE) + 1:].split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == PACKAGE:
                found.update(a.name if a.name in MODULES else "__init__" for a in node.names)
            elif node.module.startswith(PACKAGE + "."):
                found.add(node.module[len(PACKAGE) + 1:].split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level > 0:
            found.add(node.module.split(".")[0] if node.module else "__init__")
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
    assert "topk_kl_function" in graph["topk_kl"]
    assert "topk_kl" not in graph["topk_kl_function"]
    assert {"topk_kl", "topk_kl_function"}.isdisjoint(graph["topk_kl_options"] | graph["value_checks"])


@pytest.mark.parametrize("module", ["topk_kl_function", "topk_kl_options", "value_checks", "topk_kl_reference"])
def test_each_module_imports_first(module):
    code = f"import {PACKAGE}.{module}; from megatron_kd.ops.topk_kl import TopKKLOptions, resolve_impl, HostCopy"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
