"""``wait_replicas``: claims and commits count only once replicas have them (Redis ``WAIT``).

Here on a private standalone server, which has no replica, so every write that took something
falls short; a read (a replay, a refused claim) never waits for anything. The failover cases,
with a real replica, are in ``test_redis_sentinel.py``.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from redis_support import recording

from celery_idempotent import (
    CommitUnknownError,
    DistributedIdempotencyGuard,
    IdempotencyConnectionError,
    IdempotencyRecord,
    IdempotentTask,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from celery_idempotent.celery.task import reset_backends
from celery_idempotent.settings import clear_cache
from tests.support.redis_server import RedisServer

PREFIX = "test:wait:"


@pytest.fixture
def server(redis_server_factory: Callable[..., RedisServer]) -> RedisServer:
    """A private server: nothing else attaches a replica to it."""
    return redis_server_factory()


def guard_on(client: Any, *, wait: int, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("key_prefix", PREFIX)
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client, wait_replicas=wait, wait_timeout=0.05),
        lock_provider=RedisLockProvider(client, key_prefix=PREFIX),
        **options,
    )


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"wait_replicas": -1}, ValueError, "wait_replicas must be 0 or more"),
        ({"wait_replicas": 1.5}, TypeError, "wait_replicas must be an int"),
        ({"wait_replicas": True}, TypeError, "wait_replicas must be an int"),
        ({"wait_timeout": 0}, ValueError, "wait_timeout must be greater than 0"),
        ({"wait_timeout": "1s"}, TypeError, "wait_timeout must be a number of seconds"),
    ],
)
def test_bad_wait_options_name_the_option(
    server: RedisServer, options: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        RedisIdempotencyStore(server.client(), **options)


@pytest.mark.cluster
def test_wait_replicas_is_refused_with_a_cluster_client(redis_cluster: Any) -> None:
    client = redis_cluster.client()
    try:
        with pytest.raises(ValueError, match="wait_replicas is not supported with a RedisCluster"):
            RedisIdempotencyStore(client, wait_replicas=1)
        assert RedisIdempotencyStore(client, wait_replicas=0).wait_replicas == 0
    finally:
        client.close()


def test_a_claim_no_replica_has_is_given_back_before_the_body_runs(server: RedisServer) -> None:
    client = server.client()
    guard = guard_on(client, wait=1)
    calls: list[bool] = []

    started = time.monotonic()
    with pytest.raises(IdempotencyConnectionError, match="claim reached 0 of the 1 replica") as e:
        guard.execute("k", recording("v", calls))
    assert time.monotonic() - started < 2  # WAIT's timeout (0.05 s), not lock_ttl
    assert e.value.key == "k"
    assert calls == []
    assert client.exists(guard.lock_resource("k")) == 0, "the lock was not given back"
    assert client.exists(guard.record_key("k")) == 0
    # nothing is left behind: a guard that does not wait takes the key at once
    assert guard_on(client, wait=0).execute("k", recording("v", calls)) == "v"
    assert calls == [True]


def test_replays_and_refusals_never_depend_on_replicas(server: RedisServer) -> None:
    client = server.client()
    plain, waiting = guard_on(client, wait=0), guard_on(client, wait=1, retry_count=0)
    calls: list[bool] = []
    assert plain.execute("done", recording("stored", calls), input={"a": 1}) == "stored"

    outcome = waiting.run("done", recording("again", calls), input={"a": 1})
    assert outcome.replayed
    assert outcome.value == "stored"
    assert calls == [True]


def test_a_store_write_no_replica_confirms_raises_after_writing(server: RedisServer) -> None:
    """The non-atomic path (``store.set``) waits after its MULTI/EXEC: the record is on the
    master, unconfirmed, and the caller is told so."""
    client = server.client()
    store = RedisIdempotencyStore(client, wait_replicas=1, wait_timeout=0.05)
    record = IdempotencyRecord("v", None, time.time(), 7)
    with pytest.raises(IdempotencyConnectionError, match="record reached 0 of the 1 replica"):
        store.set(f"{PREFIX}rec", record, 60)
    assert client.exists(f"{PREFIX}rec") == 1


def test_an_unconfirmed_commit_ends_in_commit_unknown_after_lock_ttl(server: RedisServer) -> None:
    """The claim is confirmed (a fake replica count lets it through) but the commit is not:
    the guard sends the commit again until ``lock_ttl`` has passed, then raises
    CommitUnknownError with the body's result."""
    client = server.client()
    guard = guard_on(client, wait=1, lock_ttl=0.5)
    store = guard.store
    assert isinstance(store, RedisIdempotencyStore)
    real = store.eval_and_wait
    commits: list[int] = []

    def claims_pass(script: Any, keys: list[Any], args: list[Any]) -> tuple[Any, Any]:
        reply, acked = real(script, keys, args)
        if script is store._commit:
            commits.append(int(acked))
            return reply, acked
        return reply, 1  # the claim "reached" its replica

    store.eval_and_wait = claims_pass  # type: ignore[method-assign]
    with pytest.raises(CommitUnknownError, match="could not be confirmed") as caught:
        guard.execute("k", lambda: "charged")
    assert caught.value.result == "charged"
    assert len(commits) >= 2, "the commit was not sent again"
    assert set(commits) == {0}
    assert client.exists(guard.record_key("k")) == 1  # written, never confirmed


def test_the_task_settings_reach_the_store_and_refuse_memory(server: RedisServer) -> None:
    reset_backends()
    app = Celery(f"wait-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        result_backend="cache+memory://",
        idempotency_url=server.url,
        idempotency_key_prefix=PREFIX,
        idempotency_wait_replicas=1,
        idempotency_wait_timeout=0.05,
    )
    calls: list[int] = []
    try:

        @app.task(base=IdempotentTask, shared=False, name="wait.charge")
        def charge(order: int) -> int:
            calls.append(order)
            return order

        @app.task(base=IdempotentTask, shared=False, name="wait.local", idempotency_url="memory://")
        def local(order: int) -> int:
            return order

        result = charge.apply((1,))
        assert result.state == "FAILURE"
        assert isinstance(result.result, IdempotencyConnectionError)
        assert "reached 0 of the 1 replica" in str(result.result)
        assert calls == []
        store = charge.idempotency_guard().store
        assert (store.wait_replicas, store.wait_timeout) == (1, 0.05)
        locks = charge.idempotency_guard().lock_provider
        assert (locks.wait_replicas, locks.wait_timeout) == (1, 0.05)

        failed = local.apply((2,))
        assert failed.state == "FAILURE"
        assert isinstance(failed.result, ValueError)
        assert "idempotency_wait_replicas (task wait.local) needs a Redis backend" in str(
            failed.result
        )
    finally:
        reset_backends()
        app.close()


def test_a_wait_timeout_as_long_as_the_lease_is_refused_naming_both() -> None:
    app = Celery(f"wait-{uuid.uuid4().hex[:8]}", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        idempotency_url="memory://",
        idempotency_wait_replicas=1,
        idempotency_wait_timeout=10,
        idempotency_lock_ttl=10,
    )
    try:

        @app.task(base=IdempotentTask, shared=False, name="wait.long")
        def long(order: int) -> int:
            return order

        with pytest.raises(ValueError, match=r"idempotency_wait_timeout .* idempotency_lock_ttl"):
            long.idempotency_settings()
        app.conf.idempotency_wait_replicas = 0  # not waiting: the timeout does not matter
        clear_cache(app)
        assert long.idempotency_settings().idempotency_wait_timeout == 10
    finally:
        app.close()


def test_a_renewal_no_replica_confirms_is_not_counted(server: RedisServer) -> None:
    """Both ways a lease is renewed (``extend``, and the keeper thread's own connection) wait
    for the replicas; a renewal fewer replicas have raises instead of counting, so the holder
    never believes in a lease longer than the one a promoted replica would hold."""
    client = server.client()
    plain = RedisLockProvider(client, key_prefix=PREFIX)
    waiting = RedisLockProvider(client, key_prefix=PREFIX, wait_replicas=1, wait_timeout=0.05)
    lease = plain.acquire(f"{PREFIX}lock:{{renew}}", 5)
    assert lease is not None
    assert plain.extend(lease, 5) is True
    with pytest.raises(IdempotencyConnectionError, match="renewal reached 0 of the 1 replica"):
        waiting.extend(lease, 5)
    renew = waiting.renewer()
    assert renew is not None
    with pytest.raises(IdempotencyConnectionError, match="not counted"):
        renew(lease, 5, 1.0)
    other = RedisLockProvider(client, key_prefix=PREFIX, wait_replicas=1, wait_timeout=0.05)
    assert other.renewer() is not None
    # A lease that is not ours is answered as such, replicas or not.
    assert waiting.extend(type(lease)(lease.resource, "0/x@y", 1), 5) is False
    assert plain.release(lease)


def test_a_body_whose_renewals_no_replica_has_loses_its_lease_by_its_own_clock(
    server: RedisServer,
) -> None:
    """The claim reached "its replica" (faked, as above), the renewals do not: the keeper
    counts none of them, so the lease runs out for the holder when the claim's copy would,
    and nothing is committed, although the server itself still had the lock renewed."""
    from celery_idempotent import LockLostError

    client = server.client()
    store = RedisIdempotencyStore(client, wait_replicas=1, wait_timeout=0.05)
    locks = RedisLockProvider(client, key_prefix=PREFIX, wait_replicas=1, wait_timeout=0.05)
    real = store.eval_and_wait
    store.eval_and_wait = lambda script, keys, args: (  # type: ignore[method-assign]
        real(script, keys, args)[0],
        1,
    )
    guard = DistributedIdempotencyGuard(
        store=store, lock_provider=locks, key_prefix=PREFIX, lock_ttl=1.5, renew_interval=0.5
    )
    # A claim answered a renewal interval late is checked with a (replicated) extend, which
    # no replica confirms here: warm up first, with an interval a loaded machine keeps to.
    assert guard.execute("warm", lambda: "scripts loaded") == "scripts loaded"
    with pytest.raises(LockLostError, match="renewals failed until it ran out"):
        guard.execute("long", lambda: time.sleep(2.5) or "done")
    assert client.exists(guard.record_key("long")) == 0
