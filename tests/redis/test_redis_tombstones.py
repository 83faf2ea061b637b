"""Fencing across the end of a lease (issue 13): the lock outlives its lease as a tombstone.

A lease ends at a deadline kept in the lock's value (``<deadline ms>/<fencing token>/<token>``),
compared with the server's TIME; the lock's key lives ``keyspace.FENCE_MARGIN_MS`` longer (and
at least until the server clock has passed the token by that margin), so the next claim is
floored by the last token even if the server clock stepped back after the lease ended.

A shared Redis cannot have its clock stepped back; what a step leaves behind can be made: a
lease whose fencing token is ahead of the server clock (a claim made while the clock read
later). These tests make it the way the scripts do (a fence key ahead of the clock floors the
claim), then delete the fence key by hand, so that only the lock's tombstone is left to floor
the next token. The simulation (tests/sim/test_fence_bound.py) steps a server clock for real.
"""

from __future__ import annotations

import time

import pytest
import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyRecord,
    Lease,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_lease,
)
from celery_idempotent.admin import forget_key, read_key, status_of
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis import scripts as redis_scripts

pytestmark = pytest.mark.redis

HOUR_US = 3600 * 1_000_000
MARGIN = keyspace.FENCE_MARGIN_MS


def server_us(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def lock_state(client: redis.Redis, resource: str) -> keyspace.LockState:
    raw = client.get(resource)
    assert raw is not None, f"{resource} does not exist"
    return keyspace.parse_lock(raw.decode())


def ahead_lease(provider: RedisLockProvider, resource: str, lease: float) -> Lease:
    """Take ``resource`` with a fencing token an hour ahead of the server clock (what a claim
    made before the clock stepped back an hour holds), then drop the fence key that floored it:
    from then on only the lock carries the token."""
    client = provider.client
    fence = provider.fence_key(resource)
    client.set(fence, str(server_us(client) + HOUR_US), px=3_600_000)
    taken = provider.acquire(resource, lease)
    assert taken is not None
    assert taken.fencing_token > server_us(client) + HOUR_US - 60_000_000
    client.delete(fence)
    return taken


@pytest.fixture
def provider(redis_client: redis.Redis, key_prefix: str) -> RedisLockProvider:
    return RedisLockProvider(redis_client, key_prefix=key_prefix)


def test_a_released_lease_leaves_a_tombstone_that_keeps_its_token(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    res = f"{key_prefix}lock:{{k}}"
    lease = provider.acquire(res, 30)
    assert lease is not None
    assert provider.release(lease)
    assert not provider.is_locked(res)
    assert provider.holder(res) is None
    state = lock_state(redis_client, res)
    assert state.deadline_ms == 0  # ended for good: no clock step revives it
    assert state.fencing_token == lease.fencing_token
    assert MARGIN - 1_000 < redis_client.pttl(res) <= MARGIN
    assert not redis_client.exists(provider.fence_key(res))
    # The ended lease can neither be released, renewed nor committed again.
    assert not provider.release(lease)
    assert not provider.extend(lease, 30)
    nxt = provider.acquire(res, 30)
    assert nxt is not None
    assert nxt.fencing_token > lease.fencing_token


def test_a_release_behind_the_clock_keeps_the_token_until_the_clock_passes_it(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    res = f"{key_prefix}lock:{{k}}"
    lease = ahead_lease(provider, res, 30)
    assert provider.release(lease)
    redis_client.delete(provider.fence_key(res))  # only the tombstone is left
    assert redis_client.pttl(res) > 3_600_000  # until the clock passes the token, + margin
    nxt = provider.acquire(res, 30)
    assert nxt is not None
    assert nxt.fencing_token > lease.fencing_token


def test_an_expired_lease_leaves_a_tombstone_and_its_holder_is_refused(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    store = RedisIdempotencyStore(redis_client)
    atomic = store.atomic_with(provider)
    assert atomic is not None
    res, rkey = f"{key_prefix}lock:{{k}}", f"{key_prefix}{{k}}"
    claim = atomic.claim(res, rkey, 0.05)
    zombie = claim.lease
    assert zombie is not None
    time.sleep(0.1)
    assert not provider.is_locked(res)
    state = lock_state(redis_client, res)  # the key outlives the lease
    assert state.fencing_token == zombie.fencing_token
    assert MARGIN - 1_000 < redis_client.pttl(res) <= MARGIN
    # The holder whose lease ran out gets nothing through, although its value is still there.
    record = IdempotencyRecord("late", None, time.time(), zombie.fencing_token)
    assert not atomic.commit(zombie, rkey, record, 60)
    assert not redis_client.exists(rkey)
    assert not provider.extend(zombie, 30)
    assert not provider.release(zombie)
    assert lock_state(redis_client, res).fencing_token == zombie.fencing_token
    # The next claim is floored by the tombstone.
    nxt = atomic.claim(res, rkey, 30)
    assert nxt.lease is not None
    assert nxt.lease.fencing_token > zombie.fencing_token


def test_an_expired_lease_ahead_of_the_clock_still_floors_the_next_token(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    """The lease's holder died; the lease expired. The lock stays until the clock has passed
    its token by the margin (an hour and a minute here), not just the lease."""
    res = f"{key_prefix}lock:{{k}}"
    dead = ahead_lease(provider, res, 0.05)
    assert redis_client.pttl(res) > 3_600_000
    time.sleep(0.1)
    assert not provider.is_locked(res)
    nxt = provider.acquire(res, 30)
    assert nxt is not None
    assert nxt.fencing_token > dead.fencing_token


def test_a_claim_resent_after_its_lease_ran_out_takes_a_new_token(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    """redis-py resends a script after a lost reply; if the lease ran out meanwhile, the
    tombstone holds the very same token, and the resent claim gets a new, higher one."""
    res = f"{key_prefix}lock:{{k}}"
    acquire = redis_client.register_script(redis_scripts.ACQUIRE)
    names = [res, provider.fence_key(res)]
    first = int(acquire(keys=names, args=["same@w", 50]))
    assert int(acquire(keys=names, args=["same@w", 50])) == first  # resent while valid
    time.sleep(0.1)
    second = int(acquire(keys=names, args=["same@w", 50]))
    assert second > first


def test_a_completed_key_is_still_one_redis_key(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client), lock_provider=provider, key_prefix=key_prefix
    )
    guard.execute("k", lambda: "v")
    left = {n.decode() for n in redis_client.scan_iter(match=f"{key_prefix}*", count=1000)}
    assert left == {guard.record_key("k")}


def test_a_failed_body_leaves_only_the_tombstone_and_the_next_run_is_above_it(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client), lock_provider=provider, key_prefix=key_prefix
    )
    seen: list[int] = []

    def fails() -> None:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.fencing_token)
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        guard.execute("k", fails)
    res = guard.lock_resource("k")
    assert not provider.is_locked(res)
    assert lock_state(redis_client, res).fencing_token == seen[0]
    assert not redis_client.exists(guard.record_key("k"))

    def ok() -> str:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.fencing_token)
        return "ok"

    assert guard.execute("k", ok) == "ok"
    assert seen[1] > seen[0]
    assert not redis_client.exists(res)  # the commit deletes the tombstone's successor


def test_admin_sees_a_tombstone_as_a_free_lock_and_forget_keeps_the_token(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client), lock_provider=provider, key_prefix=key_prefix
    )
    lease = provider.acquire(guard.lock_resource("failed"), 30)
    assert lease is not None
    assert provider.release(lease)
    info = read_key(redis_client, key_prefix, "failed")
    assert info.lock_token is None
    assert status_of(info).state == "absent"

    held = provider.acquire(guard.lock_resource("held"), 7)
    assert held is not None
    info = read_key(redis_client, key_prefix, "held")
    assert info.lock_token == held.token  # the lease token, without the deadline
    assert info.lock_ttl is not None
    assert 6 < info.lock_ttl <= 7
    assert status_of(info).state == "running"

    outcome = guard.run("done", lambda: "v")
    info = read_key(redis_client, key_prefix, "done")
    forgotten = forget_key(redis_client, info, force=False)
    assert forgotten.deleted == (guard.record_key("done"),)
    assert status_of(read_key(redis_client, key_prefix, "done")).state == "absent"
    # The record's token stays in a tombstone: the key's next run is above it.
    state = lock_state(redis_client, guard.lock_resource("done"))
    assert state.fencing_token == outcome.fencing_token
    assert guard.run("done", lambda: "again").fencing_token > outcome.fencing_token


def test_a_publish_over_a_tombstone_sets_its_marker(
    provider: RedisLockProvider, redis_client: redis.Redis, key_prefix: str
) -> None:
    store = RedisIdempotencyStore(redis_client)
    res, rkey = f"{key_prefix}lock:{{k}}", f"{key_prefix}{{k}}"
    lease = provider.acquire(res, 30)
    assert lease is not None
    assert store.check_publish(rkey, res, "t1", None, 30).unchecked  # running: unchecked
    assert provider.release(lease)
    decision = store.check_publish(rkey, res, "t2", None, 30)
    assert decision.action == "publish"
    assert not decision.unchecked
    assert keyspace.parse_queued(redis_client.get(rkey)) == ("t2", None)
