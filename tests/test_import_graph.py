"""The project's import graph (issue 39), function-local imports included and ``if TYPE_CHECKING:``
ones not (they never run): the one-way flow of DESIGN.md holds (``dataloading/`` and ``parallel/``
import nothing from ``omni/``, nor each other; ``dataloading``'s parts import only the parts before
them in ``DATALOADING_ORDER``), and no module reaches itself through its imports (no circle; a
failure lists them)."""
from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("omni", "dataloading", "parallel", "recipes")
MAX_CIRCLES = 0  # 6 when issue 39 was filed
# dataloading's parts (sub-packages and top-level modules) in their one order: a part may import
# the parts before it and itself, never one after it (dataloading/__init__.py says what each holds).
DATALOADING_ORDER = ("errors", "config", "processes", "formats", "index", "convert", "plan", "construct", "serve",
                     "demo")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (REPO / pkg).rglob("*.py"):
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _imports(name: str, path: Path, known: dict[str, Path]) -> set[str]:
    """Project modules ``name`` imports anywhere in its file (top level or inside functions)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    tree = ast.parse(path.read_text(), str(path))
    typing_only = {id(n) for block in ast.walk(tree) if _is_type_checking(block)
                   for stmt in block.body for n in ast.walk(stmt)}  # annotations: never run
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from a.b import c``: the submodule a.b.c if there is one, else a.b itself
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in known:  # ``import a.b.c`` of a name inside a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def _is_type_checking(node) -> bool:
    """``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    if not isinstance(node, ast.If):
        return False
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _graph() -> dict[str, set[str]]:
    known = _modules()
    return {name: _imports(name, path, known) for name, path in known.items()}


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index, low, stack, on_stack, out, counter = {}, {}, [], set(), [], [0]
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = counter[0]
                    counter[0] += 1
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
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return sorted(out)


def test_the_flow_runs_one_way():
    graph = _graph()
    wrong = [(a, b) for a, targets in graph.items() for b in targets
             if (a.startswith(("dataloading", "parallel")) and b.startswith("omni"))
             or (a.startswith("dataloading") and b.startswith("parallel"))
             or (a.startswith("parallel") and b.startswith("dataloading"))]
    assert not wrong, wrong


def _dataloading_part(module: str) -> str | None:
    """``dataloading.plan.cost`` -> "plan"; None for the package root (its lazy re-exports are
    no import edges) and anything outside dataloading."""
    parts = module.split(".")
    return parts[1] if parts[0] == "dataloading" and len(parts) > 1 else None


def _against_order(graph: dict[str, set[str]], order: tuple[str, ...]) -> list[tuple[str, str]]:
    """The imports from a dataloading part to a part after it in ``order``."""
    rank = {p: i for i, p in enumerate(order)}
    return sorted((a, b) for a, targets in graph.items() for b in targets
                  if _dataloading_part(a) and _dataloading_part(b)
                  and rank[_dataloading_part(b)] > rank[_dataloading_part(a)])


def test_dataloading_parts_run_one_way():
    graph = _graph()
    parts = {_dataloading_part(m) for m in graph} - {None}
    assert parts == set(DATALOADING_ORDER), f"parts not in DATALOADING_ORDER: {sorted(parts ^ set(DATALOADING_ORDER))}"
    wrong = _against_order(graph, DATALOADING_ORDER)
    assert not wrong, "a dataloading part imports one after it in DATALOADING_ORDER:\n" + "\n".join(
        f"{a} -> {b}" for a, b in wrong)


def test_the_order_check_finds_imports_against_the_order():
    graph = {"dataloading.plan.planner": {"dataloading.formats.media", "dataloading.serve.loader", "omni.x"},
             "dataloading.plan.cost": {"dataloading.plan.balance", "dataloading.errors"},
             "dataloading": {"dataloading.serve.loader"}}
    assert _against_order(graph, ("errors", "formats", "plan", "serve")) == [
        ("dataloading.plan.planner", "dataloading.serve.loader")]


def test_no_import_circles():
    circles = _circles(_graph())
    listing = "\n".join(" <-> ".join(c) for c in circles)
    assert len(circles) <= MAX_CIRCLES, f"{len(circles)} import circles:\n{listing}"


def test_the_circle_finder_finds_circles():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert _circles(graph) == [["a", "b", "c"], ["e", "f"]]
