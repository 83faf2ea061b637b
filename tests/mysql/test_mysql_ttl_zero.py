"""``idempotency_ttl=0`` on MySQL / MariaDB (issue 24): the commit proves the row lock and
keeps nothing the next claim sees: the key runs again once the body ended, never twice at
the same time."""

from __future__ import annotations

import threading
import time
from typing import Any

from celery_idempotent import DistributedIdempotencyGuard


def make_guard(backend: Any, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("retry_base_delay", 0.01)
    return DistributedIdempotencyGuard(store=backend, lock_provider=backend, **options)


def test_ttl_zero_runs_again_once_the_body_ended(my_backend: Any) -> None:
    guard = make_guard(my_backend, ttl=0)
    calls: list[int] = []
    first = guard.run("k", lambda: calls.append(1) or len(calls))
    second = guard.run("k", lambda: calls.append(1) or len(calls))
    assert (first.value, first.replayed, second.value, second.replayed) == (1, False, 2, False)
    assert second.fencing_token > first.fencing_token
    assert my_backend.get(guard.record_key("k")) is None


def test_ttl_zero_never_runs_twice_at_the_same_time(my_backend: Any) -> None:
    my_backend.lock_timeout = 5.0
    guard = make_guard(my_backend, ttl=0, retry_count=0)
    running = threading.Event()
    spans: list[tuple[float, float]] = []

    def slow() -> str:
        start = time.monotonic()
        running.set()
        time.sleep(0.3)
        spans.append((start, time.monotonic()))
        return "first"

    def quick() -> str:
        spans.append((time.monotonic(), time.monotonic()))
        return "second"

    holder = threading.Thread(target=lambda: guard.run("k", slow))
    holder.start()
    assert running.wait(5)
    duplicate = guard.run("k", quick)  # waits on the row lock, then runs: nothing kept
    holder.join()
    assert (duplicate.value, duplicate.replayed) == ("second", False)
    (_, first_end), (second_start, _) = sorted(spans)
    assert first_end <= second_start
