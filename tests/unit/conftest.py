"""Fixtures for the framework-free unit suite: fake time, memory backends, a guard factory.

Nothing here starts Celery or Redis. Time is faked wherever a test is about time (expiry,
back-off); real threads and short real sleeps are used only where the subject is concurrency
or lease renewal, which runs on its own thread.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    MemoryIdempotencyStore,
    MemoryLockProvider,
)


class FakeClock:
    """A clock that only moves when told to; callable like ``time.monotonic``."""

    def __init__(self, now: float = 1_000.0) -> None:
        self.now = now
        self._lock = threading.Lock()

    def __call__(self) -> float:
        with self._lock:
            return self.now

    def advance(self, seconds: float) -> None:
        with self._lock:
            self.now += seconds


class SleepRecorder:
    """A fake ``sleep(delay, abort)``: records each delay and never really waits.

    ``hook(call_index, abort)`` runs on each call (to set an abort event mid-back-off, or
    to release a lock). Returns what the real one returns: whether ``abort`` is set.
    """

    def __init__(self) -> None:
        self.delays: list[float] = []
        self.aborts: list[Any] = []
        self.hook: Callable[[int, Any], None] | None = None

    def __call__(self, delay: float, abort: Any) -> bool:
        self.delays.append(delay)
        self.aborts.append(abort)
        if self.hook is not None:
            self.hook(len(self.delays) - 1, abort)
        return abort is not None and abort.is_set()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def sleeps() -> SleepRecorder:
    return SleepRecorder()


@pytest.fixture
def provider() -> MemoryLockProvider:
    return MemoryLockProvider()


@pytest.fixture
def store() -> MemoryIdempotencyStore:
    return MemoryIdempotencyStore()


@pytest.fixture
def make_guard(
    store: MemoryIdempotencyStore, provider: MemoryLockProvider, sleeps: SleepRecorder
) -> Callable[..., DistributedIdempotencyGuard]:
    """Build a guard over the ``store`` and ``provider`` fixtures; keywords override.

    Back-off sleeps go to the ``sleeps`` recorder unless a test passes ``sleep=``.
    """

    def make(**options: Any) -> DistributedIdempotencyGuard:
        options.setdefault("store", store)
        options.setdefault("lock_provider", provider)
        options.setdefault("sleep", sleeps)
        return DistributedIdempotencyGuard(**options)

    return make


@pytest.fixture
def guard(make_guard: Callable[..., DistributedIdempotencyGuard]) -> DistributedIdempotencyGuard:
    return make_guard()
