"""What only the Redis backend promises (SPEC §4): round trips, owner-safe scripts, fencing that
survives its key, refused pickles, hash-slot-safe key names, construction and error mapping.

The backend-neutral rules are in ``test_redis_contract.py``; the process race in
``test_redis_race.py``; Redis Cluster in ``test_redis_cluster.py``.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from redis.crc import key_slot
from redis_support import recording, split_store

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyError,
    IdempotencyMismatchError,
    IdempotencyRecord,
    Lease,
    LockAcquisitionError,
    LockLostError,
    RecordDecodeError,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.store import RedisAtomicBackend
from tests.support.counting import RoundTrips
from tests.support.ports import free_port
from tests.support.proxy import TcpProxy
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.redis

ROOT = Path(__file__).resolve().parents[2]


class Pair:
    """A lock provider and a store on one client, and a guard over them."""

    def __init__(self, client: redis.Redis, prefix: str, **guard_options: Any) -> None:
        self.client = client
        self.prefix = prefix
        self.provider = RedisLockProvider(client, key_prefix=prefix)
        self.store = RedisIdempotencyStore(client)
        guard_options.setdefault("retry_base_delay", 0.001)
        self.guard = DistributedIdempotencyGuard(
            store=self.store, lock_provider=self.provider, key_prefix=prefix, **guard_options
        )
        atomic = self.store.atomic_with(self.provider)
        assert atomic is not None
        self.atomic: RedisAtomicBackend = atomic


@pytest.fixture
def client(redis_url: str) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(redis_url)
    try:
        yield c
    finally:
        c.close()


@pytest.fixture
def pair(client: redis.Redis, key_prefix: str) -> Pair:
    return Pair(client, key_prefix)


# =========================================================================== round trips


def test_round_trips_counted_at_the_client(
    round_trips: tuple[RoundTrips, redis.Redis], key_prefix: str
) -> None:
    trips, client = round_trips
    pair = Pair(client, key_prefix, retry_count=0)
    guard, provider = pair.guard, pair.provider
    # Warm up: connect, and load each script once (the one-time NOSCRIPT + SCRIPT LOAD).
    guard.execute("warm-up", lambda: None)
    lease = provider.acquire(f"{key_prefix}lock:{{warm-up-lock}}", 5)
    assert lease is not None
    assert provider.extend(lease, 5)
    assert provider.release(lease)

    first, first_sends = trips.measure(lambda: guard.execute("order", lambda: "v", input=1))
    duplicate, dup_sends = trips.measure(lambda: guard.execute("order", lambda: "x", input=1))

    def mismatch() -> None:
        with pytest.raises(IdempotencyMismatchError):
            guard.execute("order", lambda: "x", input=2)

    refused, _ = trips.measure(mismatch)

    held = provider.acquire(guard.lock_resource("busy"), 30)
    assert held is not None

    def attempt_held() -> None:
        with pytest.raises(LockAcquisitionError):
            guard.execute("busy", lambda: "never")

    failed, failed_sends = trips.measure(attempt_held)
    renewal, renewal_sends = trips.measure(lambda: provider.extend(held, 30))

    assert first <= 2, first_sends
    assert first_sends == [["EVALSHA"], ["EVALSHA"]]  # claim; commit + release
    assert duplicate == 1, dup_sends
    assert refused == 1
    assert failed == 1, failed_sends
    assert renewal == 1, renewal_sends


def test_renewals_by_the_guard_cost_one_round_trip_each(
    round_trips: tuple[RoundTrips, redis.Redis], key_prefix: str
) -> None:
    trips, client = round_trips
    pair = Pair(client, key_prefix, lock_ttl=0.9)  # 0.3 s was lost by a starved keeper in CI
    pair.guard.execute("warm-up", lambda: time.sleep(0.45))  # loads CLAIM, EXTEND, COMMIT
    count, sends = trips.measure(lambda: pair.guard.execute("long", lambda: time.sleep(1.35)))
    renewals = count - 2  # claim and commit
    assert renewals >= 2, sends  # about 4: every 0.3 s for 1.35 s
    assert all(send == ["EVALSHA"] for send in sends)


# =========================================================================== scripts


def test_stale_lease_cannot_commit_release_or_extend_over_the_next_holder(pair: Pair) -> None:
    res, rkey = pair.guard.lock_resource("k"), pair.guard.record_key("k")
    claim_a = pair.atomic.claim(res, rkey, 30)
    assert claim_a.lease is not None
    assert claim_a.record is None
    pair.client.delete(res)  # A stalled past its lease
    claim_b = pair.atomic.claim(res, rkey, 30)
    assert claim_b.lease is not None
    lease_a, lease_b = claim_a.lease, claim_b.lease
    assert lease_b.fencing_token > lease_a.fencing_token

    record_a = IdempotencyRecord("A", None, 1.0, lease_a.fencing_token)
    record_b = IdempotencyRecord("B", None, 2.0, lease_b.fencing_token)
    assert pair.atomic.commit(lease_a, rkey, record_a, 60) is False
    assert pair.store.get(rkey) is None
    assert pair.provider.extend(lease_a, 30) is False
    assert pair.provider.release(lease_a) is False
    assert pair.provider.holder(res) == lease_b.token

    assert pair.atomic.commit(lease_b, rkey, record_b, 60) is True
    assert not pair.provider.is_locked(res)  # the commit released the lock
    assert pair.atomic.commit(lease_a, rkey, record_a, 60) is False
    assert pair.store.get(rkey) == record_b


def test_commit_retried_after_a_lost_reply_reports_success_without_writing(pair: Pair) -> None:
    res, rkey = pair.guard.lock_resource("k"), pair.guard.record_key("k")
    lease = pair.atomic.claim(res, rkey, 30).lease
    assert lease is not None
    record = IdempotencyRecord("once", None, 1.0, lease.fencing_token)
    assert pair.atomic.commit(lease, rkey, record, 60)
    retried = IdempotencyRecord("twice", None, 2.0, lease.fencing_token)
    assert pair.atomic.commit(lease, rkey, retried, 60) is True
    assert pair.store.get(rkey) == record


def test_claim_finds_the_record_without_taking_the_lock(pair: Pair) -> None:
    res, rkey = pair.guard.lock_resource("k"), pair.guard.record_key("k")
    assert pair.guard.execute("k", lambda: "v") == "v"
    claim = pair.atomic.claim(res, rkey, 30)
    assert claim.lease is None
    assert claim.record is not None
    assert claim.record.result == "v"
    assert not pair.provider.is_locked(res)
    holder = pair.provider.acquire(res, 30)
    assert holder is not None
    assert pair.atomic.claim(res, rkey, 30) == (None, None)  # held: the record is not read


def test_leases_and_records_expire_server_side(pair: Pair) -> None:
    guard = DistributedIdempotencyGuard(
        store=pair.store, lock_provider=pair.provider, key_prefix=pair.prefix, ttl=120, lock_ttl=7
    )
    res, rkey = guard.lock_resource("k"), guard.record_key("k")
    seen: list[tuple[int, bytes, int]] = []

    def body() -> None:
        sec, usec = pair.client.time()
        now_ms = (int(sec) * 1_000_000 + int(usec)) // 1000
        seen.append((pair.client.pttl(res), pair.client.get(res), now_ms))

    guard.execute("k", body)
    pttl, value, now_ms = seen[0]
    # The lease ends at a deadline in server time kept in the lock; the key itself lives the
    # margin longer, as the tombstone that keeps the fencing token once the lease has ended.
    deadline = keyspace.parse_lock(value.decode()).deadline_ms
    assert deadline is not None
    assert 6_000 < deadline - now_ms <= 7_000
    margin = keyspace.FENCE_MARGIN_MS
    assert 6_000 + margin < pttl <= 7_000 + margin
    assert 119_000 < pair.client.pttl(rkey) <= 120_000
    assert pair.client.pttl(res) == -2  # released: the commit deletes the lock


def test_clear_is_scoped_to_the_prefix_and_tokens_keep_increasing(
    pair: Pair, key_prefix: str
) -> None:
    other = RedisLockProvider(pair.client, key_prefix=f"{key_prefix}other:")
    mine = pair.provider.acquire(f"{key_prefix}lock:{{a}}", 30)
    theirs = other.acquire(f"{key_prefix}other:lock:{{a}}", 30)
    assert mine is not None
    assert theirs is not None
    pair.provider.clear()
    assert not pair.provider.is_locked(mine.resource)
    assert other.is_locked(theirs.resource)
    assert not pair.client.exists(pair.provider.fence_key(mine.resource))  # layout v2: none
    again = pair.provider.acquire(mine.resource, 30)
    assert again is not None
    assert again.fencing_token > mine.fencing_token


def test_holder_names_the_owner(client: redis.Redis, key_prefix: str) -> None:
    provider = RedisLockProvider(client, owner_id="worker-7", key_prefix=key_prefix)
    lease = provider.acquire(f"{key_prefix}lock:{{k}}", 30)
    assert lease is not None
    assert provider.holder(lease.resource) == lease.token
    assert lease.token.endswith("@worker-7")
    default = RedisLockProvider(client)
    assert f":{os.getpid()}:" in default.owner_id
    assert provider.release(lease)
    assert provider.holder(lease.resource) is None


def test_a_client_that_decodes_responses_works(redis_url: str, key_prefix: str) -> None:
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        pair = Pair(client, key_prefix)
        assert pair.guard.execute("k", lambda: {"é": [1]}) == {"é": [1]}
        assert pair.guard.execute("k", lambda: "again") == {"é": [1]}
        lease = pair.provider.acquire(pair.guard.lock_resource("held"), 30)
        assert lease is not None
        assert pair.provider.holder(lease.resource) == lease.token
        pair.provider.clear()
        assert not pair.provider.is_locked(lease.resource)
        again = pair.provider.acquire(lease.resource, 30)
        assert again is not None
        assert again.fencing_token > lease.fencing_token
    finally:
        client.close()


# =========================================================================== fencing


def test_fencing_keeps_increasing_without_a_fence_key(pair: Pair) -> None:
    res = pair.guard.lock_resource("k")
    fence = pair.provider.fence_key(res)
    tokens = []
    for _ in range(3):
        lease = pair.provider.acquire(res, 30)
        assert lease is not None
        tokens.append(lease.fencing_token)
        assert pair.provider.release(lease)
        assert not pair.client.exists(fence)  # layout v2 keeps none while the clock is ahead
    seen: list[int] = []
    pair.guard.execute("k", lambda: seen.append(current_fencing_token()))
    tokens += seen
    assert tokens == sorted(set(tokens))


def test_fence_ttl_is_accepted_and_no_fence_key_is_written(
    client: redis.Redis, key_prefix: str
) -> None:
    provider = RedisLockProvider(client, key_prefix=key_prefix, fence_ttl=0.2)  # 0.1.0's option
    res = f"{key_prefix}lock:{{k}}"
    first = provider.acquire(res, 30)
    assert first is not None
    assert provider.release(first)
    assert not client.exists(provider.fence_key(res))
    second = provider.acquire(res, 30)
    assert second is not None
    assert second.fencing_token > first.fencing_token


def current_fencing_token() -> int:
    from celery_idempotent import current_lease

    lease = current_lease()
    assert lease is not None
    return lease.fencing_token


# =========================================================================== serialization


class Planted:
    """Unpickling this creates a directory: the side effect that must never happen."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (os.makedirs, (self.path,))


def plant_pickle(client: redis.Redis, rkey: str, marker: Path) -> None:
    client.hset(
        rkey,
        mapping={
            "v": "1",
            "ct": "application/x-python-serialize",
            "enc": "binary",
            "data": pickle.dumps(Planted(str(marker))),
            "fp": "",
            "at": "1700000000.0",
            "fence": "1",
        },
    )


@pytest.mark.parametrize("path", ["atomic", "split"])
def test_planted_pickle_is_refused_and_never_loaded(
    client: redis.Redis, key_prefix: str, tmp_path: Path, path: str
) -> None:
    marker = tmp_path / "unpickled"
    store = RedisIdempotencyStore(client) if path == "atomic" else split_store(client)
    provider = RedisLockProvider(client, key_prefix=key_prefix)
    guard = DistributedIdempotencyGuard(store=store, lock_provider=provider, key_prefix=key_prefix)
    rkey = guard.record_key("order")
    plant_pickle(client, rkey, marker)

    with pytest.raises(RecordDecodeError) as direct:
        store.get(rkey)
    assert direct.value.content_type == "application/x-python-serialize"
    calls: list[int] = []
    with pytest.raises(RecordDecodeError) as guarded:
        guard.execute("order", lambda: calls.append(1))
    assert guarded.value.key == "order"
    assert guarded.value.content_type == "application/x-python-serialize"
    assert "not loaded" in str(guarded.value)
    assert calls == []
    assert not provider.is_locked(guard.lock_resource("order"))
    assert not marker.exists()

    # Only a store that names pickle in its accept list loads it.
    trusting = RedisIdempotencyStore(client, accept=["json", "pickle"])
    record = trusting.get(rkey)
    assert record is not None
    assert marker.is_dir()


def test_pickle_serializer_needs_an_explicit_accept(client: redis.Redis, key_prefix: str) -> None:
    with pytest.raises(ValueError, match="accept"):
        RedisIdempotencyStore(client, serializer="pickle")
    store = RedisIdempotencyStore(client, serializer="pickle", accept=["pickle"])
    rkey = f"{key_prefix}{{p}}"
    record = IdempotencyRecord({1: (2, 3)}, None, 1.0, 1)  # not JSON-able: a pickle round trip
    store.set(rkey, record, 60)
    assert store.get(rkey) == record
    with pytest.raises(RecordDecodeError):
        RedisIdempotencyStore(client).get(rkey)


def test_corrupt_and_foreign_records_are_refused(client: redis.Redis, key_prefix: str) -> None:
    store = RedisIdempotencyStore(client)
    partial = f"{key_prefix}{{partial}}"
    client.hset(partial, mapping={"ct": "application/json", "data": "1"})
    with pytest.raises(RecordDecodeError, match="incomplete"):
        store.get(partial)
    corrupt = f"{key_prefix}{{corrupt}}"
    fields = {"v": "1", "ct": "application/json", "enc": "utf-8", "data": "{not json"}
    client.hset(corrupt, mapping=dict(fields, fp="", at="1.0", fence="1"))
    with pytest.raises(RecordDecodeError, match="corrupt"):
        store.get(corrupt)
    future = f"{key_prefix}{{future}}"
    client.hset(future, mapping=dict(fields, v="99", data="1", fp="", at="1", fence=""))
    with pytest.raises(RecordDecodeError, match="version"):
        store.get(future)


def test_result_the_serializer_refuses_is_not_stored(pair: Pair) -> None:
    from celery_idempotent import ResultEncodeError

    value = object()
    with pytest.raises(ResultEncodeError) as caught:
        pair.guard.execute("k", lambda: value)
    assert caught.value.result is value
    assert not pair.provider.is_locked(pair.guard.lock_resource("k"))
    assert pair.guard.execute("k", lambda: "json") == "json"


# =========================================================================== keys

ODD_KEYS = {
    "unicode": "заказ-№42-注文-🧾",
    "braces": "tenant{7}:order{42}",
    "open-brace": "{",
    "close-brace": "}",
    "empty-tag": "{}",
    "newlines": "line one\nline two\r\n",
    "spaces-and-tabs": " \t ",
    "glob-chars": "a*b?[c]\\",
    "10kB": "k" * 10_000,
    "10kB-unicode-braces": ("{ü}" * 3_400)[:10_000],
}


@pytest.mark.parametrize("key", list(ODD_KEYS.values()), ids=list(ODD_KEYS))
def test_odd_keys_work_and_share_one_hash_slot(pair: Pair, key: str) -> None:
    guard = pair.guard
    res, rkey = guard.lock_resource(key), guard.record_key(key)
    fence = pair.provider.fence_key(res)
    assert res.startswith(pair.prefix)
    assert rkey.startswith(pair.prefix)
    assert len(res.encode()) < 400  # long keys are shortened in Redis names
    slots = {key_slot(name.encode()) for name in (res, rkey, fence)}
    assert len(slots) == 1, f"{res!r}, {rkey!r} and {fence!r} in different slots"
    inside: list[bool] = []
    assert guard.execute(key, recording("v", inside, lambda: bool(pair.client.exists(res)))) == "v"
    assert inside == [True]
    assert pair.client.exists(rkey)
    assert guard.execute(key, lambda: "again") == "v"
    pair.provider.acquire(res, 30)
    pair.provider.clear()  # SCAN finds it, whatever the key holds
    assert not pair.provider.is_locked(res)


def test_keys_that_differ_only_in_what_gets_shortened_stay_distinct(pair: Pair) -> None:
    keys = [
        "{a}",
        "{b}",
        "(a)",  # braces become parentheses in the readable head
        "x" * 10_000,
        "x" * 9_999 + "y",
        "x" * 201,
        "x" * 200,
    ]
    for index, key in enumerate(keys):
        assert pair.guard.execute(key, recording(index, [])) == index
    for index, key in enumerate(keys):
        assert pair.guard.execute(key, recording(-1, [])) == index
    names = {pair.guard.record_key(key) for key in keys}
    assert len(names) == len(keys)


def test_key_prefix_is_configurable(client: redis.Redis, key_prefix: str) -> None:
    provider, store = RedisLockProvider(client), RedisIdempotencyStore(client)
    default = DistributedIdempotencyGuard(store=store, lock_provider=provider)
    assert default.lock_resource("k") == "idempotency:lock:{k}"
    assert default.record_key("k") == "idempotency:{k}"
    custom = f"{key_prefix}app:"
    guard = DistributedIdempotencyGuard(store=store, lock_provider=provider, key_prefix=custom)
    guard.execute("k", lambda: 1)
    # Layout v2: after a commit, the record is the key's only Redis key.
    assert set(client.scan_iter(match=f"{key_prefix}*")) == {f"{custom}{{k}}".encode()}
    with pytest.raises(ValueError, match="braces"):
        DistributedIdempotencyGuard(store=store, lock_provider=provider, key_prefix="a{b}:")


# =========================================================================== construction


@pytest.mark.parametrize("cls", [RedisLockProvider, RedisIdempotencyStore])
def test_construction_from_client_or_url(cls: Any, client: redis.Redis, redis_url: str) -> None:
    assert cls(client).client is client
    assert cls(client=client).client is client
    from_url = cls(url=redis_url)
    assert isinstance(from_url.client, redis.Redis)
    assert from_url.client.ping()
    from_url.client.close()


@pytest.mark.parametrize("cls", [RedisLockProvider, RedisIdempotencyStore])
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({}, TypeError, "client= .*or url="),
        ({"client": "both", "url": "redis://127.0.0.1/0"}, TypeError, "not both"),
        ({"url": "http://127.0.0.1:6379/0"}, ValueError, "redis://, rediss:// or unix://"),
        ({"url": "127.0.0.1:6379"}, ValueError, "must start with"),
        ({"url": b"redis://127.0.0.1/0"}, TypeError, "url must be a str"),
        ({"url": "redis://127.0.0.1:notaport/0"}, ValueError, "port"),
        ({"client": "redis://127.0.0.1/0"}, TypeError, "redis-py client"),
        ({"client": object()}, TypeError, "redis-py client"),
    ],
)
def test_bad_construction_is_refused_clearly(
    cls: Callable[..., object],
    client: redis.Redis,
    kwargs: dict[str, Any],
    error: type[Exception],
    match: str,
) -> None:
    if kwargs.get("client") == "both":
        kwargs = {**kwargs, "client": client}
    with pytest.raises(error, match=match):
        cls(**kwargs)


def test_bad_url_error_hides_the_password(client: redis.Redis) -> None:
    with pytest.raises(ValueError) as caught:
        RedisLockProvider(url="http://app:s3cret@127.0.0.1:6379/0")
    assert "s3cret" not in str(caught.value)


def test_bad_options_are_refused(client: redis.Redis) -> None:
    with pytest.raises(ValueError, match="fence_ttl"):
        RedisLockProvider(client, fence_ttl=0)
    with pytest.raises(TypeError, match="owner_id"):
        RedisLockProvider(client, owner_id="")
    with pytest.raises(ValueError, match="serializer"):
        RedisIdempotencyStore(client, serializer="nope")
    with pytest.raises(TypeError, match="accept"):
        RedisIdempotencyStore(client, accept="json")
    with pytest.raises(TypeError, match="accept"):
        RedisIdempotencyStore(client, accept=None)
    with pytest.raises(ValueError, match="accept"):
        RedisIdempotencyStore(client, accept=["json", "no-such-serializer"])


def guard_from_url(url: str, prefix: str) -> DistributedIdempotencyGuard:
    provider = RedisLockProvider(url=url, key_prefix=prefix)
    store = RedisIdempotencyStore(url=url)
    assert store.atomic_with(provider) is not None  # two clients, one server: still atomic
    return DistributedIdempotencyGuard(store=store, lock_provider=provider, key_prefix=prefix)


def exercise(guard: DistributedIdempotencyGuard) -> None:
    calls: list[bool] = []
    assert guard.execute("k", recording("v", calls), input=1) == "v"
    assert guard.execute("k", recording("w", calls), input=1) == "v"
    with pytest.raises(IdempotencyMismatchError):
        guard.execute("k", recording("x", calls), input=2)
    assert calls == [True]


def test_unix_socket_url(redis_server_factory: Any) -> None:
    server: RedisServer = redis_server_factory(unixsocket=True)
    assert server.url.startswith("unix://")
    exercise(guard_from_url(server.url, "test:unix:"))


def test_tls_url(redis_server_factory: Any) -> None:
    server: RedisServer = redis_server_factory(tls=True, tls_only=True)
    url = f"{server.tls_url}?ssl_ca_certs={server.tls_ca_file}"
    assert url.startswith("rediss://")
    exercise(guard_from_url(url, "test:tls:"))


def test_password_url(redis_server_factory: Any) -> None:
    server: RedisServer = redis_server_factory(password="pa:ss@word")
    exercise(guard_from_url(server.url, "test:auth:"))
    wrong = RedisLockProvider(url=server.url_for(password="wrong"))
    with pytest.raises(IdempotencyConnectionError) as caught:
        wrong.acquire("test:auth:lock:{k}", 5)
    assert isinstance(caught.value.__cause__, redis.exceptions.RedisError)
    assert "pa:ss@word" not in str(caught.value)


def test_store_and_lock_on_different_databases_do_not_pair(redis_url: str, key_prefix: str) -> None:
    base = redis_url.rsplit("/", 1)[0]
    provider = RedisLockProvider(url=f"{base}/0", key_prefix=key_prefix)
    store = RedisIdempotencyStore(url=f"{base}/1")
    try:
        assert store.atomic_with(provider) is None
        guard = DistributedIdempotencyGuard(
            store=store, lock_provider=provider, key_prefix=key_prefix
        )
        assert guard.execute("k", lambda: "v") == "v"
        assert guard.execute("k", lambda: "w") == "v"
    finally:
        store.delete(guard.record_key("k"))
        provider.client.close()
        store.client.close()


def run_python(code: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
        check=False,
    )


def test_importing_the_package_imports_neither_redis_nor_celery() -> None:
    result = run_python(
        "import sys, celery_idempotent\n"
        "from celery_idempotent import DistributedIdempotencyGuard, MemoryLockProvider\n"
        "assert 'redis' not in sys.modules, 'redis imported'\n"
        "assert 'celery' not in sys.modules, 'celery imported'\n"
        "print('ok')\n"
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"


def test_without_redis_installed_the_error_says_what_to_install() -> None:
    result = run_python(
        "import sys\n"
        "sys.modules['redis'] = None  # as if it were not installed\n"
        "import celery_idempotent as ci\n"
        "g = ci.DistributedIdempotencyGuard(store=ci.MemoryIdempotencyStore(),\n"
        "    lock_provider=ci.MemoryLockProvider())\n"
        "assert g.execute('k', lambda: 1) == 1\n"
        "for cls in (ci.RedisLockProvider, ci.RedisIdempotencyStore):\n"
        "    try:\n"
        "        cls(url='redis://127.0.0.1:6379/0')\n"
        "    except ImportError as exc:\n"
        "        print(exc)\n"
        "    else:\n"
        "        raise SystemExit(cls.__name__ + ' built without redis')\n"
    )
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 2
    for line in lines:
        assert "pip install 'celery-idempotent[redis]'" in line


# =========================================================================== errors


@pytest.fixture
def closed_url() -> str:
    """A Redis URL where nothing listens."""
    return f"redis://127.0.0.1:{free_port()}/0"


def assert_connection_error(exc: BaseException) -> None:
    assert isinstance(exc, IdempotencyConnectionError)
    assert isinstance(exc, IdempotencyBackendError)
    assert isinstance(exc, IdempotencyError)
    assert isinstance(exc.__cause__, redis.exceptions.ConnectionError)


def test_unreachable_redis_surfaces_as_connection_errors(closed_url: str) -> None:
    provider = RedisLockProvider(url=closed_url)
    store = RedisIdempotencyStore(url=closed_url)
    lease = Lease("idempotency:lock:{k}", "token", 1)
    record = IdempotencyRecord(1, None, 1.0, 1)
    calls: list[Callable[[], object]] = [
        lambda: provider.acquire("idempotency:lock:{k}", 5),
        lambda: provider.is_locked("idempotency:lock:{k}"),
        lambda: provider.extend(lease, 5),
        lambda: provider.release(lease),
        provider.clear,
        lambda: store.get("idempotency:{k}"),
        lambda: store.set("idempotency:{k}", record, 5),
        lambda: store.delete("idempotency:{k}"),
    ]
    for call in calls:
        with pytest.raises(IdempotencyConnectionError) as caught:
            call()
        assert_connection_error(caught.value)


@pytest.mark.parametrize("path", ["atomic", "split"])
def test_unreachable_redis_fails_the_guard_before_the_body(closed_url: str, path: str) -> None:
    client = redis.Redis.from_url(closed_url)
    store = RedisIdempotencyStore(client) if path == "atomic" else split_store(client)
    guard = DistributedIdempotencyGuard(
        store=store, lock_provider=RedisLockProvider(client), retry_base_delay=0
    )
    calls: list[int] = []
    with pytest.raises(IdempotencyConnectionError) as caught:
        guard.execute("order-9", lambda: calls.append(1))
    assert caught.value.key == "order-9"
    assert_connection_error(caught.value)
    assert calls == []


def test_stalled_redis_times_out_as_a_connection_error(
    tcp_proxy: Any, redis_url: str, key_prefix: str
) -> None:
    proxy: TcpProxy = tcp_proxy(redis_url)
    client = redis.Redis.from_url(proxy.url, socket_timeout=0.3)
    provider = RedisLockProvider(client, key_prefix=key_prefix)
    res = f"{key_prefix}lock:{{k}}"
    assert not provider.is_locked(res)
    proxy.stall()
    started = time.monotonic()
    with pytest.raises(IdempotencyConnectionError) as caught:
        provider.is_locked(res)
    assert time.monotonic() - started < 3
    assert isinstance(caught.value.__cause__, (redis.exceptions.TimeoutError, TimeoutError))
    proxy.resume()
    client.close()


def test_redis_lost_mid_body_loses_the_lease_and_commits_nothing(
    tcp_proxy: Any, redis_url: str, client: redis.Redis, key_prefix: str
) -> None:
    proxy: TcpProxy = tcp_proxy(redis_url)
    via_proxy = redis.Redis.from_url(proxy.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(via_proxy),
        lock_provider=RedisLockProvider(via_proxy),
        key_prefix=key_prefix,
        lock_ttl=0.5,
    )

    tokens: list[int] = []

    def body() -> str:
        tokens.append(current_fencing_token())
        proxy.cut()
        time.sleep(0.8)  # renewals fail until the lease has run out
        proxy.resume()
        return "charged"

    with pytest.raises(LockLostError) as caught:
        guard.execute("k", body)
    assert caught.value.result == "charged"
    assert isinstance(caught.value.__cause__, IdempotencyConnectionError)
    assert not client.exists(guard.record_key("k"))
    # The lease ran out: the lock is not held, and what is left of it is the tombstone that
    # keeps the lost lease's fencing token until it expires (the margin after the deadline).
    res = guard.lock_resource("k")
    assert not RedisLockProvider(client).is_locked(res)
    state = keyspace.parse_lock(client.get(res).decode())
    assert state.fencing_token == tokens[0]
    assert 0 < client.pttl(res) <= keyspace.FENCE_MARGIN_MS
    via_proxy.close()


def test_redis_errors_that_are_not_connection_errors(client: redis.Redis, key_prefix: str) -> None:
    pair = Pair(client, key_prefix)
    client.rpush(pair.guard.record_key("k"), "a list, neither a record string nor a v1 hash")
    with pytest.raises(IdempotencyBackendError) as caught:
        pair.store.get(pair.guard.record_key("k"))
    assert not isinstance(caught.value, IdempotencyConnectionError)
    assert isinstance(caught.value.__cause__, redis.exceptions.ResponseError)
    with pytest.raises(IdempotencyBackendError) as guarded:
        pair.guard.execute("k", lambda: "never")
    assert guarded.value.key == "k"
    assert isinstance(guarded.value.__cause__, redis.exceptions.ResponseError)
    assert not pair.provider.is_locked(pair.guard.lock_resource("k"))
