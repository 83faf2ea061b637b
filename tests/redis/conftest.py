"""Fixtures of the Redis backend suite.

The contract suite runs every test against three backends (``backend`` fixture):

- ``memory``: :class:`MemoryLockProvider` + :class:`MemoryIdempotencyStore` on a real-time
  clock that a test can push forward (:attr:`Backend.expire_lease`);
- ``redis-atomic``: :class:`RedisLockProvider` + :class:`RedisIdempotencyStore` on one client,
  so the guard claims and commits with one Lua script each;
- ``redis-split``: the same classes on two separate clients, with ``atomic_with`` switched off,
  so the guard calls the lock provider and the store one after the other (the path a user's
  own store takes). Both still share the Redis data.

Redis tests use the shared ``redis_url`` / ``key_prefix`` fixtures of ``tests/conftest.py``:
the private server of the session (or ``REDIS_URL``), every key under a per-test prefix.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from redis_support import (
    Backend,
    SkewClock,
    redis_classes,
    split_store,
)

from celery_idempotent import MemoryIdempotencyStore, MemoryLockProvider
from tests.support.counting import RoundTrips, counting_client

if TYPE_CHECKING:
    import redis


BACKENDS = [
    pytest.param("memory", id="memory"),
    pytest.param("redis-atomic", id="redis-atomic", marks=pytest.mark.redis),
    pytest.param("redis-split", id="redis-split", marks=pytest.mark.redis),
]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    """Each backend of the contract in turn (see the module docstring)."""
    name: str = request.param
    if name == "memory":
        clock = SkewClock()
        provider = MemoryLockProvider(clock=clock)
        yield Backend(
            name=name,
            provider=provider,
            store=MemoryIdempotencyStore(clock=clock),
            prefix="test:memory:",
            atomic=False,
            # Jumping an hour ahead ends every lease; records (kept a day) survive.
            expire_lease=lambda resource: clock.advance(3600.0),
        )
        return

    import redis

    url: str = request.getfixturevalue("redis_url")  # before key_prefix: it then cleans up
    prefix: str = request.getfixturevalue("key_prefix")
    lock_cls, store_cls = redis_classes()
    client = redis.Redis.from_url(url)
    clients = [client]
    provider = lock_cls(client, key_prefix=prefix)
    if name == "redis-atomic":
        store = store_cls(client)
    else:
        other = redis.Redis.from_url(url)
        clients.append(other)
        store = split_store(other)

    def expire_lease(resource: str) -> None:
        client.delete(resource)  # what PX does when the lease runs out

    try:
        yield Backend(
            name=name,
            provider=provider,
            store=store,
            prefix=prefix,
            atomic=name == "redis-atomic",
            expire_lease=expire_lease,
        )
    finally:
        for each in clients:
            each.close()


@pytest.fixture
def round_trips(redis_url: str) -> Iterator[tuple[RoundTrips, redis.Redis]]:
    """A :class:`RoundTrips` recorder and a client of ``redis_url`` that reports to it."""
    trips = RoundTrips()
    client = counting_client(redis_url, trips)
    try:
        yield trips, client
    finally:
        client.close()
