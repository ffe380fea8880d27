"""The shape of the package, checked from its source: no import cycles, imports that flow one way
between its packages (LAYERS), and a control plane without torch.

Imports count wherever they are written, at module level or inside a function: an import placed
in a function only hides a cycle until that function runs. Imports under `if TYPE_CHECKING:` do
not count (they never run). ../shared/tools/layering.py reports the same cycles from the shell.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = "trainguard"

# the control plane: the scheduler, the launcher and what they use; they must run on a host without torch
TORCH_FREE_PACKAGES = ("control", "launch", "obs")
TORCH_FREE_MODULES = ("trainguard", "trainguard.config", "trainguard.errors", "trainguard.exitcodes",
                      "trainguard.signals", "trainguard.strategies", "trainguard.tlsconfig", "trainguard.files",
                      "trainguard.meshspec", "trainguard.rewinding", "trainguard.frameworks")
NEEDS_TORCH: set[str] = set()

# Each layer and the layers it may import (docs/ARCHITECTURE.md draws it). "base" is the top-level
# modules the whole package shares; "api" (trainguard/__init__.py, __main__.py) may import anything.
# The control plane sits at the bottom, the worker runtime on it, training on both and on the
# checkpoint formats; the launcher drives the control plane and reads checkpoints for its CLI.
BASE = ("config", "errors", "exitcodes", "signals", "strategies", "tlsconfig", "files", "durable", "meshspec", "rewinding",
        "frameworks")
LAYERS = {
    "base": set(),
    "obs": {"base"},
    "control": {"base", "obs"},
    "checkpoint": {"base", "obs"},
    "launch": {"base", "obs", "control", "checkpoint"},
    "worker": {"base", "obs", "control"},
    "train": {"base", "obs", "control", "worker", "checkpoint"},
    "compat": {"base", "obs", "worker", "checkpoint", "train"},
    "testing": {"base", "obs", "control", "worker", "checkpoint", "train"},
}


def modules() -> dict[str, Path]:
    """Every module of the package by dotted name (a package by its own name, for its __init__)."""
    found = {}
    for path in sorted((ROOT / PACKAGE).rglob("*.py")):
        parts = list(path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _typing_only(tree: ast.AST) -> set[int]:
    """ids of the nodes under `if TYPE_CHECKING:` (or `typing.TYPE_CHECKING`), not its else branch."""
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return skip


def imports_of(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """The package's modules that module `name` imports, anywhere in its source."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    skip, targets = _typing_only(tree), set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - node.level + 1]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            targets.add(source)
            targets.update(f"{source}.{alias.name}" for alias in node.names)  # `from pkg import module`
    # a module inside a package imports that package before itself: an edge up to it is no cycle
    return {t for t in targets if t in known and t != name and not name.startswith(t + ".")}


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One cycle (first node repeated at the end) for every strongly connected component of
    more than one module (Tarjan's algorithm, iterative), in a stable order."""
    index, low, on_stack, stack, components = {}, {}, set(), [], []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [_cycle_through(min(c), c, graph) for c in sorted(components, key=min)]


def _cycle_through(start: str, component: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest path from `start` back to itself inside `component` (breadth first)."""
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for child in sorted(graph[node] & component):
                if child == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if child not in came_from:
                    came_from[child] = node
                    following.append(child)
        frontier = following
    raise AssertionError(f"{start} is in a strongly connected component but on no cycle")


# --- the checker checks ------------------------------------------------------------------------------


def test_cycles_are_found_with_their_path():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a", "d"}, "d": set(), "e": {"f"}, "f": {"e"}, "g": {"a"}}
    assert cycles(graph) == [["a", "b", "c", "a"], ["e", "f", "e"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_in_function_imports_count_and_type_checking_ones_do_not(tmp_path):
    src = textwrap.dedent("""
        from __future__ import annotations
        from typing import TYPE_CHECKING
        from . import b
        if TYPE_CHECKING:
            from .c import C
        else:
            from . import d
        def f():
            from .e import thing
            import trainguard.pkg.f
    """)
    path = tmp_path / "a.py"
    path.write_text(src)
    known = {f"trainguard.pkg.{m}": path for m in "abcdef"} | {"trainguard.pkg": path, "trainguard": path}
    assert imports_of("trainguard.pkg.a", path, known) == {f"trainguard.pkg.{m}" for m in "bdef"}


# --- the package -------------------------------------------------------------------------------------


def test_no_import_cycles():
    found = cycles(import_graph())
    assert not found, "import cycles (imports inside functions count):\n" + "\n".join(" -> ".join(c) for c in found)


def layer_of(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1 or parts[1] == "__main__":
        return "api"
    if parts[1] in BASE:
        return "base"
    return parts[1]


def upward_imports(graph: dict[str, set[str]]) -> list[str]:
    """Each import that goes against LAYERS: `module -> imported (layer -> layer)`."""
    bad = []
    for module, imported in sorted(graph.items()):
        here = layer_of(module)
        if here == "api":
            continue
        for target in sorted(imported):
            there = layer_of(target)
            if there != here and there not in LAYERS[here]:
                bad.append(f"{module} -> {target} ({here} -> {there})")
    return bad


def test_every_package_has_a_layer():
    assert {layer_of(m) for m in modules()} <= {*LAYERS, "api"}, sorted({layer_of(m) for m in modules()} - {*LAYERS})


def test_upward_imports_are_found():
    graph = {"trainguard.control.a": {"trainguard.worker.b", "trainguard.errors"},
             "trainguard.worker.b": {"trainguard.control.a"}, "trainguard": {"trainguard.train.c"}}
    assert upward_imports(graph) == ["trainguard.control.a -> trainguard.worker.b (control -> worker)"]


def test_imports_flow_one_way():
    bad = upward_imports(import_graph())
    assert not bad, "imports against the layer order (imports inside functions count):\n" + "\n".join(bad)


def torch_free_modules() -> list[str]:
    names = [n for n in modules() if any(n == f"{PACKAGE}.{p}" or n.startswith(f"{PACKAGE}.{p}.")
                                         for p in TORCH_FREE_PACKAGES)]
    return [*TORCH_FREE_MODULES, *sorted(n for n in names if n not in NEEDS_TORCH)]


BLOCKED_IMPORT = textwrap.dedent("""
    import importlib, importlib.abc, json, sys

    attempts = []

    class NoTorch(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] == "torch":
                attempts.append((current, name))
                raise ImportError(f"torch is blocked: {name}")
            return None

    sys.meta_path.insert(0, NoTorch())
    failed = {}
    for current in sys.argv[1:]:
        try:
            importlib.import_module(current)
        except Exception as exc:
            failed[current] = f"{type(exc).__name__}: {exc}"
    print(json.dumps({"failed": failed, "attempts": attempts, "torch": "torch" in sys.modules}))
""")


def test_the_control_plane_imports_without_torch():
    names = torch_free_modules()
    assert "trainguard.control.scheduler" in names
    proc = subprocess.run([sys.executable, "-c", BLOCKED_IMPORT, *names], capture_output=True, text=True,
                          timeout=90, cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert not result["attempts"], "these modules tried to import torch (first the module being imported, then " \
                                   f"what it asked for): {result['attempts']}"
    assert not result["failed"] and not result["torch"], result
