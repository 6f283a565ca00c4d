"""The planning side runs without a cluster (issue 39): ``omni/sim/`` and ``omni/step/`` reach no
process-group code through their imports, directly or through other modules (package
``__init__`` files included: importing ``a.b.c`` runs ``a`` and ``a.b`` first). Process-group code
is a module that creates process groups or device meshes, or imports torch's pipelining runtime
(which does at import). The graph is ``tests/test_import_graph.py``'s (function-local imports
included)."""
from __future__ import annotations

import ast

from tests.test_import_graph import _graph, _modules

PURE_ROOTS = ("omni.sim", "omni.step")
# What makes a module process-group code: a call that creates a group or a mesh, or an import
# of the pipelining package (its schedules and stages build on process groups).
GROUP_MAKERS = {"new_group", "new_subgroups", "init_process_group", "init_device_mesh", "DeviceMesh"}
PIPELINING = "torch.distributed.pipelining"


def _with_parents(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Each module also runs the ``__init__`` of every package above it."""
    out = {name: set(targets) for name, targets in graph.items()}
    for name in graph:
        parts = name.split(".")
        for i in range(1, len(parts)):
            parent = ".".join(parts[:i])
            if parent in graph:
                out[name].add(parent)
    return out


def _reached(graph: dict[str, set[str]], roots: list[str]) -> dict[str, str]:
    """Every module reached from ``roots``, with the module it was first reached from."""
    seen = {r: r for r in roots}
    todo = list(roots)
    while todo:
        node = todo.pop()
        for child in sorted(graph.get(node, ())):
            if child not in seen:
                seen[child] = node
                todo.append(child)
    return seen


def _path(seen: dict[str, str], node: str) -> list[str]:
    out = [node]
    while seen[out[-1]] != out[-1]:
        out.append(seen[out[-1]])
    return out[::-1]


def _makes_groups(source: str) -> bool:
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            f = node.func
            if (f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None) in GROUP_MAKERS:
                return True
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith(PIPELINING):
            return True
        elif isinstance(node, ast.Import) and any(a.name.startswith(PIPELINING) for a in node.names):
            return True
    return False


def process_group_modules() -> set[str]:
    return {name for name, path in _modules().items() if _makes_groups(path.read_text())}


def test_planning_reaches_no_process_group_code():
    graph = _with_parents(_graph())
    roots = [m for m in graph if m.startswith(PURE_ROOTS)]
    assert any(m.startswith("omni.sim") for m in roots)
    bad = process_group_modules()
    seen = _reached(graph, roots)
    found = sorted(m for m in seen if m in bad)
    assert not found, "\n".join(" -> ".join(_path(seen, m)) for m in found)


def test_the_check_sees_process_group_code():
    """The pattern finds the modules that do make groups (a check that found none would pass
    for the wrong reason)."""
    bad = process_group_modules()
    assert {"parallel.layout", "parallel.pipeline", "omni.multiplex.runtime"} <= bad
    assert "parallel.pipeline_schedule" not in bad  # pure: it names torch's pipelining in prose only
    assert _makes_groups("import torch.distributed.pipelining") and not _makes_groups("x = 'new_group('")
    graph = {"a": {"b"}, "b": {"c"}, "c": set(), "x.y": set(), "x": set()}
    assert _path(_reached(_with_parents(graph), ["a"]), "c") == ["a", "b", "c"]
    assert "x" in _reached(_with_parents(graph), ["x.y"])
