"""The lean path (``backends/redis/lean.py``) against redis-py's own path on the failures the
fault suite covers beyond a plain server: a server still loading its data (``LOADING``), a
demoted master (``READONLY``, on a plain client and behind Sentinel), TLS and ACL users.

Each test makes the failure for real on private ``redis-server`` processes and runs the same
guarded calls twice, once on the lean path and once with it switched off
(``CELERY_IDEMPOTENT_REDIS_LEAN=0``: every script through ``Script.__call__``), and compares
what the caller sees: the reply, or the library's exception and the redis-py exception it
chains; and what the connection's ``Retry`` saw: each attempt's error, in order (so a retry
made by one path and not the other, or an error of another type, fails the comparison).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import pytest

from celery_idempotent import DistributedIdempotencyGuard
from celery_idempotent.backends.redis import lean
from celery_idempotent.backends.redis.locks import RedisLockProvider
from celery_idempotent.backends.redis.store import RedisIdempotencyStore
from tests.support.redis_server import RedisServer
from tests.support.sentinel import RedisSentinelGroup

pytestmark = pytest.mark.redis

redis = pytest.importorskip("redis")

ServerFactory = Callable[..., RedisServer]
PATHS = ("lean", "redis-py")


class RecordingRetry(redis.retry.Retry):  # type: ignore[misc, name-defined]
    """A ``Retry`` that notes every failed attempt's error (redis-py's pool also calls
    ``connect()``, a no-op on a connected connection, through it at every checkout: only the
    errors are compared).

    redis-py deep-copies the ``retry=`` it is given into each connection; this one is shared,
    so that the test reads what every connection of the client saw.
    """

    def __init__(self, retries: int, backoff: float = 0.0) -> None:
        super().__init__(redis.backoff.ConstantBackoff(backoff), retries)
        self.seen: list[str] = []
        self.messages: list[str] = []

    def __deepcopy__(self, memo: dict[int, Any]) -> RecordingRetry:
        return self

    def call_with_retry(self, do: Callable[[], Any], fail: Any, *args: Any, **kwargs: Any) -> Any:
        def attempt() -> Any:
            try:
                out = do()
            except Exception as exc:
                self.seen.append(type(exc).__name__)
                self.messages.append(f"{type(exc).__name__}: {exc}")
                raise
            return out

        return super().call_with_retry(attempt, fail, *args, **kwargs)


def _guard(client: Any, prefix: str, *, lean_on: bool) -> DistributedIdempotencyGuard:
    store = RedisIdempotencyStore(client)
    if lean_on:
        assert isinstance(store._lean, lean.LeanScripts), lean.why_not_lean(client)
    else:
        assert store._lean is None
    return DistributedIdempotencyGuard(
        store=store,
        lock_provider=RedisLockProvider(client, key_prefix=prefix),
        key_prefix=prefix,
        retry_count=0,
    )


@pytest.fixture
def make_guard(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    """``make_guard(path, client, prefix)``: a guard on the lean path or on redis-py's."""

    def make(path: str, client: Any, prefix: str) -> DistributedIdempotencyGuard:
        if path == "lean":
            monkeypatch.delenv(lean.ENV_SWITCH, raising=False)
        else:
            monkeypatch.setenv(lean.ENV_SWITCH, "0")
        try:
            return _guard(client, prefix, lean_on=path == "lean")
        finally:
            monkeypatch.delenv(lean.ENV_SWITCH, raising=False)

    return make


def outcome(call: Callable[[], Any]) -> tuple[str, str | None, Any]:
    """``("ok", None, value)`` or ``(library error, redis-py error it chains, None)``."""
    try:
        value = call()
    except Exception as exc:
        cause = exc.__cause__
        return type(exc).__name__, None if cause is None else type(cause).__name__, None
    return "ok", None, getattr(value, "value", value)  # a guard.run Outcome: its value


def held_connections(guard: DistributedIdempotencyGuard) -> list[Any]:
    """The connections the lean path of ``guard``'s store holds (free ones: between calls)."""
    scripts = guard.store._lean  # type: ignore[attr-defined]
    assert scripts is not None
    return list(scripts._free)


# --------------------------------------------------------------------------- LOADING


def _answers_loading(server: RedisServer) -> bool:
    try:
        with socket.create_connection((server.host, server.port), timeout=0.5) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(64).startswith(b"-LOADING")
    except OSError:
        return False


def test_loading_is_refused_and_retried_as_through_redis_py(
    redis_server_factory: ServerFactory, key_prefix: str, make_guard: Callable[..., Any]
) -> None:
    """A restarted server loading a 4000-key snapshot (slowed to ~1 ms a key) answers
    ``-LOADING`` to the scripts: redis-py makes that a ``BusyLoadingError`` (a connection
    error): without retries the call fails with :class:`IdempotencyConnectionError` after one
    attempt, with retries it is retried until the data is loaded and then replays a record
    written before the restart. Same on both paths."""
    server = redis_server_factory(
        extra_config=["key-load-delay 1000", "loading-process-events-interval-bytes 1024"]
    )
    admin = redis.Redis.from_url(server.url)
    pipe = admin.pipeline(transaction=False)
    for i in range(4000):
        pipe.set(f"filler:{i}", "x" * 32)
    pipe.execute()
    for path in PATHS:
        before = make_guard(path, admin, f"{key_prefix}{path}:")
        assert before.run("saved", lambda path=path: path).value == path
    admin.save()
    admin.close()
    server.stop()
    restart = threading.Thread(target=server.start, daemon=True)
    restart.start()
    deadline = time.monotonic() + 15
    while not _answers_loading(server):
        assert time.monotonic() < deadline, "the server never answered LOADING"
        time.sleep(0.005)

    results: dict[str, dict[str, Any]] = {}
    retrying: dict[str, tuple[Any, RecordingRetry]] = {}
    for path in PATHS:
        once = RecordingRetry(0)
        client = redis.Redis.from_url(server.url, retry=once)
        guard = make_guard(path, client, f"{key_prefix}{path}:")
        results[path] = {"no retries": outcome(lambda g=guard: g.run("during", lambda: 1))}
        results[path]["attempts"] = list(once.seen)
        assert _answers_loading(server), "loading ended before both paths were tried: slow it"
        client.close()
        many = RecordingRetry(200, backoff=0.05)
        retrying[path] = (redis.Redis.from_url(server.url, retry=many), many)

    calls: list[str] = []
    for path in PATHS:
        client, many = retrying[path]
        guard = make_guard(path, client, f"{key_prefix}{path}:")
        results[path]["with retries"] = outcome(
            lambda g=guard, p=path: g.run("saved", lambda: calls.append(p))
        )
        results[path]["loading errors"] = many.seen.count("BusyLoadingError") > 0
        client.close()
    restart.join(30)
    assert not restart.is_alive()

    assert results["lean"]["no retries"] == (
        "IdempotencyConnectionError",
        "BusyLoadingError",
        None,
    ), results
    assert results["lean"]["attempts"] == ["BusyLoadingError"], results
    assert results["redis-py"]["no retries"] == results["lean"]["no retries"], results
    assert results["redis-py"]["attempts"] == results["lean"]["attempts"], results
    # The first of the two retried calls met LOADING for sure (it began while the server was
    # loading); the second may begin after: both end replaying what was saved.
    assert results["lean"]["with retries"] == ("ok", None, "lean"), results
    assert results["redis-py"]["with retries"] == ("ok", None, "redis-py"), results
    assert results["lean"]["loading errors"] is True, results
    assert calls == []


# --------------------------------------------------------------------------- READONLY


def _wait_link_up(replica: Any, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while replica.info("replication").get("master_link_status") != "up":
        assert time.monotonic() < deadline, replica.info("replication")
        time.sleep(0.05)


def test_readonly_on_a_demoted_master_is_refused_as_through_redis_py(
    redis_server_factory: ServerFactory, key_prefix: str, make_guard: Callable[..., Any]
) -> None:
    """A plain client (no Sentinel) on a master that becomes a replica: redis-py raises
    ``ReadOnlyError`` (a reply, not retried), the library a connection error (re-queue); the
    connection stays usable, and once the server is a master again the next call on the same
    connection succeeds. Same on both paths, with the lean path's connection kept."""
    primary = redis_server_factory()
    other = redis_server_factory()
    admin = redis.Redis.from_url(primary.url)
    found: dict[str, list[Any]] = {}
    for path in PATHS:
        retry = RecordingRetry(3)
        client = redis.Redis.from_url(primary.url, retry=retry)
        guard = make_guard(path, client, f"{key_prefix}{path}:")
        assert guard.run("warm", lambda: 0).value == 0
        held = held_connections(guard) if path == "lean" else []
        admin.execute_command("REPLICAOF", other.host, str(other.port))
        _wait_link_up(admin)
        retry.seen.clear()
        refused = outcome(lambda g=guard: g.run("demoted", lambda: 1))
        attempts = list(retry.seen)
        admin.execute_command("REPLICAOF", "NO", "ONE")
        after = outcome(lambda g=guard: g.run("promoted", lambda: 2))
        same_connection = held == held_connections(guard) if path == "lean" else True
        found[path] = [refused, attempts, after, same_connection]
        client.close()
    admin.close()
    assert found["lean"] == [
        ("IdempotencyConnectionError", "ReadOnlyError", None),
        ["ReadOnlyError"],
        ("ok", None, 2),
        True,
    ], found
    assert found["redis-py"] == found["lean"], found


def test_readonly_after_a_sentinel_failover_as_through_redis_py(
    redis_sentinel: RedisSentinelGroup, make_guard: Callable[..., Any]
) -> None:
    """Behind Sentinel, a connection still open to the old master after a failover gets
    ``READONLY`` once that master is demoted; redis-py's Sentinel connection turns it into a
    ``ConnectionError`` and disconnects. Its retries reconnect to the address it had (redis-py
    8's ``send_packed_command`` reconnects without asking the Sentinel), so the call in flight
    fails as a connection error (the delivery is re-queued) after every retry; the next call
    checks a connection out, which asks the Sentinel, and runs on the new master. The lean
    path holds its connection across calls: it must take the same turns."""
    clients: dict[str, tuple[RecordingRetry, DistributedIdempotencyGuard]] = {}
    for path in PATHS:
        retry = RecordingRetry(2)
        client = redis_sentinel.master_client(retry=retry)
        guard = make_guard(path, client, f"test:sentinel:{path}:")
        assert guard.run("warm", lambda: 0).value == 0  # a connection open to the master
        clients[path] = (retry, guard)
    old = redis_sentinel.master_address()
    new = redis_sentinel.failover(demote=False)
    # Demoted as Sentinel would, but without its CLIENT KILL: the open connections stay.
    demoted = redis_sentinel.admin(old)
    demoted.execute_command("REPLICAOF", new[0], str(new[1]))
    _wait_link_up(demoted)
    found: dict[str, list[Any]] = {}
    for path, (retry, guard) in clients.items():
        demoted.script_flush()  # each path finds the old master without its scripts
        retry.seen.clear()
        in_flight = outcome(lambda g=guard: g.run("after", lambda: "ran"))
        errors = list(retry.seen)
        retry.seen.clear()
        next_call = outcome(lambda g=guard: g.run("after", lambda: "ran"))
        found[path] = [in_flight, errors, next_call]
    assert found["lean"] == [
        ("IdempotencyConnectionError", "ConnectionError", None),
        ["NoScriptError"] + ["ConnectionError"] * 3,  # 3: the first send and two retries
        ("ok", None, "ran"),
    ], found
    assert found["redis-py"] == found["lean"], found
    assert all("previous master is now a slave" in m for m in retry.messages[1:4])
    written = redis_sentinel.admin(new).keys("test:sentinel:*after*")
    assert len(written) == 2, written  # one record of each path, on the new master


# --------------------------------------------------------------------------- TLS and ACL


@pytest.mark.slow
def test_tls_through_the_lean_path_as_through_redis_py(
    redis_server_factory: ServerFactory, make_guard: Callable[..., Any]
) -> None:
    """A TLS-only server with a certificate made in the test: the lean path's connection is
    the pool's ``SSLConnection`` (the CA checked, the password sent), it survives the server
    closing it while idle, and a client that does not trust the CA is refused with the same
    errors as through redis-py."""
    server = redis_server_factory(tls=True, tls_only=True, password="tls-secret")
    url = f"{server.tls_url}?ssl_ca_certs={server.tls_ca_file}"
    admin = server.client()
    found: dict[str, list[Any]] = {}
    for path in PATHS:
        client = redis.Redis.from_url(url)
        guard = make_guard(path, client, f"tls:{path}:")
        first = outcome(lambda g=guard: g.run("k", lambda: "over TLS"))
        kinds = [type(c).__name__ for c in held_connections(guard)] if path == "lean" else []
        assert admin.client_kill_filter(_type="normal", skipme=True) >= 1
        time.sleep(0.05)  # the server's close_notify and FIN have arrived
        again = outcome(lambda g=guard: g.run("k", lambda: "again"))
        untrusted = redis.Redis.from_url(server.tls_url)
        refused = outcome(
            lambda u=untrusted, p=path: make_guard(p, u, f"tls:{p}:").run("k", lambda: "x")
        )
        found[path] = [first, kinds, again, refused]
        client.close()
        untrusted.close()
    assert found["lean"] == [
        ("ok", None, "over TLS"),
        ["SSLConnection"],
        ("ok", None, "over TLS"),
        ("IdempotencyConnectionError", "ConnectionError", None),
    ], found
    found["lean"][1] = []
    assert found["redis-py"] == found["lean"], found


ACL_RULES = "~app:* resetchannels -@all +@read +@write -@dangerous +evalsha +ping +time"


@pytest.mark.slow
def test_acl_users_through_the_lean_path_as_through_redis_py(
    redis_server_factory: ServerFactory, make_guard: Callable[..., Any]
) -> None:
    """An ACL user limited to its prefix: the lean path's connection authenticates as that
    user; keys outside the prefix are refused (``NoPermissionError``: a backend error, not
    retried); a wrong password is an ``AuthenticationError`` (a connection error); a user
    that may not ``SCRIPT LOAD`` gets ``NOSCRIPT`` answered by a refused load after a script
    flush. Every one the same as through redis-py."""
    server = redis_server_factory(
        acl_users=[
            f"app on >app-secret {ACL_RULES} +script|load",
            f"noload on >noload-secret {ACL_RULES}",
            "admin on >admin-secret ~* &* +@all",
            "default off",
        ]
    )
    admin = redis.Redis.from_url(server.url_for("admin", "admin-secret"))
    found: dict[str, list[Any]] = {}
    for path in PATHS:
        retry = RecordingRetry(1)
        client = redis.Redis.from_url(server.url_for("app", "app-secret"), retry=retry)
        guard = make_guard(path, client, f"app:{path}:")
        row: list[Any] = [outcome(lambda g=guard: g.run("k", lambda: "v"))]
        if path == "lean":
            row.append([conn.username for conn in held_connections(guard)])
        retry.seen.clear()
        other = make_guard(path, client, f"other:{path}:")
        row.append(outcome(lambda o=other: o.run("k", lambda: "x")))
        row.append(list(retry.seen))
        row.append(outcome(lambda g=guard: g.run("k", lambda: "again")))

        wrong = redis.Redis.from_url(server.url_for("app", "wrong"))
        row.append(outcome(lambda w=wrong, p=path: make_guard(p, w, f"app:{p}:").run("w", int)))
        wrong.close()

        noload_client = redis.Redis.from_url(server.url_for("noload", "noload-secret"))
        noload = make_guard(path, noload_client, f"app:{path}:noload:")
        admin.script_flush()
        row.append(outcome(lambda n=noload: n.run("n", lambda: "n")))
        noload_client.close()
        found[path] = row
        client.close()
    admin.close()
    assert found["lean"][0] == ("ok", None, "v"), found
    assert found["lean"][2] == ("IdempotencyBackendError", "NoPermissionError", None), found
    assert found["lean"][3] == ["NoPermissionError"], found
    assert found["lean"][4] == ("ok", None, "v"), found
    assert found["lean"][5][:2] == ("IdempotencyConnectionError", "AuthenticationError"), found
    assert found["lean"][6] == ("IdempotencyBackendError", "NoPermissionError", None), found
    assert found["lean"][1] == ["app"], found
    del found["lean"][1]
    assert found["redis-py"] == found["lean"], found
