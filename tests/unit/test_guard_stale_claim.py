"""A claim whose reply comes after its lease ran out never runs the body under that lease.

Under gevent or eventlet a body that blocks the event loop also holds the greenlet waiting for
another key's claim reply: Redis took the lock, the lease runs out, and only then does the
guard learn its token. It checks such a late lease (one extend) before the body may run.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    MemoryIdempotencyStore,
    MemoryLockProvider,
)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class LateFirstReply(MemoryLockProvider):
    """The first acquire's reply 'arrives' after the lease ran out (the clock jumps)."""

    def __init__(self, clock: Clock, late_by: float) -> None:
        super().__init__(clock=clock)
        self.moving = clock
        self.late_by = late_by
        self.acquires = 0
        self.extends = 0

    def acquire(self, resource: str, ttl: float) -> Any:
        lease = super().acquire(resource, ttl)
        self.acquires += 1
        if self.acquires == 1:
            self.moving.now += self.late_by
        return lease

    def extend(self, lease: Any, ttl: float) -> bool:
        self.extends += 1
        return super().extend(lease, ttl)


def guard_for(provider: MemoryLockProvider, clock: Clock) -> DistributedIdempotencyGuard:
    return DistributedIdempotencyGuard(
        store=MemoryIdempotencyStore(clock=clock),
        lock_provider=provider,
        lock_ttl=3,
        retry_count=2,
        retry_base_delay=0,
        clock=clock,
    )


def test_a_lease_that_ran_out_before_its_reply_is_claimed_again(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    provider = LateFirstReply(clock, late_by=3.5)  # longer than the 3 s lease
    guard = guard_for(provider, clock)
    runs: list[int] = []
    with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
        outcome = guard.run("k", lambda: runs.append(provider.extends) or "done")
    assert outcome.value == "done"
    assert runs == [1]  # ran once, after one check (of the late lease; none of the fresh one)
    assert outcome.attempts == 2  # the late lease counted as an attempt, the next one ran it
    assert provider.acquires == 2
    lines = [r.getMessage() for r in caplog.records]
    assert any("answered 3.50s after it was sent" in line for line in lines), lines


def test_a_slow_reply_whose_lease_still_holds_runs_the_body_at_once() -> None:
    clock = Clock()
    provider = LateFirstReply(clock, late_by=1.5)  # past the renewal interval, within the lease
    guard = guard_for(provider, clock)
    before_body: list[int] = []
    assert guard.run("k", lambda: before_body.append(provider.extends)).attempts == 1
    assert provider.acquires == 1
    assert before_body == [1]  # checked once, and it was still ours
