"""The lean path (``backends/redis/lean.py``): the claim, commit and publish scripts sent over
connections the process holds, with redis-py's behaviour on every failure.

Each failure is made for real on a real server (a connection killed by the server, a reply that
comes after the timeout, the script cache flushed, a restart, a fork), and the lean path must
answer as redis-py's ``Script.__call__`` answers: the same reply, the same error, and a
connection that is right again for the next call.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_idempotent import DistributedIdempotencyGuard
from celery_idempotent.backends.redis import lean
from celery_idempotent.backends.redis.locks import RedisLockProvider
from celery_idempotent.backends.redis.store import RedisIdempotencyStore
from celery_idempotent.core.exceptions import IdempotencyConnectionError
from tests.support.counting import RoundTrips, counting_client

pytestmark = pytest.mark.redis

redis = pytest.importorskip("redis")


def _guard(client: Any, prefix: str) -> DistributedIdempotencyGuard:
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client),
        lock_provider=RedisLockProvider(client, key_prefix=prefix),
        key_prefix=prefix,
        retry_count=0,
    )


@pytest.fixture
def client(redis_url: str) -> Iterator[Any]:
    c = redis.Redis.from_url(redis_url)
    yield c
    c.close()


def test_a_plain_client_takes_it_and_the_others_keep_todays_path(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    plain = redis.Redis.from_url(redis_url)
    assert lean.why_not_lean(plain) is None
    assert isinstance(RedisIdempotencyStore(plain)._lean, lean.LeanScripts)
    blocking = redis.Redis(
        connection_pool=redis.BlockingConnectionPool.from_url(redis_url, max_connections=4)
    )
    single = redis.Redis.from_url(redis_url, single_connection_client=True)
    bounded = redis.Redis.from_url(redis_url, max_connections=1)
    for other, why in (
        (blocking, "its pool is a BlockingConnectionPool"),
        (bounded, "its pool has room for 1 connection(s)"),
        (single, "a single-connection client"),
        (object(), "not a redis.Redis"),
    ):
        assert why in (lean.why_not_lean(other) or ""), other
    assert RedisIdempotencyStore(blocking)._lean is None
    monkeypatch.setenv(lean.ENV_SWITCH, "0")
    assert lean.why_not_lean(plain) == f"{lean.ENV_SWITCH} turns it off"
    assert RedisIdempotencyStore(plain)._lean is None
    for c in (plain, blocking, single, bounded):
        c.close()


def test_same_replies_and_round_trips_as_the_script_path(redis_url: str, key_prefix: str) -> None:
    """A first execution is two round trips (claim, commit), a duplicate one, on one connection
    that the calls reuse; the replay is the first execution's result."""
    trips = RoundTrips()
    c = counting_client(redis_url, trips)
    guard = _guard(c, key_prefix)
    assert isinstance(guard.store._lean, lean.LeanScripts)  # type: ignore[attr-defined]
    guard.run("k", lambda: {"v": 1}, input={"a": 1})  # scripts loaded, connection made
    n, sends = trips.measure(lambda: guard.run("k2", lambda: {"v": 2}, input={"a": 2}))
    assert (n, [s[0] for s in sends]) == (2, ["EVALSHA", "EVALSHA"])
    n, _ = trips.measure(lambda: guard.run("k2", lambda: {"v": 3}, input={"a": 2}))
    assert n == 1
    assert guard.run("k2", lambda: {"v": 3}, input={"a": 2}).value == {"v": 2}
    # One connection from the pool, held: the pool lent exactly one.
    assert c.connection_pool._created_connections == 1
    c.close()


def test_threads_each_get_a_connection_and_their_own_replies(client: Any, key_prefix: str) -> None:
    """Eight threads at once, 40 keys each: every call gets its own reply (a connection is
    never used by two callers at once), and no more connections than callers."""
    guard = _guard(client, key_prefix)
    barrier = threading.Barrier(8)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(40):
                out = guard.run(f"t{t}-{i}", lambda t=t, i=i: [t, i], input=[t, i])
                assert out.value == [t, i]
                assert guard.run(f"t{t}-{i}", lambda: None, input=[t, i]).value == [t, i]
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert 1 <= client.connection_pool._created_connections <= 8


def test_at_most_half_the_pools_bound_is_held(redis_url: str, key_prefix: str) -> None:
    """Four threads on a pool of at most 4 connections (redis-py raises past it): the lean path
    holds 2, the calls that find them busy go through the client, none finds the pool full."""
    c = redis.Redis.from_url(redis_url, max_connections=4)
    guard = _guard(c, key_prefix)
    barrier = threading.Barrier(4)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            barrier.wait()
            for i in range(30):
                assert guard.run(f"b{t}-{i}", lambda t=t: t).value == t
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert not errors, errors
    assert 1 <= guard.store._lean._held <= 2  # type: ignore[attr-defined]
    assert c.ping()
    c.close()


def test_noscript_after_a_flush_loads_the_script_and_sends_again(
    client: Any, key_prefix: str
) -> None:
    guard = _guard(client, key_prefix)
    assert guard.run("a", lambda: 1).value == 1
    client.script_flush()
    assert guard.run("b", lambda: 2).value == 2  # claim: NOSCRIPT, SCRIPT LOAD, EVALSHA
    assert guard.run("b", lambda: 3).value == 2


def test_a_connection_killed_while_idle_is_made_again_before_the_call(
    redis_url: str, key_prefix: str
) -> None:
    """Without retries (redis-py's default), the checkout's readiness check is what makes a
    connection the server closed while it sat idle transparent, as redis-py's pool does."""
    retry = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    c = redis.Redis.from_url(redis_url, retry=retry)
    admin = redis.Redis.from_url(redis_url)
    guard = _guard(c, key_prefix)
    assert guard.run("a", lambda: 1).value == 1
    killed = admin.client_kill_filter(_type="normal", skipme=True)
    assert killed >= 1
    time.sleep(0.05)  # the server's FIN has arrived
    assert guard.run("b", lambda: 2).value == 2
    assert guard.run("b", lambda: 3).value == 2
    c.close()
    admin.close()


def test_a_reply_after_the_timeout_is_never_read_as_the_next_calls(
    redis_url: str, key_prefix: str
) -> None:
    """The claim times out while the server is paused; its reply arrives later. The next call
    must not read it as its own: the connection was dropped, as redis-py drops it."""
    retry = redis.retry.Retry(redis.backoff.NoBackoff(), 0)
    c = redis.Redis.from_url(redis_url, socket_timeout=0.2, retry=retry)
    admin = redis.Redis.from_url(redis_url)
    guard = _guard(c, key_prefix)
    assert guard.run("warm", lambda: 0).value == 0
    admin.execute_command("CLIENT", "PAUSE", 600, "ALL")
    try:
        with pytest.raises(IdempotencyConnectionError):
            guard.run("slow", lambda: "slow")
    finally:
        time.sleep(0.7)  # the pause is over: the late reply has been sent
    assert guard.run("next", lambda: "next").value == "next"
    assert guard.run("next", lambda: "other").value == "next"
    c.close()
    admin.close()


def test_a_restart_of_the_server_is_survived_as_through_redis_py(
    redis_server_factory: Any, key_prefix: str
) -> None:
    server = redis_server_factory()
    c = redis.Redis.from_url(server.url)
    guard = _guard(c, key_prefix)
    assert guard.run("a", lambda: 1).value == 1
    server.stop()
    with pytest.raises(IdempotencyConnectionError):
        guard.run("down", lambda: 0)
    server.start()
    # A new server process: no script cached (NOSCRIPT), a new connection.
    assert guard.run("b", lambda: 2).value == 2
    assert guard.run("b", lambda: 3).value == 2
    c.close()


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_makes_its_own_connection(client: Any, key_prefix: str) -> None:
    """prefork: the child never writes to the parent's socket (both would read each other's
    replies); the parent's connection still works after the child has come and gone."""
    guard = _guard(client, key_prefix)
    assert guard.run("parent", lambda: "p").value == "p"
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe
        code = 1
        try:
            ok = guard.run("child", lambda: "c").value == "c"
            ok = ok and guard.run("parent", lambda: "x").value == "p"
            ok = ok and guard.store._lean._pid == os.getpid()  # type: ignore[attr-defined]
            code = 0 if ok else 2
        finally:
            os.write(write, bytes([code]))
            os._exit(0)
    os.close(write)
    status = os.read(read, 1)
    os.close(read)
    os.waitpid(pid, 0)
    assert status == b"\x00"
    assert guard.run("child", lambda: "y").value == "c"
    assert guard.run("parent2", lambda: "p2").value == "p2"


def test_an_instrumented_execute_command_sees_every_script(
    client: Any, key_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """APM tracers wrap ``Redis.execute_command``: while one does, the scripts go through it
    (checked at each call, so a tracer installed after the store was made still sees them)."""
    guard = _guard(client, key_prefix)
    guard.run("warm", lambda: 0)
    seen: list[str] = []
    original = redis.Redis.execute_command

    def traced(self: Any, *args: Any, **options: Any) -> Any:
        seen.append(str(args[0]).upper())
        return original(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", traced)
    guard.run("traced", lambda: 1)
    assert seen == ["EVALSHA", "EVALSHA"]
    monkeypatch.undo()
    seen.clear()
    guard.run("untraced", lambda: 1)
    assert seen == []


def _green_lean(lib: str, redis_url: str, key_prefix: str, *mutant: str) -> dict[str, Any]:
    pytest.importorskip(lib)
    script = Path(__file__).with_name("green_lean.py")
    done = subprocess.run(
        [sys.executable, str(script), lib, redis_url, key_prefix, *mutant],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


@pytest.mark.parametrize("lib", ["gevent", "eventlet"])
def test_greenlets_in_flight_share_connections_and_get_their_own_replies(
    redis_url: str, key_prefix: str, lib: str
) -> None:
    """Under gevent and eventlet (a process patched first, as a worker is): 40 greenlets at
    once, starting calls on timers and sleeping in their bodies as tasks do, each call's reply
    its own, no connection touched by one greenlet while another's reply is owed on it, and
    more than one connection but no more than there were greenlets in flight (one per
    greenlet would be one per task: Celery's green pools run each task in a new greenlet)."""
    out = _green_lean(lib, redis_url, key_prefix)
    assert out["lean"] is True
    assert out["errors"] == []
    assert out["wrong"] == []
    assert out["shared"] == []  # no connection was lent to two greenlets at once
    assert 1 < out["held"] <= 40


@pytest.mark.parametrize("lib", ["gevent", "eventlet"])
def test_the_green_check_catches_a_connection_lent_twice(
    redis_url: str, key_prefix: str, lib: str
) -> None:
    """The test above has teeth: with the lean path mutated so that a lent connection stays
    on the stack (lent again while in use), the same run sees it: a use by a second greenlet,
    a wrong reply or a call that fails."""
    out = _green_lean(lib, redis_url, key_prefix, "double-lend")
    assert out["lean"] is True
    assert out["errors"] or out["wrong"] or out["shared"], out
