"""The layers of ARCHITECTURE.md hold in the imports: no cycle between units, and a core that
imports no other unit.

Every ``import`` in every module counts, wherever it is (a function body's lazy import, a
``TYPE_CHECKING`` block): a type-only import is still a dependency a reader has to follow. A
unit is ``core``, each backend (``backends.<name>``), the Celery adapter (``celery``), ``cli``,
``testing``, ``servers``, each ``contrib.<name>``, and each module at the package root on its
own (``keyspace``, ``settings``, ...; the package's ``__init__`` is one too).
"""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

import celery_idempotent

PACKAGE = Path(celery_idempotent.__file__).parent
NAME = "celery_idempotent"
#: Folders whose sub-packages are units of their own.
SPLIT = ("backends", "contrib")


def _modules() -> dict[str, Path]:
    found = {}
    for path in PACKAGE.rglob("*.py"):
        parts = [NAME, *path.relative_to(PACKAGE).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def unit_of(module: str) -> str:
    """The unit a module belongs to (see the module's docstring)."""
    parts = module.split(".")[1:]
    if not parts:
        return "__init__"
    if parts[0] in SPLIT and len(parts) > 1:
        return f"{parts[0]}.{parts[1]}"
    return parts[0]


def _imported(module: str, path: Path, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names]
    base = node.module or ""
    if node.level:
        package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
        package = package[: len(package) - node.level + 1]
        base = ".".join([*package, base] if base else package)
    # ``from pkg import mod`` imports the module ``pkg.mod`` when there is one.
    return [
        f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
        for alias in node.names
    ]


def _owning_module(name: str) -> str | None:
    while name not in MODULES:
        if "." not in name:
            return None
        name = name.rsplit(".", 1)[0]
    return name


def import_graph() -> dict[str, dict[str, list[str]]]:
    """``{unit: {imported unit: ["module -> module", ...]}}`` over every import statement."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _imported(module, path, node):
                target = _owning_module(name) if name.split(".")[0] == NAME else None
                if target is None:
                    continue
                source_unit, target_unit = unit_of(module), unit_of(target)
                if source_unit != target_unit:
                    graph[source_unit][target_unit].append(f"{module} -> {target}")
    return graph


def find_cycle(edges: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the directed graph ``edges`` (its nodes, the first repeated last), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(edges.get(node, ())):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)) is not None:
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(edges):
        if node not in state and (found := visit(node)) is not None:
            return found
    return None


def test_the_walk_sees_the_layers_it_checks() -> None:
    graph = import_graph()
    # The walk resolves what the package really imports (relative, lazy, type-only, submodule).
    assert "core" in graph["backends.redis"]
    assert (
        "celery_idempotent.backends.redis.store -> celery_idempotent.core.protocols"
        in (graph["backends.redis"]["core"])
    )
    assert "backends.redis" in graph["celery"]
    assert {unit_of(m) for m in MODULES} >= {
        "core",
        "celery",
        "cli",
        "testing",
        "servers",
        "keyspace",
        "backends.memory",
        "backends.redis",
        "backends.postgres",
        "contrib.django",
    }


def test_the_cycle_finder_finds_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"c"}, "d": {"a", "c"}}) is None


def test_no_import_cycle_between_units() -> None:
    graph = import_graph()
    cycle = find_cycle({unit: set(targets) for unit, targets in graph.items()})
    if cycle is not None:
        why = [f"  {a} -> {b}: " + "; ".join(graph[a][b][:3]) for a, b in zip(cycle, cycle[1:])]
        raise AssertionError(
            "import cycle between units " + " -> ".join(cycle) + "\n" + "\n".join(why)
        )


def test_the_core_imports_no_other_unit() -> None:
    outside = dict(import_graph()["core"])
    assert not outside, f"the core imports {sorted(outside)}: {outside}"
