"""A client clock an hour off (ahead or behind) changes nothing: leases end at a deadline in the
Redis server's time (kept in the lock, compared with its ``TIME``), record TTLs are the server's
``PX``, renewal runs on ``time.monotonic``, and the guard's ``clock`` only stamps records
(``created_at``).

The "dead holder" is a real process whose ``time.time`` is an hour off; it takes a lease and is
SIGKILLed inside its body: the lease must end ``lock_ttl`` after its claim by the server's clock.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    LockAcquisitionError,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from celery_idempotent.backends.redis import keyspace
from tests.faults.faultlib import record_figures

HOUR = 3600.0
SKEWS = [pytest.param(HOUR, id="ahead-1h"), pytest.param(-HOUR, id="behind-1h")]
FIGURES: dict[str, int] = {"skewed_guards": 0, "killed_holders": 0}


def lease_left_ms(client: redis.Redis, resource: str) -> int:
    """The ms a lock's lease has left by the server's clock (its deadline minus TIME)."""
    deadline = keyspace.parse_lock(client.get(resource).decode()).deadline_ms
    assert deadline is not None
    sec, usec = client.time()
    return deadline - (int(sec) * 1_000_000 + int(usec)) // 1000


def skewed_guard(
    client: redis.Redis, prefix: str, skew: float, **options: Any
) -> DistributedIdempotencyGuard:
    clock: Callable[[], float] = lambda: time.time() + skew  # noqa: E731
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client),
        lock_provider=RedisLockProvider(client),
        key_prefix=prefix,
        clock=clock,
        **options,
    )


@pytest.mark.parametrize("skew", SKEWS)
def test_record_ttl_and_lease_are_the_servers_and_replays_cross_skews(
    redis_client: redis.Redis, key_prefix: str, skew: float
) -> None:
    guard = skewed_guard(redis_client, key_prefix, skew, ttl=30, lock_ttl=2)
    other = skewed_guard(redis_client, key_prefix, -skew, ttl=30, lock_ttl=2)
    plain = skewed_guard(redis_client, key_prefix, 0.0, ttl=30, lock_ttl=2)
    seen: dict[str, int] = {}

    def body() -> str:
        seen["lease_pttl"] = lease_left_ms(redis_client, guard.lock_resource("k"))
        return "v"

    before = time.time()
    assert guard.execute("k", body, input={"a": 1}) == "v"
    assert 0 < seen["lease_pttl"] <= 2000
    record_pttl = int(redis_client.pttl(guard.record_key("k")))
    assert 29_000 < record_pttl <= 30_000, f"record TTL {record_pttl} ms is not the server's"
    # replays work from a guard skewed the other way and from an unskewed one
    assert other.execute("k", lambda: "again", input={"a": 1}) == "v"
    assert plain.execute("k", lambda: "again", input={"a": 1}) == "v"
    # the guard's clock stamps the record, and only that
    record = plain.store.get(plain.record_key("k"))
    assert record is not None
    assert abs(record.created_at - (before + skew)) < 5
    FIGURES["skewed_guards"] += 1


@pytest.mark.slow
@pytest.mark.parametrize("skew", SKEWS)
def test_a_long_body_keeps_its_lease_under_a_skewed_clock(
    redis_client: redis.Redis, key_prefix: str, skew: float
) -> None:
    """Renewal is driven by ``time.monotonic``: a body 2.4x its lease keeps the key."""
    guard = skewed_guard(redis_client, key_prefix, skew, lock_ttl=1.0, retry_count=0)
    rival = skewed_guard(redis_client, key_prefix, -skew, lock_ttl=1.0, retry_count=0)
    refused: list[bool] = []

    def body() -> str:
        for _ in range(3):
            time.sleep(0.8)
            with pytest.raises(LockAcquisitionError):
                rival.execute("long", lambda: "rival")
            refused.append(True)
        return "holder"

    assert guard.execute("long", body) == "holder"
    assert refused == [True, True, True]
    assert rival.execute("long", lambda: "rival") == "holder"


HOLDER = textwrap.dedent(
    """
    import sys, time
    url, prefix, skew, ready = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
    # The whole process's wall clock is off, before anything reads it; monotonic is not.
    _real_time = time.time
    time.time = lambda: _real_time() + skew
    import redis
    from celery_idempotent import (
        DistributedIdempotencyGuard, RedisIdempotencyStore, RedisLockProvider,
    )
    client = redis.Redis.from_url(url)
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client), lock_provider=RedisLockProvider(client),
        key_prefix=prefix, lock_ttl=1.5,
    )
    def body():
        open(ready, "w").close()
        time.sleep(60)  # killed in here
    guard.execute("dead", body)
    """
)


@pytest.mark.slow
@pytest.mark.parametrize("skew", SKEWS)
def test_a_killed_holders_lease_ends_on_the_servers_schedule(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, skew: float, tmp_path: Path
) -> None:
    ready = tmp_path / "ready"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, redis_url, key_prefix, str(skew), str(ready)],
    )
    try:
        deadline = time.monotonic() + 15
        while not ready.exists():
            assert holder.poll() is None, "the holder died before its body"
            assert time.monotonic() < deadline, "the holder never reached its body"
            time.sleep(0.02)
        holder.kill()
        holder.wait(5)
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(5)
    killed_at = time.monotonic()
    guard = skewed_guard(redis_client, key_prefix, -skew, lock_ttl=1.5, retry_count=0)
    resource = guard.lock_resource("dead")
    pttl = lease_left_ms(redis_client, resource)
    assert 0 < pttl <= 1500, f"the dead holder's lease has {pttl} ms left: not the server's"
    with pytest.raises(LockAcquisitionError):
        guard.execute("dead", lambda: "too early")
    while guard.lock_provider.is_locked(resource):  # (its lock stays a while, as a tombstone)
        assert time.monotonic() - killed_at < 3, "the lease outlived lock_ttl"
        time.sleep(0.02)
    assert guard.execute("dead", lambda: "after expiry") == "after expiry"
    FIGURES["killed_holders"] += 1
    record_figures("clock skew (guard clock +-1 h)", **FIGURES, leases_broken=0)
