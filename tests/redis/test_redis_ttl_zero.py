"""The Redis scripts of issue 24's modes: ``END`` (the commit of ``idempotency_ttl=0``) and the
claim that ends a call's own queued marker (``idempotency_publish_until="started"``), and the
publish decision's ``state`` / ``ttl_left`` (``DuplicatePublishError``), on a real Redis.
"""

from __future__ import annotations

import pytest
import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyRecord,
    LockLostError,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.store import RedisAtomicBackend, claims_end_marker

pytestmark = pytest.mark.redis


def pair(client: redis.Redis, key_prefix: str) -> tuple[RedisIdempotencyStore, RedisLockProvider]:
    return RedisIdempotencyStore(client), RedisLockProvider(client, key_prefix=key_prefix)


def guard_on(
    client: redis.Redis, key_prefix: str, **options: object
) -> DistributedIdempotencyGuard:
    store, provider = pair(client, key_prefix)
    return DistributedIdempotencyGuard(
        store=store, lock_provider=provider, key_prefix=key_prefix, **options
    )


def queued_id(value: bytes | None) -> str | None:
    """The task id of the queued marker ``value``, or ``None`` (gone, or not a marker)."""
    parsed = None if value is None else keyspace.parse_queued(value)
    return None if parsed is None else parsed[0]


def marker(task_id: str, fingerprint: str = "") -> str:
    return f"{keyspace.QUEUED_HEAD}{task_id}{keyspace.RECORD_SEP}{fingerprint}"


def test_ttl_zero_stores_nothing_and_the_key_runs_again(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    guard = guard_on(redis_client, key_prefix, ttl=0)
    assert isinstance(guard.backend, RedisAtomicBackend)  # one script per step
    first = guard.run("k", lambda: "one", task_id="t1")
    second = guard.run("k", lambda: "two", task_id="t2")
    assert (first.value, first.replayed, second.value, second.replayed) == (
        "one",
        False,
        "two",
        False,
    )
    assert second.fencing_token > first.fencing_token
    assert redis_client.get(guard.record_key("k")) is None
    lock = keyspace.parse_lock(redis_client.get(guard.lock_resource("k")).decode())
    assert lock.deadline_ms == 0  # a tombstone: free, the fencing token kept
    assert lock.fencing_token == second.fencing_token


def test_end_deletes_the_deliverys_own_marker_only(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    guard = guard_on(redis_client, key_prefix, ttl=0)
    rkey = guard.record_key("own")
    redis_client.set(rkey, marker("t-own"), px=60_000)
    guard.run("own", lambda: 1, task_id="t-own")
    assert redis_client.get(rkey) is None  # its marker ended with it

    rkey = guard.record_key("other")
    redis_client.set(rkey, marker("t-queued"), px=60_000)  # another call, queued meanwhile
    guard.run("other", lambda: 1, task_id="t-running")
    # Kept (it names a message still queued); the claim marked it claimed (issue 22's life
    # cycle: it lives on only while a valid lease holds the lock).
    assert queued_id(redis_client.get(rkey)) == "t-queued"


def test_end_resent_after_a_lost_reply_reports_success(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store, provider = pair(redis_client, key_prefix)
    backend = RedisAtomicBackend(store, provider)
    resource, rkey = f"{key_prefix}lock:{{r}}", f"{key_prefix}{{r}}"
    claim = backend.claim(resource, rkey, 10)
    assert claim.lease is not None
    record = IdempotencyRecord("v", None, 1.0, claim.lease.fencing_token, "t1")
    assert backend.commit(claim.lease, rkey, record, 0)
    assert backend.commit(claim.lease, rkey, record, 0)  # the same END sent again: done
    assert redis_client.get(rkey) is None
    # Another holder since: the resent END cannot tell, and says the lease is lost.
    assert provider.acquire(resource, 10) is not None
    assert not backend.commit(claim.lease, rkey, record, 0)


def test_ttl_zero_lost_lease_raises_with_the_result(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    guard = guard_on(redis_client, key_prefix, ttl=0)
    resource = guard.lock_resource("lost")

    def body() -> str:
        redis_client.delete(resource)  # deleted by hand (forget --force)
        assert RedisLockProvider(redis_client).acquire(resource, 10) is not None
        return "ran"

    with pytest.raises(LockLostError) as caught:
        guard.execute("lost", body)
    assert caught.value.result == "ran"


def test_claim_in_started_mode_ends_its_own_marker(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    guard = guard_on(redis_client, key_prefix)
    rkey = guard.record_key("s")
    redis_client.set(rkey, marker("t1"), px=60_000)
    seen: list[bytes | None] = []
    with claims_end_marker("t1"):
        guard.run("s", lambda: seen.append(redis_client.get(rkey)), task_id="t1")
    assert seen == [None]  # gone from the claim on: a publish may queue one more

    redis_client.delete(rkey)
    redis_client.set(rkey, marker("t-other"), px=60_000)
    seen.clear()
    with claims_end_marker("t1"):
        guard.run("s2", lambda: None, task_id="t1")  # another key: nothing to end
        guard.run("s", lambda: seen.append(redis_client.get(rkey)), task_id="t1")
    assert [queued_id(v) for v in seen] == ["t-other"]  # another call's marker: not ended
    # Outside the block a claim leaves markers alone (idempotency_publish_until="completed").
    rkey3 = guard.record_key("c")
    redis_client.set(rkey3, marker("t3"), px=60_000)
    guard_ttl0 = guard_on(redis_client, key_prefix, ttl=0)
    seen.clear()
    guard_ttl0.run("c", lambda: seen.append(redis_client.get(rkey3)), task_id="t3")
    assert [queued_id(v) for v in seen] == ["t3"]  # kept while the body runs: it is running
    assert redis_client.get(rkey3) is None  # and ended with it


def test_publish_decision_says_state_and_time_left(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    store, provider = pair(redis_client, key_prefix)
    res, rkey = f"{key_prefix}lock:{{p}}", f"{key_prefix}{{p}}"
    assert store.check_publish(rkey, res, "t1", None, 30).action == "publish"
    queued = store.check_publish(rkey, res, "t2", None, 30)
    assert (queued.action, queued.state, queued.task_id) == ("queued", "queued", "t1")
    assert queued.ttl_left is not None
    assert 29 < queued.ttl_left <= 30
    lease = provider.acquire(res, 10)  # t1's delivery claims: running
    assert lease is not None
    running = store.check_publish(rkey, res, "t2", None, 30)
    assert (running.state, running.task_id, running.ttl_left) == ("running", "t1", None)
    # "started": the running call's marker (here still there: a claim outside the mode) is
    # read as queued; once it is gone, the publish queues one more and the next is stopped.
    assert store.check_publish(rkey, res, "t2", None, 30, until="started").state == "queued"
    redis_client.delete(rkey)
    assert store.check_publish(rkey, res, "t2", None, 30, until="started").action == "publish"
    assert keyspace.parse_queued(redis_client.get(rkey)) == ("t2", None)
    third = store.check_publish(rkey, res, "t3", None, 30, until="started")
    assert (third.action, third.state, third.task_id) == ("queued", "queued", "t2")
    # Completed: the record's TTL; "started" publishes past a record (the worker replays).
    assert provider.release(lease)
    redis_client.delete(rkey)
    guard = guard_on(redis_client, key_prefix, ttl=120)
    guard.run("p2", lambda: 1, task_id="t9")
    r2 = guard.record_key("p2")
    done = store.check_publish(r2, guard.lock_resource("p2"), "t10", None, 30)
    assert (done.action, done.state, done.task_id) == ("completed", "completed", "t9")
    assert done.ttl_left is not None
    assert 119 < done.ttl_left <= 120
    past = store.check_publish(r2, guard.lock_resource("p2"), "t10", None, 30, until="started")
    assert (past.action, past.unchecked) == ("publish", True)
    assert redis_client.get(r2) is not None  # the record is not overwritten by a marker
    assert keyspace.parse_queued(redis_client.get(r2)) is None


def test_ttl_zero_race_of_threads_never_overlaps_and_every_call_runs(
    redis_url: str, key_prefix: str
) -> None:
    """Four threads, each with its own client, call one key five times with ``ttl=0``: all
    twenty calls run (nothing is replayed) and no two bodies ever overlap."""
    import threading
    import time

    spans: list[tuple[float, float]] = []
    errors: list[BaseException] = []
    lock = threading.Lock()

    def worker() -> None:
        client = redis.Redis.from_url(redis_url)
        try:
            guard = guard_on(
                client,
                key_prefix,
                ttl=0,
                retry_count=500,
                retry_base_delay=0.005,
                retry_max_delay=0.02,
            )
            for _ in range(5):

                def body() -> None:
                    start = time.monotonic()
                    time.sleep(0.02)
                    with lock:
                        spans.append((start, time.monotonic()))

                outcome = guard.run("race", body)
                assert not outcome.replayed
        except BaseException as exc:  # reported below
            errors.append(exc)
        finally:
            client.close()

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert len(spans) == 20
    ordered = sorted(spans)
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:]))


def test_status_in_started_mode_names_the_running_call_and_the_queued_one(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    """Issue 24: a key with one call running and one queued behind it read ``running`` with
    the *queued* call's task id. The running call's claim ended its own marker; its lease's
    token names it, and the marker no delivery claimed is the queued call's."""
    from celery_idempotent.admin import read_key, status_of

    guard = guard_on(redis_client, key_prefix)
    store = guard.store
    rkey, res = guard.record_key("st"), guard.lock_resource("st")
    assert store.check_publish(rkey, res, "t-1", None, 30, until="started").action == "publish"
    queued = status_of(read_key(redis_client, key_prefix, "st"))
    assert (queued.state, queued.task_id, queued.queued_task_id) == ("queued", "t-1", None)
    seen: list[tuple[str, str | None, str | None]] = []
    shown: list[dict[str, object]] = []

    def body() -> None:
        alone = status_of(read_key(redis_client, key_prefix, "st"))
        seen.append((alone.state, alone.task_id, alone.queued_task_id))
        assert store.check_publish(rkey, res, "t-2", None, 30, until="started").action == (
            "publish"
        )
        info = read_key(redis_client, key_prefix, "st")
        both = status_of(info)
        seen.append((both.state, both.task_id, both.queued_task_id))
        shown.append(info.as_json(0.0)["lock"])

    with claims_end_marker("t-1"):
        guard.run("st", body, task_id="t-1")
    assert seen == [("running", "t-1", None), ("running", "t-1", "t-2")]
    assert shown[0]["task_id"] == "t-1"
