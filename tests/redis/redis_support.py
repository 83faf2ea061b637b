"""Helpers of the Redis backend suite: the backends under contract (round trips are counted by
:mod:`tests.support.counting`).

Imported by ``conftest.py`` and the test modules of this directory as ``redis_support``
(pytest's ``prepend`` import mode puts ``tests/redis`` on ``sys.path``). Named so that it
cannot shadow anything: neither ``conftest`` nor ``redis``.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from celery_idempotent import DistributedIdempotencyGuard, IdempotencyStore, LockProvider
from celery_idempotent.core.two_step import TwoStepBackend

if TYPE_CHECKING:
    pass

T = TypeVar("T")


def recording(value: T, log: list[Any], entry: Callable[[], Any] | None = None) -> Callable[[], T]:
    """A body that appends ``entry()`` (``True`` by default) to ``log`` and returns ``value``."""

    def body() -> T:
        log.append(True if entry is None else entry())
        return value

    return body


class SkewClock:
    """``time.monotonic()`` plus an offset that only grows: real time that can jump ahead."""

    def __init__(self) -> None:
        self._offset = 0.0
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return time.monotonic() + self._offset

    def advance(self, seconds: float) -> None:
        with self._lock:
            self._offset += seconds


@dataclass
class Backend:
    """A lock provider and a store under test, and how to make a lease run out early."""

    name: str
    provider: LockProvider
    store: IdempotencyStore
    prefix: str
    atomic: bool
    #: Make the lease on ``resource`` run out now (as if its holder had stalled past it).
    expire_lease: Callable[[str], None]

    def guard(self, **options: Any) -> DistributedIdempotencyGuard:
        """A guard over this backend, under the test's key prefix; keywords override."""
        options.setdefault("store", self.store)
        options.setdefault("lock_provider", self.provider)
        options.setdefault("key_prefix", self.prefix)
        options.setdefault("retry_base_delay", 0.001)
        guard = DistributedIdempotencyGuard(**options)
        one_script = not isinstance(guard.backend, TwoStepBackend)
        assert one_script is self.atomic, f"{self.name}: wrong guard path"
        return guard


def redis_classes() -> tuple[type[Any], type[Any]]:
    """``(RedisLockProvider, RedisIdempotencyStore)``, imported only when a test needs them."""
    from celery_idempotent import RedisIdempotencyStore, RedisLockProvider

    return RedisLockProvider, RedisIdempotencyStore


def split_store(client: Any, **options: Any) -> Any:
    """A :class:`RedisIdempotencyStore` that never pairs with a lock provider (no atomic path)."""
    _, store_cls = redis_classes()

    class SplitRedisIdempotencyStore(store_cls):  # type: ignore[misc, valid-type]
        def atomic_with(self, lock_provider: Any) -> None:
            return None

    return SplitRedisIdempotencyStore(client, **options)
