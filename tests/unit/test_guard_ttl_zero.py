"""``ttl=0`` (``idempotency_ttl=0``, SPEC §8): nothing is remembered once the body ends.

Never twice at the same time (the lease still serializes callers), again afterwards (no
record: the next call runs the body). On the memory backends (the two-step path every
backend without an atomic pair takes); tests/redis runs the Redis script, tests/postgres the
PostgreSQL backend.
"""

from __future__ import annotations

import datetime as dt
import threading
import time
from collections.abc import Callable

import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    LockAcquisitionError,
    LockLostError,
    MemoryIdempotencyStore,
    MemoryLockProvider,
)


def test_ttl_zero_runs_again_once_the_body_ended(
    make_guard: Callable[..., DistributedIdempotencyGuard], store: MemoryIdempotencyStore
) -> None:
    guard = make_guard(ttl=0)
    calls: list[int] = []
    assert guard.execute("k", lambda: calls.append(1) or len(calls)) == 1
    assert guard.execute("k", lambda: calls.append(1) or len(calls)) == 2
    assert calls == [1, 1]
    assert store.get(guard.record_key("k")) is None  # nothing kept
    assert not guard.lock_provider.is_locked(guard.lock_resource("k"))


def test_ttl_zero_accepts_zero_in_every_form(
    make_guard: Callable[..., DistributedIdempotencyGuard],
) -> None:
    for zero in (0, 0.0, dt.timedelta(0)):
        assert make_guard(ttl=zero).ttl == 0
    with pytest.raises(ValueError, match=r"ttl must be 0 .* got -1"):
        make_guard(ttl=-1)


def test_ttl_zero_never_runs_twice_at_the_same_time() -> None:
    """Real threads: while one body runs, a second caller of the key is refused (or waits);
    it runs once the first ended, never beside it."""
    guard = DistributedIdempotencyGuard(
        store=MemoryIdempotencyStore(),
        lock_provider=MemoryLockProvider(),
        ttl=0,
        retry_count=200,
        retry_base_delay=0.01,
        retry_max_delay=0.02,
    )
    inside = threading.Event()
    running = 0
    peak = 0
    spans: list[tuple[float, float]] = []
    lock = threading.Lock()

    def body() -> str:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        start = time.monotonic()
        inside.set()
        time.sleep(0.2)
        with lock:
            running -= 1
            spans.append((start, time.monotonic()))
        return "done"

    first = threading.Thread(target=lambda: guard.execute("k", body))
    first.start()
    assert inside.wait(5)
    results: list[str] = []
    seconds = [threading.Thread(target=lambda: results.append(guard.execute("k", body)))]
    for thread in seconds:
        thread.start()
    for thread in [first, *seconds]:
        thread.join(10)
    assert results == ["done"]
    assert peak == 1
    assert len(spans) == 2  # both ran: the second after the first, nothing was replayed
    (_, a_end), (b_start, _) = sorted(spans)
    assert a_end <= b_start


def test_ttl_zero_a_held_key_still_refuses(
    make_guard: Callable[..., DistributedIdempotencyGuard], provider: MemoryLockProvider
) -> None:
    guard = make_guard(ttl=0, retry_count=0)
    lease = provider.acquire(guard.lock_resource("k"), 10)
    assert lease is not None
    with pytest.raises(LockAcquisitionError):
        guard.execute("k", lambda: "never")


def test_ttl_zero_lost_lease_is_still_reported(
    make_guard: Callable[..., DistributedIdempotencyGuard], provider: MemoryLockProvider
) -> None:
    """With nothing to store, the commit still proves the lease: a body that lost it (another
    holder took the key) raises LockLostError with its result, as with a TTL."""
    guard = make_guard(ttl=0)

    def body() -> str:
        provider.clear()  # the lease is gone (an operator, an expiry): another may hold it
        assert provider.acquire(guard.lock_resource("k"), 10) is not None
        return "ran"

    with pytest.raises(LockLostError) as caught:
        guard.execute("k", body)
    assert caught.value.result == "ran"
