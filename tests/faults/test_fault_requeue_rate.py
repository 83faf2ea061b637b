"""How often a duplicate waiting on a held key is re-published (the re-queue countdown).

A duplicate that finds its key held is re-queued with a countdown that doubles up to a minute
(it was capped at 5 s). A real worker shows that the deliveries of one duplicate, while its
key stays held for 8 s, follow the schedule; the messages per waiting duplicate per hour,
before and after, are computed from that same schedule.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_idempotent import RedisLockProvider
from celery_idempotent.backends.redis.keyspace import lock_name
from celery_idempotent.celery.task import MAX_REQUEUE_COUNTDOWN, requeue_countdown
from tests.faults.faultlib import counter, fault_env, record_figures
from tests.support.redis_server import RedisServer

LOCK_TTL = 2.0


def requeue_rate(server: RedisServer, window: float) -> dict[str, Any]:
    """One duplicate delivered while its key is held (by this process, renewing the lease)
    for ``window`` seconds: how many times it was re-published, against the schedule."""
    with fault_env(broker=server, idem_url=server.url_for(db=0), lock_ttl=LOCK_TTL) as env:
        queue = "requeue-rate"
        env.start_worker(concurrency=1, queue=queue, pool="solo")
        provider = RedisLockProvider(env.idem)
        resource = lock_name(env.prefix, "faults.work:key:work:0")
        lease = provider.acquire(resource, LOCK_TTL)
        assert lease is not None
        result = env.app.tasks["faults.work"].apply_async((0, 0.05), queue=queue)
        until = time.monotonic() + window
        while time.monotonic() < until:
            assert provider.extend(lease, LOCK_TTL)
            time.sleep(0.3)
        # every delivery of the duplicate found the key held (3 attempts each)
        delivered_in_window = counter(env.marks, env.ns, "deliveries")
        assert counter(env.marks, env.ns, "contentions") >= delivered_in_window
        assert provider.release(lease)
        assert result.get(timeout=90)["n"] == 0
        return {"window": window, "deliveries_held": delivered_in_window}


def deliveries_within(window: float, cap: float, jitter: float) -> int:
    """Deliveries of a duplicate whose key stays held for ``window`` seconds, if every
    countdown's jitter were ``jitter`` (0: shortest waits, 1: longest)."""
    at, n = 0.0, 0
    while at <= window:
        n += 1
        at += requeue_countdown(n - 1, 0.05, jitter, cap)
    return n


def per_hour(cap: float, base: float = 0.05, hours: int = 200) -> float:
    """Mean re-publications of a duplicate waiting an hour (the schedule with random jitter)."""
    rng = random.Random(5)
    total = 0
    for _ in range(hours):
        at, n = 0.0, 0
        while at < 3600:
            at += requeue_countdown(n, base, rng.random(), cap)
            n += 1
        total += n
    return total / hours


@pytest.mark.worker
@pytest.mark.timeout(120)
def test_a_waiting_duplicate_is_re_published_as_the_schedule_says(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    window = 8.0
    measured = requeue_rate(redis_server_factory(), window)
    # Give or take the jitter (and one delivery of slack for a busy worker).
    fewest = deliveries_within(window, MAX_REQUEUE_COUNTDOWN, 1.0) - 1
    most = deliveries_within(window, MAX_REQUEUE_COUNTDOWN, 0.0)
    assert fewest <= measured["deliveries_held"] <= most, (measured, fewest, most)
    before = per_hour(cap=5.0)  # the countdown's cap until this release (lock_ttl >= 5 s)
    after = per_hour(cap=MAX_REQUEUE_COUNTDOWN)
    assert after < before / 8
    record_figures(
        "re-queues of a duplicate waiting on a held key",
        deliveries_in_window=measured["deliveries_held"],
        window_seconds=window,
        schedule_bounds=f"{fewest}-{most}",
        messages_per_hour_before=round(before),
        messages_per_hour_after=round(after),
    )


def test_the_schedule_counts_are_not_vacuous() -> None:
    """The bounds above come from the real countdown: a 5 s cap would give more deliveries."""
    assert deliveries_within(60.0, 5.0, 0.0) > deliveries_within(60.0, 60.0, 0.0)
    assert deliveries_within(12.0, 60.0, 1.0) <= deliveries_within(12.0, 60.0, 0.0)
    assert 700 < per_hour(cap=5.0) < 1500
    assert per_hour(cap=60.0) < 120
