"""The Redis backend on a local 3-master Redis Cluster, through one ``RedisCluster`` client.

Every script touches only keys of one hash slot (the ``{...}`` tag), so the cluster client
routes it to the key's master; keys of different idempotency keys land on different masters.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from redis.cluster import RedisCluster as ClusterClient
from redis.crc import key_slot
from redis_support import recording

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyMismatchError,
    IdempotencyRecord,
    LockAcquisitionError,
    LockLostError,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_lease,
)
from celery_idempotent.backends.redis.store import RedisAtomicBackend
from celery_idempotent.core.two_step import TwoStepBackend

pytestmark = [pytest.mark.redis, pytest.mark.cluster]


@pytest.fixture
def cluster_client(redis_cluster: Any) -> Iterator[ClusterClient]:
    client: ClusterClient = redis_cluster.client()
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def parts(
    cluster_client: ClusterClient, key_prefix: str
) -> tuple[RedisLockProvider, RedisIdempotencyStore, DistributedIdempotencyGuard]:
    provider = RedisLockProvider(cluster_client, key_prefix=key_prefix)
    store = RedisIdempotencyStore(cluster_client)
    assert store.atomic_with(provider) is not None  # one client: the one-script path
    guard = DistributedIdempotencyGuard(
        store=store, lock_provider=provider, key_prefix=key_prefix, retry_base_delay=0.001
    )
    return provider, store, guard


def test_replay_and_mismatch_on_keys_spread_over_the_masters(
    parts: tuple[RedisLockProvider, RedisIdempotencyStore, DistributedIdempotencyGuard],
    cluster_client: ClusterClient,
) -> None:
    _, _, guard = parts
    keys = [f"order-{index}" for index in range(30)] + ["{tagged}", "ключ\n", "x" * 10_000]
    calls: list[bool] = []
    for key in keys:
        assert guard.execute(key, recording(key, calls), input=key) == key
    for key in keys:
        assert guard.execute(key, recording("again", calls), input=key) == key
        with pytest.raises(IdempotencyMismatchError):
            guard.execute(key, recording("other", calls), input="other")
    assert len(calls) == len(keys)  # once per key, never for a duplicate or a mismatch

    masters = set()
    for key in keys:
        names = [
            guard.lock_resource(key),
            guard.record_key(key),
            guard.lock_resource(key) + ":fence",
        ]
        assert len({key_slot(name.encode()) for name in names}) == 1
        assert cluster_client.exists(guard.record_key(key))
        node = cluster_client.get_node_from_key(guard.record_key(key))
        masters.add(node.name)
    assert len(masters) == 3, f"keys landed on {masters} only"


def test_fencing_tokens_increase_across_holders(
    parts: tuple[RedisLockProvider, RedisIdempotencyStore, DistributedIdempotencyGuard],
    cluster_client: ClusterClient,
) -> None:
    provider, _, guard = parts
    res = guard.lock_resource("fenced")
    tokens = []
    for index in range(6):
        lease = provider.acquire(res, 30)
        assert lease is not None
        tokens.append(lease.fencing_token)
        if index == 3:
            cluster_client.delete(provider.fence_key(res))
        assert provider.release(lease)
    seen: list[int] = []

    def body() -> str:
        lease = current_lease()
        assert lease is not None
        seen.append(lease.fencing_token)
        return "v"

    outcome = guard.run("fenced", body)
    tokens += seen
    assert tokens == sorted(set(tokens))
    assert outcome.fencing_token == seen[0]


def test_renewal_keeps_the_lease_and_owner_safety_holds(
    parts: tuple[RedisLockProvider, RedisIdempotencyStore, DistributedIdempotencyGuard],
    cluster_client: ClusterClient,
    key_prefix: str,
) -> None:
    provider, store, _ = parts
    guard = DistributedIdempotencyGuard(
        store=store, lock_provider=provider, key_prefix=key_prefix, lock_ttl=1.0, retry_count=0
    )  # a lease a starved keeper thread on a loaded host still keeps (0.3 s did not, in CI)
    res = guard.lock_resource("long")
    refused = []
    stop = threading.Event()

    def claimer() -> None:
        while not stop.is_set():
            with pytest.raises(LockAcquisitionError):
                guard.execute("long", lambda: "rival")
            refused.append(provider.acquire(res, 1.0) is None)
            time.sleep(0.02)

    thread = threading.Thread(target=claimer)

    def body() -> str:
        thread.start()
        time.sleep(2.5)  # two and a half lock_ttl
        stop.set()
        thread.join()
        return "done"

    assert guard.execute("long", body) == "done"
    assert len(refused) >= 10
    assert all(refused)
    assert guard.execute("long", lambda: "again") == "done"

    # A holder whose lease ran out cannot commit over the next holder.
    def stolen() -> str:
        cluster_client.delete(res2)
        thief = provider.acquire(res2, 30)
        assert thief is not None
        store.set(guard.record_key("stolen"), IdempotencyRecord("theirs", None, 1.0, 9), 60)
        assert provider.release(thief)
        return "mine"

    res2 = guard.lock_resource("stolen")
    with pytest.raises(LockLostError) as caught:
        guard.execute("stolen", stolen)
    assert caught.value.result == "mine"
    assert guard.execute("stolen", lambda: "x") == "theirs"


def test_store_protocol_and_clear_on_the_cluster(
    parts: tuple[RedisLockProvider, RedisIdempotencyStore, DistributedIdempotencyGuard],
    key_prefix: str,
) -> None:
    provider, store, guard = parts
    record = IdempotencyRecord({"a": 1}, "fp", 1.5, 3)
    names = [guard.record_key(f"k{index}") for index in range(10)]
    for name in names:
        store.set(name, record, 60)
    assert all(store.get(name) == record for name in names)
    assert all(store.delete(name) for name in names)
    assert all(store.get(name) is None for name in names)

    resources = [guard.lock_resource(f"k{index}") for index in range(10)]
    assert all(provider.acquire(res, 30) for res in resources)
    provider.clear()  # SCAN on every master
    assert not any(provider.is_locked(res) for res in resources)


def test_two_cluster_clients_of_one_cluster_keep_the_one_script_path(
    redis_cluster: Any, cluster_client: ClusterClient, key_prefix: str
) -> None:
    """A store and a lock provider with a RedisCluster client each (not the same object): one
    cluster, so claim and commit stay one script each: a first execution is 2 round trips,
    a duplicate 1 (counted at the clients: every command they send)."""
    other: ClusterClient = redis_cluster.client()
    sent: list[str] = []
    for client in (cluster_client, other):
        original = client.execute_command

        def counting(*args: Any, _original: Any = original, **kwargs: Any) -> Any:
            sent.append(str(args[0]))
            return _original(*args, **kwargs)

        client.execute_command = counting  # type: ignore[method-assign]
    try:
        provider = RedisLockProvider(other, key_prefix=key_prefix)
        store = RedisIdempotencyStore(cluster_client)
        assert store.pairing_problem(provider) is None
        guard = DistributedIdempotencyGuard(
            store=store, lock_provider=provider, key_prefix=key_prefix
        )
        assert isinstance(guard.backend, RedisAtomicBackend)
        for index in range(3):  # load the scripts on every master first
            guard.execute(f"warm-{index}", lambda: 0)
        sent.clear()
        assert guard.execute("k", lambda: "v", input=1) == "v"
        assert sent == ["EVALSHA", "EVALSHA"]
        sent.clear()
        assert guard.execute("k", lambda: "again", input=1) == "v"
        assert sent == ["EVALSHA"]
    finally:
        other.close()


def test_cluster_clients_of_two_clusters_are_told_apart(
    cluster_client: ClusterClient, redis_url: str, caplog: Any
) -> None:
    import logging

    import redis

    plain = redis.Redis.from_url(redis_url)
    try:
        store = RedisIdempotencyStore(cluster_client)
        reason = store.pairing_problem(RedisLockProvider(plain))
        assert reason is not None
        assert "RedisCluster" in reason
        with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
            guard = DistributedIdempotencyGuard(store=store, lock_provider=RedisLockProvider(plain))
        assert isinstance(guard.backend, TwoStepBackend)
        assert reason in caplog.text
    finally:
        plain.close()
