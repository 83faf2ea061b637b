"""Bad input against a real Redis: each gets a clear error that names the culprit, the lock is
left free and nothing is stored.

Results the serializer refuses, arguments the fingerprint refuses, odd keys (unicode, braces,
newlines, NUL, lone surrogates, 10 kB), bad settings (guard and ``IdempotentTask``), an
unreachable Redis and a wrong password.
"""

from __future__ import annotations

import functools
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis
from celery import Celery

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyConnectionError,
    IdempotencyMismatchError,
    IdempotentTask,
    RedisIdempotencyStore,
    RedisLockProvider,
    ResultEncodeError,
)
from celery_idempotent.core.fingerprint import slot_key
from celery_idempotent.servers.processes import free_port
from tests.faults.fault_app import finalize_quietly
from tests.faults.faultlib import record_figures
from tests.support.leases import is_tombstone, lease_held
from tests.support.redis_server import RedisServer

ServerFactory = Callable[..., RedisServer]
FIGURES: dict[str, int] = {"bad_inputs": 0}


def counted() -> None:
    FIGURES["bad_inputs"] += 1
    record_figures("bad input (clear error, lock free, nothing stored)", **FIGURES)


def keys_under(client: redis.Redis, prefix: str) -> list[bytes]:
    """Every key under ``prefix`` except those that outlive leases by design to keep fencing
    tokens increasing: fence keys, and locks whose lease has ended (tombstones)."""
    return sorted(
        name
        for name in client.scan_iter(match=f"{prefix}*", count=1000)
        if not name.endswith(b":fence") and not is_tombstone(client, name)
    )


# --------------------------------------------------------------------------- results


class Opaque:
    def __repr__(self) -> str:
        return "<Opaque>"


@pytest.mark.parametrize(
    ("result", "type_name"),
    [({1, 2}, "set"), (Opaque(), "Opaque"), (object(), "object"), (b"\xff" * 3, None)],
    ids=["set", "custom-object", "object", "bytes"],
)
def test_a_result_the_serializer_refuses_is_not_stored_and_the_key_runs_again(
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    key_prefix: str,
    result: Any,
    type_name: str | None,
) -> None:
    calls: list[int] = []

    def body() -> Any:
        calls.append(1)
        return result

    if type_name is None:  # kombu's JSON carries bytes: a control, it must round-trip
        assert guard.execute("r", body) == result
        assert guard.execute("r", body) == result
        assert calls == [1]
        return
    with pytest.raises(ResultEncodeError) as info:
        guard.execute("r", body)
    assert info.value.key == "r"
    assert info.value.result is result, "the caller needs what the body returned"
    assert type_name in str(info.value), str(info.value)
    assert "json" in str(info.value)
    assert not guard.lock_provider.is_locked(guard.lock_resource("r"))
    assert keys_under(redis_client, key_prefix) == []
    assert guard.execute("r", lambda: "fixed") == "fixed", "the next call must run again"
    counted()


# --------------------------------------------------------------------------- arguments


@pytest.mark.parametrize(
    ("payload", "type_name"),
    [({"x": object()}, "builtins.object"), ([1, {2, 3}], "builtins.set"), (Opaque(), "Opaque")],
    ids=["object", "set", "custom"],
)
def test_arguments_the_fingerprint_refuses_raise_typeerror_before_anything_is_locked(
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    key_prefix: str,
    payload: Any,
    type_name: str,
) -> None:
    calls: list[int] = []
    with pytest.raises(TypeError, match=type_name):
        guard.execute("fp", lambda: calls.append(1), input=payload)
    assert calls == []
    assert list(redis_client.scan_iter(match=f"{key_prefix}*")) == []  # not even a fence
    counted()


def test_a_task_with_unfingerprintable_arguments_fails_naming_the_type(
    redis_url: str, redis_client: redis.Redis, key_prefix: str
) -> None:
    app = Celery("bad-args", set_as_current=False)
    app.conf.update(idempotency_url=redis_url, idempotency_key_prefix=key_prefix)

    @app.task(base=IdempotentTask, shared=False, name="bad.args")
    def consume(item: Any) -> str:
        return "ran"

    finalize_quietly(app)
    with pytest.raises(TypeError, match=r"builtins\.set"):
        consume.apply(({1, 2},), throw=True)
    assert list(redis_client.scan_iter(match=f"{key_prefix}*")) == []
    app.close()
    counted()


# --------------------------------------------------------------------------- keys

ODD_KEYS = {
    "unicode": "ключ-🔑-clé",
    "braces": "{order}:{42}",
    "open-brace": "a{b",
    "newline": "line1\nline2\r\n",
    "nul": "a\x00b",
    "glob": "*?[x]\\",
    "10kB": "k" * 10_240,
    "10kB-unicode": "é" * 10_240,
    "lone-surrogate": "half\ud800pair",  # not encodable as UTF-8: shortened to a digest
    "other-surrogate": "half\udfffpair",
}


def test_odd_keys_work_stay_distinct_and_share_one_cluster_slot(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis, key_prefix: str
) -> None:
    from redis.crc import key_slot

    for name, key in ODD_KEYS.items():
        assert guard.execute(key, functools.partial(str, name)) == name
        assert guard.execute(key, lambda: "again") == name, f"{name}: not replayed"
        lock, record = guard.lock_resource(key), guard.record_key(key)
        assert redis_client.exists(record), f"{name}: no record under {record[:80]!r}"
        assert not lease_held(redis_client, lock), f"{name}: lock left behind"
        assert key_slot(lock.encode()) == key_slot(record.encode()), f"{name}: slots differ"
        assert record.startswith(key_prefix)
        assert len(record) < len(key_prefix) + 300, "long keys are shortened in Redis names"
    # near-collisions stay apart: same readable head, different tails; braces vs parentheses
    twins = ["k" * 10_240 + "a", "k" * 10_240 + "b", "(x):(1)", "{x}:{1}"]
    for index, key in enumerate(twins):
        assert guard.execute(key, functools.partial(int, index)) == index
    assert len({slot_key(k) for k in twins}) == len(twins)
    stored = keys_under(redis_client, key_prefix)
    assert len(stored) == len(ODD_KEYS) + len(twins)
    counted()


@pytest.mark.parametrize(
    ("key", "error", "words"),
    [
        ("", ValueError, "empty"),
        (b"bytes", TypeError, "bytes"),
        (42, TypeError, "int"),
        (None, TypeError, "NoneType"),
    ],
    ids=["empty", "bytes", "int", "none"],
)
def test_a_key_that_is_not_a_nonempty_str_is_refused_before_redis(
    guard: DistributedIdempotencyGuard, key: Any, error: type[Exception], words: str
) -> None:
    with pytest.raises(error, match=words) as info:
        guard.execute(key, lambda: 1)
    assert "key" in str(info.value)
    client: redis.Redis = guard.store.client  # type: ignore[attr-defined]
    assert list(client.scan_iter(match=f"{guard.key_prefix}*")) == []
    counted()


# --------------------------------------------------------------------------- settings

GUARD_OPTIONS: list[tuple[str, Any, type[Exception]]] = [
    # ttl=0 is a mode since 0.2.0 (nothing kept once the body ends): not a bad value.
    ("ttl", -0.5, ValueError),
    ("ttl", -1, ValueError),
    ("ttl", "60", TypeError),
    ("ttl", None, TypeError),
    ("ttl", float("nan"), ValueError),
    ("lock_ttl", 0, ValueError),
    ("lock_ttl", -0.5, ValueError),
    ("lock_ttl", True, TypeError),
    ("retry_count", -1, ValueError),
    ("retry_count", 1.5, TypeError),
    ("retry_count", "3", TypeError),
    ("retry_base_delay", -0.1, ValueError),
    ("retry_base_delay", [0.1], TypeError),
    ("renew_interval", 0, ValueError),
    ("key_prefix", "bad{prefix}:", ValueError),
    ("key_prefix", 7, TypeError),
    ("clock", 12.0, TypeError),
]


@pytest.mark.parametrize(
    ("option", "value", "error"),
    GUARD_OPTIONS,
    ids=[f"{o}={v!r}" for o, v, _ in GUARD_OPTIONS],
)
def test_a_bad_guard_option_fails_at_construction_naming_it(
    redis_client: redis.Redis, option: str, value: Any, error: type[Exception]
) -> None:
    with pytest.raises(error) as info:
        DistributedIdempotencyGuard(
            store=RedisIdempotencyStore(redis_client),
            lock_provider=RedisLockProvider(redis_client),
            **{option: value},
        )
    assert option in str(info.value), str(info.value)
    counted()


TASK_SETTINGS: list[tuple[str, Any, type[Exception]]] = [
    ("idempotency_ttl", -1, ValueError),
    ("idempotency_lock_ttl", -5, ValueError),
    ("idempotency_lock_ttl", "10", TypeError),
    ("idempotency_retry_count", -1, ValueError),
    ("idempotency_retry_count", 2.5, TypeError),
    ("idempotency_retry_base_delay", -1, ValueError),
    ("idempotency_on_locked", "sometimes", ValueError),
    ("idempotency_key_prefix", "", ValueError),
    ("idempotency_enabled", "yes", TypeError),
    ("idempotency_url", "http://127.0.0.1:6379/0", ValueError),
    ("idempotency_key", 42, TypeError),
]


@pytest.mark.parametrize("where", ["app.conf", "task option"])
@pytest.mark.parametrize("case", TASK_SETTINGS, ids=[f"{s}={v!r}" for s, v, _ in TASK_SETTINGS])
def test_a_bad_task_setting_fails_the_call_naming_it_and_touches_nothing(
    redis_url: str,
    redis_client: redis.Redis,
    key_prefix: str,
    case: tuple[str, Any, type[Exception]],
    where: str,
) -> None:
    setting, value, error = case
    app = Celery("bad-settings", set_as_current=False)
    app.conf.update(idempotency_url=redis_url, idempotency_key_prefix=key_prefix)
    options: dict[str, Any] = {}
    if where == "app.conf":
        app.conf[setting] = value
    else:
        options[setting] = value
    calls: list[int] = []

    @app.task(base=IdempotentTask, shared=False, name="bad.settings", **options)
    def job(x: int) -> int:
        calls.append(x)
        return x

    finalize_quietly(app)
    with pytest.raises(error) as info:
        job.apply((1,), throw=True)
    assert setting in str(info.value), str(info.value)
    assert "bad.settings" in str(info.value), "the message names the task"
    assert calls == []
    assert list(redis_client.scan_iter(match=f"{key_prefix}*")) == []
    app.close()
    counted()


# --------------------------------------------------------------------------- reachability


def test_an_unreachable_redis_url_fails_fast_with_a_connection_error() -> None:
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(url=url), lock_provider=RedisLockProvider(url=url)
    )
    started = time.monotonic()
    with pytest.raises(IdempotencyConnectionError) as info:
        guard.execute("k", lambda: 1)
    assert time.monotonic() - started < 3, "a closed port must not hang the caller"
    assert "refused" in str(info.value).lower(), str(info.value)
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    counted()


@pytest.fixture
def eager_app_on_a_closed_port() -> Iterator[Celery]:
    app = Celery("unreachable", set_as_current=False)
    app.conf.idempotency_url = f"redis://127.0.0.1:{free_port()}/0"
    yield app
    app.close()


def test_an_eager_task_on_an_unreachable_redis_fails_instead_of_waiting_forever(
    eager_app_on_a_closed_port: Celery,
) -> None:
    """``apply()``/``task_always_eager`` has no queue to come back through: waiting in place
    for a Redis that may never answer (a wrong URL) would hang the caller for good."""
    calls: list[int] = []

    @eager_app_on_a_closed_port.task(base=IdempotentTask, shared=False, name="unreachable.job")
    def job(x: int) -> int:
        calls.append(x)
        return x

    finalize_quietly(eager_app_on_a_closed_port)
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = job.apply((1,), throw=True).get()
        except BaseException as exc:
            outcome["error"] = exc

    started = time.monotonic()
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive(), "apply() is still waiting for Redis after 10 s"
    assert isinstance(outcome.get("error"), IdempotencyConnectionError), outcome
    assert time.monotonic() - started < 5
    assert calls == []
    counted()


def test_a_wrong_password_is_a_connection_error_that_does_not_leak_the_password(
    redis_server_factory: ServerFactory,
) -> None:
    server = redis_server_factory(password="right-horse-battery")
    url = server.url_for(password="wrong-horse-battery")
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(url=url), lock_provider=RedisLockProvider(url=url)
    )
    with pytest.raises(IdempotencyConnectionError) as info:
        guard.execute("k", lambda: 1)
    text = str(info.value)
    assert "password" in text.lower() or "auth" in text.lower(), text
    assert "wrong-horse-battery" not in text
    assert "right-horse-battery" not in text
    assert isinstance(info.value.__cause__, redis.AuthenticationError)
    # the right password works, and the failed attempt left nothing behind
    good = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(url=server.url), lock_provider=RedisLockProvider(url=server.url)
    )
    assert good.execute("k", lambda: "ok") == "ok"
    counted()


def test_a_mismatch_is_refused_without_running_or_overwriting(
    guard: DistributedIdempotencyGuard, redis_client: redis.Redis
) -> None:
    assert guard.execute("pay", lambda: "charged", input={"amount": 10}) == "charged"
    with pytest.raises(IdempotencyMismatchError) as info:
        guard.execute("pay", lambda: "charged twice", input={"amount": 11})
    assert info.value.key == "pay"
    assert info.value.stored_fingerprint != info.value.fingerprint
    assert guard.execute("pay", lambda: "again", input={"amount": 10}) == "charged"
    assert not lease_held(redis_client, guard.lock_resource("pay"))
    counted()
