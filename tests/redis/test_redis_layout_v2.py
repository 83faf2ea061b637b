"""Layout v2 (issue 13): one Redis key per completed key, an upgrade from 0.1.0 that runs no key
again, and fencing tokens that increase without a long-lived fence key.

The upgrade tests write keys the way 0.1.0 did, with its own scripts (``v1_layout.py``, copied
verbatim), then run the current code against them.

A server clock that steps backwards cannot be produced on a shared Redis; what a step leaves
behind can: a lease whose fencing token is ahead of the server clock, which is exactly what a
claim made while the clock read later leaves in the lock. The tests plant such leases (in the
lock's own format) and check that no later token falls below them, whatever ends the lease.
"""

from __future__ import annotations

import logging
import time

import pytest
import redis
import v1_layout
from redis_support import recording

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyMismatchError,
    IdempotencyRecord,
    Lease,
    LockAcquisitionError,
    MemoryLockProvider,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_lease,
    fingerprint_payload,
)
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.store import RedisAtomicBackend
from celery_idempotent.core.two_step import TwoStepBackend
from celery_idempotent.keyspace import task_key

pytestmark = pytest.mark.redis

HOUR_US = 3600 * 1_000_000


@pytest.fixture
def guard(redis_client: redis.Redis, key_prefix: str) -> DistributedIdempotencyGuard:
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client),
        lock_provider=RedisLockProvider(redis_client, key_prefix=key_prefix),
        key_prefix=key_prefix,
        retry_count=0,
        retry_base_delay=0.001,
    )


def names(client: redis.Redis, prefix: str) -> set[str]:
    return {n.decode() for n in client.scan_iter(match=prefix + "*", count=1000)}


def server_us(client: redis.Redis) -> int:
    sec, usec = client.time()
    return int(sec) * 1_000_000 + int(usec)


def token_seen(guard: DistributedIdempotencyGuard, key: str) -> int:
    """The fencing token of the next execution of ``key``'s body."""
    seen: list[int] = []

    def body() -> str:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.fencing_token)
        return "ran"

    guard.execute(key, body)
    return seen[0]


# --------------------------------------------------------------------------- one key


def test_a_completed_key_is_one_redis_key_that_lives_as_long_as_the_record(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis, key_prefix: str
) -> None:
    for index in range(20):
        guard.execute(f"k{index}", lambda: {"status": "ok"}, input={"order": index})
    left = names(redis_client, key_prefix)
    assert left == {guard.record_key(f"k{index}") for index in range(20)}
    for name in left:
        assert redis_client.type(name) == b"string"
        assert 86_000_000 < redis_client.pttl(name) <= 86_400_000


def test_the_record_string_holds_what_the_keyspace_says(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis
) -> None:
    seen: list[int] = []
    guard.execute("k", lambda: seen.append(current_lease().fencing_token) or 7, input=[1])  # type: ignore[union-attr]
    raw = redis_client.get(guard.record_key("k"))
    assert raw is not None
    fields = keyspace.decode_record(raw)
    assert fields.version == "2"
    assert fields.fencing_token == seen[0]
    assert fields.serializer == "json"
    assert fields.fingerprint == fingerprint_payload([1])
    assert fields.data == b"7"
    assert raw.startswith(keyspace.record_head(seen[0]).encode())


# --------------------------------------------------------------------------- upgrade from v1


class V1Worker:
    """What a 0.1.0 worker does to Redis, through 0.1.0's own scripts."""

    def __init__(self, client: redis.Redis, prefix: str) -> None:
        self.client = client
        self.prefix = prefix
        self.acquire = client.register_script(v1_layout.ACQUIRE)
        self.claim = client.register_script(v1_layout.CLAIM)
        self.commit = client.register_script(v1_layout.COMMIT)

    def names(self, key: str) -> tuple[str, str, str]:
        lock = f"{self.prefix}lock:{{{key}}}"
        return lock, f"{lock}:fence", f"{self.prefix}{{{key}}}"

    def hold(self, key: str, token: str, lease_ms: int = 30_000) -> int:
        lock, fence, record = self.names(key)
        reply = self.claim(keys=[lock, fence, record], args=[token, lease_ms, 7 * 86_400_000])
        assert int(reply[0]) == 1, reply
        return int(reply[1])

    def finish(self, key: str, token: str, fence: int, result: bytes, fp: str = "") -> None:
        lock, _, record = self.names(key)
        fields = ["1", "application/json", "utf-8", result, fp, repr(time.time()), str(fence)]
        assert self.commit(keys=[lock, record], args=[token, 86_400_000, *fields]) == 1

    def run(self, key: str, result: bytes, fp: str = "") -> int:
        token = f"v1token-{key}@old-worker"
        fence = self.hold(key, token)
        self.finish(key, token, fence, result, fp)
        return fence


def test_upgrade_live_v1_records_replay_and_a_held_v1_lock_is_respected(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis, key_prefix: str
) -> None:
    old = V1Worker(redis_client, key_prefix)
    fp = fingerprint_payload({"order": 1})
    v1_fences = [old.run(f"done-{i}", b'{"charged": %d}' % i, fp) for i in range(3)]
    held_fence = old.hold("running", "v1-holder@old-worker")

    # The new code, against what 0.1.0 left: every completed key replays, none runs.
    calls: list[bool] = []
    for index in range(3):
        outcome = guard.run(f"done-{index}", recording("again", calls), input={"order": 1})
        assert outcome.replayed
        assert outcome.value == {"charged": index}
        assert outcome.fencing_token == v1_fences[index]
    with pytest.raises(IdempotencyMismatchError):
        guard.execute("done-0", recording("again", calls), input={"order": 2})
    # A v1 lease in flight is someone else's lease: the duplicate does not run.
    with pytest.raises(LockAcquisitionError):
        guard.execute("running", recording("again", calls))
    assert calls == []
    assert RedisLockProvider(redis_client).is_locked(guard.lock_resource("running"))

    # The 0.1.0 worker finishes its body: the new code replays its result.
    old.finish("running", "v1-holder@old-worker", held_fence, b'"v1 result"')
    assert guard.execute("running", recording("again", calls)) == "v1 result"
    assert calls == []

    # The store alone reads v1 records too.
    record = guard.store.get(guard.record_key("done-2"))
    assert record is not None
    assert record.result == {"charged": 2}
    assert record.fingerprint == fp


def test_upgrade_tokens_stay_above_a_v1_fence(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A v1 fence key (kept 7 days) that is ahead of the clock floors the next v2 token."""
    old = V1Worker(redis_client, key_prefix)
    lock, fence, _ = old.names("k")
    ahead = server_us(redis_client) + HOUR_US
    redis_client.set(fence, str(ahead), px=7 * 86_400_000)  # as 0.1.0 left it
    assert token_seen(guard, "k") > ahead
    assert not redis_client.exists(lock)


def test_upgrade_an_expired_v1_lease_lets_the_key_run_once(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis, key_prefix: str
) -> None:
    old = V1Worker(redis_client, key_prefix)
    first = old.hold("k", "dead-v1@old-worker", lease_ms=50)
    time.sleep(0.1)
    calls: list[bool] = []
    assert guard.run("k", recording("new", calls)).fencing_token > first
    assert guard.execute("k", recording("again", calls)) == "new"
    assert calls == [True]


def test_upgrade_through_an_idempotent_task(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    """A task's v1 record (written under the task's own key) replays through apply()."""
    from celery import Celery

    from celery_idempotent import IdempotentTask
    from celery_idempotent.celery.task import reset_backends

    app = Celery("upgrade", set_as_current=False)
    app.conf.update(idempotency_url=redis_url, idempotency_key_prefix=key_prefix)
    runs: list[int] = []

    @app.task(base=IdempotentTask, name="upgrade.charge", shared=False)
    def charge(order_id: int) -> dict[str, int]:
        runs.append(order_id)
        return {"new": order_id}

    reset_backends()
    key = charge.idempotency_key_for((5,), {})
    assert key == task_key("upgrade.charge", "args", fingerprint_payload({"order_id": 5}))
    V1Worker(redis_client, key_prefix).run(key, b'{"old": 5}', fingerprint_payload({"order_id": 5}))
    try:
        assert charge.apply((5,)).get() == {"old": 5}
        assert runs == []
    finally:
        reset_backends()


# --------------------------------------------------------------------------- fencing


def test_tokens_increase_across_lease_expiry_and_record_expiry(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    provider = RedisLockProvider(redis_client, key_prefix=key_prefix)
    store = RedisIdempotencyStore(redis_client)
    guard = DistributedIdempotencyGuard(
        store=store, lock_provider=provider, key_prefix=key_prefix, ttl=0.15
    )
    res = guard.lock_resource("k")
    tokens = []
    dead = provider.acquire(res, 0.05)  # a holder that dies: its lease expires
    assert dead is not None
    tokens.append(dead.fencing_token)
    time.sleep(0.1)
    tokens.append(token_seen(guard, "k"))  # commits a record that lives 0.15 s
    assert guard.run("k", lambda: "replayed?").replayed
    time.sleep(0.25)
    assert not redis_client.exists(guard.record_key("k"))  # the record expired
    tokens.append(token_seen(guard, "k"))
    assert tokens == sorted(set(tokens))
    assert not redis_client.exists(provider.fence_key(res))  # never needed


def plant_ahead_lease(client: redis.Redis, resource: str, ahead_us: int, lease_ms: int) -> Lease:
    """A lease as a claim leaves it while the server clock read ``ahead_us`` later than now:
    its token ahead, its deadline ``lease_ms`` from now (a lock's value is
    ``<deadline ms>/<lease token>``: ``keyspace.lock_entry``)."""
    now_us = server_us(client)
    fence = now_us + ahead_us
    token = keyspace.lock_value(fence, "planted@clock-ahead")
    client.set(resource, keyspace.lock_entry(now_us // 1000 + lease_ms, token), px=lease_ms)
    return Lease(resource, token, fence)


@pytest.mark.parametrize("ending", ["release", "renewed-then-expired", "commit-then-expired"])
def test_tokens_increase_after_the_server_clock_stepped_back(
    redis_client: redis.Redis, key_prefix: str, ending: str
) -> None:
    """The clock stepped back an hour while a lease was held; however the lease ends (released,
    renewed and then left to expire, committed under a record that then expires), the next
    token is above it: the fence key keeps it until the clock has passed it."""
    provider = RedisLockProvider(redis_client, key_prefix=key_prefix)
    store = RedisIdempotencyStore(redis_client)
    guard = DistributedIdempotencyGuard(
        store=store, lock_provider=provider, key_prefix=key_prefix, ttl=0.1
    )
    res = guard.lock_resource("k")
    fence_key = provider.fence_key(res)
    lease = plant_ahead_lease(redis_client, res, HOUR_US, 30_000)
    if ending == "release":
        assert provider.release(lease)
    elif ending == "renewed-then-expired":
        assert provider.extend(lease, 0.05)
        time.sleep(0.1)
        assert not provider.is_locked(res)
    else:
        atomic = store.atomic_with(provider)
        assert atomic is not None
        record = IdempotencyRecord("ahead", None, time.time(), lease.fencing_token)
        assert atomic.commit(lease, guard.record_key("k"), record, 0.05)
        time.sleep(0.1)
        assert not redis_client.exists(guard.record_key("k"))
    # The fence key holds the token until the server clock reaches it, not longer.
    assert int(redis_client.get(fence_key)) == lease.fencing_token
    expires_at_ms = redis_client.pttl(fence_key) + server_us(redis_client) // 1000
    assert abs(expires_at_ms - lease.fencing_token // 1000) < 2_000
    # Through the guard and through the lock provider alone: above the planted token.
    after = token_seen(guard, "k")
    assert after > lease.fencing_token
    assert redis_client.get(guard.record_key("k")) is not None
    time.sleep(0.15)  # the record expires (ttl 0.1): the fence key still floors the next one
    alone = provider.acquire(res, 1)
    assert alone is not None
    assert alone.fencing_token > after


def test_a_claim_behind_the_fence_keeps_the_fence_until_the_clock_passes(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """A claim floored by the fence key (its token ahead of the clock) whose holder dies: the
    lease expires by itself, and the next token is still above the dead holder's."""
    provider = RedisLockProvider(redis_client, key_prefix=key_prefix)
    res = f"{key_prefix}lock:{{k}}"
    ahead = server_us(redis_client) + HOUR_US
    redis_client.set(provider.fence_key(res), str(ahead), px=3_600_000)
    dead = provider.acquire(res, 0.05)
    assert dead is not None
    assert dead.fencing_token == ahead + 1
    # The claim wrote its own token to the fence key (it is ahead of the clock), to expire
    # when the clock reaches it: the lease alone expires long before that.
    assert int(redis_client.get(provider.fence_key(res))) == dead.fencing_token
    assert redis_client.pttl(provider.fence_key(res)) > 3_000_000
    assert provider.acquire(res, 1) is None
    time.sleep(0.1)
    nxt = provider.acquire(res, 1)
    assert nxt is not None
    assert nxt.fencing_token > dead.fencing_token


def test_release_and_reclaim_within_one_microsecond_still_increase(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Tokens are server µs: a release and the next claim can read the same TIME. A pipeline
    sends them back to back; the tokens still strictly increase."""
    provider = RedisLockProvider(redis_client, key_prefix=key_prefix)
    res = f"{key_prefix}lock:{{k}}"
    tokens = []
    for _ in range(200):
        lease = provider.acquire(res, 5)
        assert lease is not None
        tokens.append(lease.fencing_token)
        provider.release(lease)
    assert tokens == sorted(set(tokens))


# --------------------------------------------------------------------------- one-script path


def test_the_slow_path_is_announced_at_construction(
    redis_client: redis.Redis, key_prefix: str, redis_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    kwargs = redis_client.connection_pool.connection_kwargs
    other = redis.Redis(host=kwargs.get("host"), port=kwargs.get("port"), db=1)
    assert kwargs.get("db", 0) == 0
    try:
        with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
            split = DistributedIdempotencyGuard(
                store=RedisIdempotencyStore(redis_client),
                lock_provider=RedisLockProvider(other),
                key_prefix=key_prefix,
            )
        assert isinstance(split.backend, TwoStepBackend)
        assert "instead of one script" in caplog.text
        assert "db 0 and 1" in caplog.text
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
            memory = DistributedIdempotencyGuard(
                store=RedisIdempotencyStore(redis_client), lock_provider=MemoryLockProvider()
            )
        assert isinstance(memory.backend, TwoStepBackend)
        assert "MemoryLockProvider" in caplog.text
        caplog.clear()
        two_clients = redis.Redis.from_url(redis_url)
        with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
            same = DistributedIdempotencyGuard(
                store=RedisIdempotencyStore(redis_client),
                lock_provider=RedisLockProvider(two_clients),
            )
        assert isinstance(same.backend, RedisAtomicBackend)
        assert caplog.text == ""
        two_clients.close()
    finally:
        other.close()


def test_v1_scripts_copy_is_what_0_1_0_shipped() -> None:
    """The copy the upgrade tests use has 0.1.0's shape: a hash record and a 7-day fence."""
    assert v1_layout.RECORD_FIELDS == keyspace.V1_RECORD_FIELDS
    assert "'hset'" in v1_layout.COMMIT
    assert "fence" in v1_layout.CLAIM
    assert "'v', 'ct', 'enc', 'data', 'fp', 'at', 'fence'" in v1_layout.CLAIM
