"""The package has no import cycle, lazy imports included.

The graph is read statically from the source (``ast``), so it covers imports inside functions
too: a cycle hidden behind a function-level import is still a lower layer reaching up. An
import of ``a.b.c`` also runs the ``__init__`` of ``a.b`` (what ``a.b`` imports comes with
it), so it counts as an edge to every package on the way that the importer is not inside.
Imports under ``if TYPE_CHECKING:`` never run and are left out.
"""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PACKAGES = {"polynya": "core", "polynya.kernels": "kernels", "polynya.adapters": "adapters",
            "polynya.recipes": "recipes"}


def modules() -> dict[str, str]:
    """module name -> file, for every module of the package."""
    out = {}
    for pkg, folder in PACKAGES.items():
        base = os.path.join(ROOT, folder)
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if not d.startswith((".", "__"))]
            rel = os.path.relpath(dirpath, base)
            prefix = pkg if rel == "." else pkg + "." + rel.replace(os.sep, ".")
            for f in filenames:
                if f.endswith(".py"):
                    name = prefix if f == "__init__.py" else f"{prefix}.{f[:-3]}"
                    out[name] = os.path.join(dirpath, f)
    return out


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    skip = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skip |= {id(n) for n in ast.walk(node)}
    return skip


def imports_of(name: str, path: str, known: set[str]) -> set[str]:
    """The package modules ``name`` imports (anywhere in the file), with their packages."""
    tree = ast.parse(open(path).read(), path)
    skip = _type_checking_nodes(tree)
    is_pkg = path.endswith("__init__.py")
    here = name.split(".") if is_pkg else name.split(".")[:-1]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - node.level + 1]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            targets.add(mod)
            targets |= {f"{mod}.{a.name}" for a in node.names if f"{mod}.{a.name}" in known}
    out = set()
    for t in targets:
        parts = t.split(".")
        for i in range(1, len(parts) + 1):
            m = ".".join(parts[:i])
            inside = name == m or name.startswith(m + ".")
            if m in known and not inside:
                out.add(m)
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def import_graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def test_no_import_cycle():
    graph = import_graph()
    assert len(graph) > 50 and "polynya.sync.layout" in graph
    found = cycles(graph)
    assert not found, "import cycles (a lower layer imports a higher one):\n" + "\n".join(
        " <-> ".join(c) for c in found)


def test_cycle_finder_finds_one():
    """The check can fail: a planted edge from the sync layer back up to the client is a cycle."""
    graph = import_graph()
    graph["polynya.weights"] = graph["polynya.weights"] | {"polynya.client.local"}
    assert any("polynya.weights" in c for c in cycles(graph))


@pytest.mark.parametrize("low,high", [("polynya.kernels", "polynya.engines"),
                                      ("polynya.engines", "polynya.sync"),
                                      ("polynya.sync", "polynya.client"),
                                      ("polynya.config", "polynya.client")])
def test_layers_point_one_way(low, high):
    graph = import_graph()
    bad = sorted(f"{m} -> {t}" for m, ts in graph.items() for t in ts
                 if (m == low or m.startswith(low + ".")) and (t == high or t.startswith(high + ".")))
    assert not bad, f"{low} must not import {high}: " + ", ".join(bad)
