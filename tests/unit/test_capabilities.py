"""The adapter asks a backend for a capability, never whether it is a Redis class (issue 28).

Outside ``backends/redis`` no module tests an object with ``isinstance`` / ``issubclass``
against a class it imported from the Redis package: what the Celery adapter, the admin layer
and the command line need of a store is a ``Protocol`` of ``core/protocols.py`` (checks
publishes, checks them until started, keeps claimed markers, ends a marker at claim, inspects
keys), which another backend can implement too. The scan reads every module's AST, so an
import under ``TYPE_CHECKING`` or inside a function counts as well.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from celery_idempotent import MemoryIdempotencyStore
from celery_idempotent.backends.redis.store import RedisAtomicBackend, RedisIdempotencyStore
from celery_idempotent.core import protocols
from tests.unit.test_layers import MODULES, PACKAGE

REDIS = "celery_idempotent.backends.redis"


def _redis_names(tree: ast.AST) -> set[str]:
    """The local names a module binds to the Redis package or anything imported from it."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(REDIS):
            names.update(alias.asname or alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module == "celery_idempotent.backends":
            names.update(
                alias.asname or alias.name for alias in node.names if alias.name == "redis"
            )
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith(REDIS):
                    names.add(alias.asname or alias.name.split(".")[0])
    return names


def _root(node: ast.expr) -> str | None:
    """The name an expression (``a``, ``a.b.C``) starts from."""
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


def redis_class_checks(source: str) -> list[str]:
    """``isinstance`` / ``issubclass`` calls in ``source`` whose class argument names
    something imported from the Redis package (each as ``line: text``)."""
    tree = ast.parse(source)
    redis_names = _redis_names(tree)
    found = []
    for node in ast.walk(tree):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in {"isinstance", "issubclass"}
            and len(node.args) == 2
        ):
            continue
        classes = node.args[1]
        members = classes.elts if isinstance(classes, ast.Tuple) else [classes]
        if any(_root(member) in redis_names for member in members):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_scan_finds_an_isinstance_of_a_redis_class() -> None:
    # What the adapter did before: each form the scan must see.
    assert redis_class_checks(
        "from celery_idempotent.backends.redis.store import RedisIdempotencyStore\n"
        "x = isinstance(store, RedisIdempotencyStore)\n"
    ) == ["2: isinstance(store, RedisIdempotencyStore)"]
    assert redis_class_checks(
        "from celery_idempotent.backends.redis import store as s\n"
        "x = isinstance(b, (int, s.RedisAtomicBackend))\n"
    )
    assert redis_class_checks(
        "def f(b):\n"
        "    from celery_idempotent.backends import redis\n"
        "    return issubclass(b, redis.store.RedisIdempotencyStore)\n"
    )
    assert redis_class_checks(
        "import celery_idempotent.backends.redis.store\n"
        "x = isinstance(b, celery_idempotent.backends.redis.store.RedisIdempotencyStore)\n"
    )
    # A capability, or a Redis class only built (the factory), is not a check.
    assert not redis_class_checks(
        "from celery_idempotent.backends.redis.store import RedisIdempotencyStore\n"
        "from celery_idempotent.core.protocols import InspectsKeys\n"
        "store = RedisIdempotencyStore(client)\n"
        "x = isinstance(store, InspectsKeys)\n"
    )


def test_no_module_outside_the_redis_package_checks_for_a_redis_class() -> None:
    redis_dir = PACKAGE / "backends" / "redis"
    found = {}
    for module, path in sorted(MODULES.items()):
        if Path(path).is_relative_to(redis_dir):
            continue
        checks = redis_class_checks(Path(path).read_text(encoding="utf-8"))
        if checks:
            found[module] = checks
    assert not found, (
        "ask for a capability (a Protocol of celery_idempotent/core/protocols.py), not for a "
        f"Redis class: {found}"
    )


@pytest.mark.parametrize(
    ("capability", "redis_class"),
    [
        (protocols.ChecksPublishes, RedisIdempotencyStore),
        (protocols.ChecksPublishesUntil, RedisIdempotencyStore),
        (protocols.KeepsClaimedMarkers, RedisIdempotencyStore),
        (protocols.InspectsKeys, RedisIdempotencyStore),
        (protocols.EndsMarkerAtClaim, RedisAtomicBackend),
    ],
)
def test_the_redis_backend_has_each_capability_it_used_to_be_asked_for_by_class(
    capability: type, redis_class: type
) -> None:
    # Each capability is a method the Redis class has (runtime_checkable: the names count),
    # and the memory store, which has none of them, is not taken for it.
    for name in protocols.required_methods(capability):
        assert callable(getattr(redis_class, name, None)), (capability.__name__, name)
    assert not isinstance(MemoryIdempotencyStore(), capability)
