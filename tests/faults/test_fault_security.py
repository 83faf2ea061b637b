"""Security: what someone who can write to the Redis, or who holds another lease, can not do;
and the deployments that keep them out (ACL users, TLS).

- A planted pickle record is refused (``RecordDecodeError``) and never loaded: its payload
  would create a marker file, which must not exist afterwards.
- A foreign holder (another owner, a guessed token, an expired lease) cannot release or renew.
- Two tasks given the same explicit key never see each other's results.
- An ACL user limited to the key prefix and the commands the library needs is enough; a
  ``rediss://`` server with a certificate made in the test (trustme) works, and refuses a
  client that does not trust the CA.
"""

from __future__ import annotations

import pickle
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyMismatchError,
    IdempotentTask,
    Lease,
    RecordDecodeError,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from tests.faults.fault_app import finalize_quietly
from tests.faults.faultlib import record_figures
from tests.support.leases import lease_left_ms
from tests.support.redis_server import RedisServer

ServerFactory = Callable[..., RedisServer]
PICKLE = "application/x-python-serialize"
FIGURES: dict[str, int] = {"planted_records_refused": 0, "forged_releases_refused": 0}


class Boom:
    """Unpickling this opens ``path`` for writing: the file's existence proves a load."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (str(self.path), "w"))


def plant(client: redis.Redis, record_key: str, **fields: str | bytes) -> None:
    """Write a record hash as the library lays it out, with the given fields overridden."""
    values: dict[str, str | bytes] = {
        "v": "1",
        "ct": "application/json",
        "enc": "utf-8",
        "data": '"planted"',
        "fp": "",
        "at": "0.0",
        "fence": "1",
    }
    values.update(fields)
    pipe = client.pipeline(transaction=True)
    for name, value in values.items():
        pipe.hset(record_key, name, value)
    pipe.execute()


# --------------------------------------------------------------------------- planted records


def test_the_pickle_payload_is_live(tmp_path: Path) -> None:
    """Control: the payload used below really creates its file when unpickled."""
    control = tmp_path / "control"
    pickle.loads(pickle.dumps(Boom(control)))  # noqa: S301 - the point of the control
    assert control.exists()


def test_a_planted_pickle_record_is_refused_and_never_loaded(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis, tmp_path: Path
) -> None:
    marker = tmp_path / "pwned"
    plant(
        redis_client,
        guard.record_key("victim"),
        ct=PICKLE,
        enc="binary",
        data=pickle.dumps(Boom(marker)),
    )
    calls: list[int] = []
    with pytest.raises(RecordDecodeError) as info:
        guard.execute("victim", lambda: calls.append(1))
    assert info.value.key == "victim"
    assert info.value.content_type == PICKLE
    assert PICKLE in str(info.value)
    assert "not loaded" in str(info.value)
    assert not marker.exists(), "the planted pickle was deserialized"
    assert calls == [], "a refused record must not let the body run either"
    assert not guard.lock_provider.is_locked(guard.lock_resource("victim"))
    with pytest.raises(RecordDecodeError):
        guard.store.get(guard.record_key("victim"))
    assert not marker.exists()
    FIGURES["planted_records_refused"] += 1


def test_a_planted_pickle_record_is_refused_through_a_task_too(
    redis_url: str, redis_client: redis.Redis, key_prefix: str, tmp_path: Path
) -> None:
    """The app's accept list (JSON only) is what the task's store loads with."""
    app = Celery("planted", set_as_current=False)
    app.conf.update(
        idempotency_url=redis_url,
        idempotency_key_prefix=key_prefix,
        result_serializer="json",
        accept_content=["json"],
    )

    @app.task(base=IdempotentTask, shared=False, name="planted.refund")
    def refund(order: int) -> str:
        return "refunded"

    finalize_quietly(app)
    marker = tmp_path / "pwned"
    plant(
        redis_client,
        f"{key_prefix}{{planted.refund:key:order-7}}",
        ct=PICKLE,
        enc="binary",
        data=pickle.dumps(Boom(marker)),
    )
    with pytest.raises(RecordDecodeError):
        refund.apply((7,), headers={"idempotency_key": "order-7"}, throw=True)
    assert not marker.exists()
    app.close()
    FIGURES["planted_records_refused"] += 1


@pytest.mark.parametrize(
    ("fields", "words"),
    [
        ({"ct": "application/x-yaml", "enc": "utf-8", "data": "!!python/object:os.system"}, "yaml"),
        ({"v": "9"}, "version"),
        ({"data": "{not json"}, "corrupt"),
        ({"fence": "not-a-number"}, "corrupt"),
    ],
    ids=["yaml", "future-version", "bad-json", "bad-fence"],
)
def test_other_foreign_or_corrupt_records_are_refused_with_a_clear_error(
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    fields: dict[str, str],
    words: str,
) -> None:
    plant(redis_client, guard.record_key("odd"), **fields)
    calls: list[int] = []
    with pytest.raises(RecordDecodeError, match=words):
        guard.execute("odd", lambda: calls.append(1))
    assert calls == []
    FIGURES["planted_records_refused"] += 1


def test_a_key_of_another_type_is_a_backend_error_not_a_crash(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis
) -> None:
    redis_client.set(guard.record_key("squatted"), "a plain string, not a record hash")
    with pytest.raises(IdempotencyBackendError, match="WRONGTYPE"):
        guard.execute("squatted", lambda: 1)
    assert not guard.lock_provider.is_locked(guard.lock_resource("squatted"))


# --------------------------------------------------------------------------- foreign holders


def test_a_foreign_holder_can_neither_release_nor_renew(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    alice = RedisLockProvider(redis_client, owner_id="alice")
    mallory = RedisLockProvider(redis_client, owner_id="mallory")
    resource = f"{key_prefix}lock:{{account-1}}"
    lease = alice.acquire(resource, 5.0)
    assert lease is not None
    pttl = lease_left_ms(redis_client, resource)
    assert mallory.acquire(resource, 5.0) is None
    forged = [
        Lease(resource, "0" * 24 + "@mallory", lease.fencing_token),
        Lease(resource, "0" * 24 + "@alice", lease.fencing_token),  # knows the owner, not the token
        Lease(resource, lease.token.split("@")[0] + "@mallory", lease.fencing_token + 1),
        Lease(resource, lease.token + "x", lease.fencing_token),
        Lease(resource, "", lease.fencing_token),
    ]
    for fake in forged:
        assert mallory.release(fake) is False, fake
        assert mallory.extend(fake, 3600.0) is False, fake
        assert alice.release(fake) is False, "the token decides, not the provider"
        FIGURES["forged_releases_refused"] += 1
    assert mallory.holder(resource) == lease.token
    assert lease_left_ms(redis_client, resource) <= pttl, "a forged extend lengthened the lease"
    assert alice.release(lease) is True


def test_an_expired_holder_can_neither_release_nor_renew_the_next_holders_lease(
    redis_client: redis.Redis, key_prefix: str
) -> None:
    old = RedisLockProvider(redis_client, owner_id="stalled-worker")
    new = RedisLockProvider(redis_client, owner_id="next-worker")
    resource = f"{key_prefix}lock:{{job-9}}"
    stale = old.acquire(resource, 0.2)
    assert stale is not None
    time.sleep(0.3)
    current = new.acquire(resource, 5.0)
    assert current is not None
    assert current.fencing_token > stale.fencing_token
    assert old.extend(stale, 60.0) is False
    assert old.release(stale) is False
    assert new.holder(resource) == current.token
    assert 0 < lease_left_ms(redis_client, resource) <= 5000
    FIGURES["forged_releases_refused"] += 2


def test_two_tasks_with_the_same_explicit_key_never_see_each_others_results(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    app = Celery("namespaces", set_as_current=False)
    app.conf.update(idempotency_url=redis_url, idempotency_key_prefix=key_prefix)
    calls: list[str] = []

    @app.task(base=IdempotentTask, shared=False, name="ns.charge")
    def charge(amount: int) -> str:
        calls.append("charge")
        return f"charged {amount}"

    @app.task(base=IdempotentTask, shared=False, name="ns.refund")
    def refund(amount: int) -> str:
        calls.append("refund")
        return f"refunded {amount}"

    finalize_quietly(app)
    same = {"idempotency_key": "order-42"}
    assert charge.apply((10,), headers=same, throw=True).get() == "charged 10"
    assert refund.apply((10,), headers=same, throw=True).get() == "refunded 10"
    assert charge.apply((10,), headers=same, throw=True).get() == "charged 10"
    assert refund.apply((10,), headers=same, throw=True).get() == "refunded 10"
    assert calls == ["charge", "refund"]
    # the header key is in force: the same key with another payload is refused, per task
    with pytest.raises(IdempotencyMismatchError):
        charge.apply((11,), headers=same, throw=True)
    records = sorted(
        name.decode()
        for name in redis_client.scan_iter(match=f"{key_prefix}*", count=1000)
        if not name.endswith(b":fence")
    )
    assert records == [
        f"{key_prefix}{{ns.charge:key:order-42}}",
        f"{key_prefix}{{ns.refund:key:order-42}}",
    ]
    app.close()


# --------------------------------------------------------------------------- ACL and TLS

#: What the library needs, on its own keys only: reads and writes (minus FLUSHALL, KEYS and the
#: other @dangerous ones), its scripts (EVALSHA, SCRIPT LOAD once), PING, and TIME, which the
#: claim script calls for fencing tokens. No EVAL of arbitrary Lua, no FUNCTION, no CONFIG.
ACL_RULES = (
    "~{prefix}* resetchannels -@all +@read +@write -@dangerous +evalsha +script|load +ping +time"
)


@pytest.mark.slow
def test_an_acl_user_limited_to_its_prefix_and_the_needed_commands_is_enough(
    redis_server_factory: ServerFactory, tmp_path: Path
) -> None:
    rules = ACL_RULES.format(prefix="app:")
    server = redis_server_factory(acl_users=[f"app on >app-secret {rules}", "default off"])
    url = server.url_for("app", "app-secret")

    def make(prefix: str) -> DistributedIdempotencyGuard:
        return DistributedIdempotencyGuard(
            store=RedisIdempotencyStore(url=url),
            lock_provider=RedisLockProvider(url=url, key_prefix=prefix),
            key_prefix=prefix,
            lock_ttl=1.0,
            retry_count=0,
        )

    guard = make("app:")
    assert guard.execute("k", lambda: "v", input={"a": 1}) == "v"
    assert guard.execute("k", lambda: "again", input={"a": 1}) == "v"
    with pytest.raises(IdempotencyMismatchError):
        guard.execute("k", lambda: "x", input={"a": 2})

    def long_body() -> str:
        time.sleep(2.0)  # two lease lengths: renewals (EVALSHA) pass the ACL
        return "renewed"

    assert guard.execute("long", long_body) == "renewed"
    guard.lock_provider.clear()  # SCAN + DEL under the prefix
    assert guard.store.delete(guard.record_key("k")) is True

    # the limits are real: other prefixes and admin commands are refused, clearly
    with pytest.raises(IdempotencyBackendError, match="permission"):
        make("other:").execute("k", lambda: 1)
    client = redis.Redis.from_url(url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.flushall()
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.config_get("requirepass")
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.eval("return 1", 0)
    client.close()
    # the default user is off: no anonymous access
    with pytest.raises(IdempotencyConnectionError):
        DistributedIdempotencyGuard(
            store=RedisIdempotencyStore(url=server.url_for()),
            lock_provider=RedisLockProvider(url=server.url_for()),
            key_prefix="app:",
        ).execute("k", lambda: 1)
    record_figures("security", **FIGURES, acl_user_ok=1)


@pytest.mark.slow
def test_rediss_with_a_certificate_made_in_the_test(
    redis_server_factory: ServerFactory,
) -> None:
    server = redis_server_factory(tls=True, tls_only=True, password="tls-secret")
    assert server.port == 0, "TLS only: no plain port to fall back to"
    url = f"{server.tls_url}?ssl_ca_certs={server.tls_ca_file}"
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(url=url), lock_provider=RedisLockProvider(url=url)
    )
    assert guard.execute("tls", lambda: "over TLS") == "over TLS"
    assert guard.execute("tls", lambda: "again") == "over TLS"
    # a client that does not trust the test CA is refused: the certificate is checked
    untrusted = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(url=server.tls_url),
        lock_provider=RedisLockProvider(url=server.tls_url),
    )
    with pytest.raises(IdempotencyConnectionError, match=r"(?i)certificate"):
        untrusted.execute("tls", lambda: "x")
    record_figures("security", **FIGURES, tls_ok=1)
