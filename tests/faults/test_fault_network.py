"""Network trouble between a guard and Redis, injected with a TCP proxy.

Holder A reaches Redis through the proxy; holder B directly. While A's body runs, the proxy
stalls (packets stop, sockets stay open) or cuts (connections reset, new ones refused) for
longer than the lease. A's renewals fail, its lease runs out on the server, B takes the key
and commits. A must then raise ``LockLostError`` carrying its result, commit nothing and never
overwrite B's record or release B's lease; once the network is back, A works again and replays
B's result.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import redis

from celery_idempotent import (
    CommitUnknownError,
    DistributedIdempotencyGuard,
    IdempotencyConnectionError,
    LockLostError,
    RedisIdempotencyStore,
    RedisLockProvider,
    current_lease,
)
from tests.faults.faultlib import record_figures
from tests.support.leases import lease_held, lease_left_ms
from tests.support.proxy import TcpProxy

ProxyFactory = Callable[..., TcpProxy]
LOCK_TTL = 1.0
FIGURES: dict[str, int] = {"stalls": 0, "cuts": 0, "lost_leases": 0, "overwrites": 0}


@pytest.fixture
def clients(
    redis_url: str, tcp_proxy: ProxyFactory, short_client_options: dict[str, Any]
) -> Iterator[tuple[TcpProxy, redis.Redis, redis.Redis]]:
    """(proxy, a client through the proxy with short timeouts, a direct client)."""
    proxy = tcp_proxy(redis_url)
    through = redis.Redis.from_url(proxy.url, **short_client_options)
    direct = redis.Redis.from_url(redis_url)
    try:
        yield proxy, through, direct
    finally:
        through.close()
        direct.close()


def make_guard(
    client: redis.Redis, prefix: str, *, atomic: bool = True, **options: Any
) -> DistributedIdempotencyGuard:
    """A guard on ``client``; ``atomic=False`` makes it call the lock and the store apart."""
    store = RedisIdempotencyStore(client)
    if not atomic:
        store.atomic_with = lambda lock_provider: None  # type: ignore[method-assign]
    options.setdefault("lock_ttl", LOCK_TTL)
    options.setdefault("retry_count", 0)
    return DistributedIdempotencyGuard(
        store=store, lock_provider=RedisLockProvider(client), key_prefix=prefix, **options
    )


@pytest.mark.slow
@pytest.mark.parametrize("fault", ["stall", "cut"])
@pytest.mark.parametrize("atomic", [True, False], ids=["atomic", "split"])
def test_lease_lost_to_a_network_fault_gives_lock_lost_and_never_overwrites_the_next_holder(
    clients: tuple[TcpProxy, redis.Redis, redis.Redis],
    key_prefix: str,
    fault: str,
    atomic: bool,
) -> None:
    proxy, through, direct = clients
    a = make_guard(through, key_prefix, atomic=atomic)
    b = make_guard(direct, key_prefix, atomic=atomic)
    key = f"net-{fault}"
    resource = a.lock_resource(key)
    started, b_done = threading.Event(), threading.Event()
    outcome: dict[str, Any] = {}

    def body_a() -> str:
        lease = current_lease()
        assert lease is not None
        outcome["fence_a"] = lease.fencing_token
        started.set()
        assert b_done.wait(15), "B never committed"
        return "A"

    def run_a() -> None:
        try:
            outcome["value"] = a.execute(key, body_a)
        except BaseException as exc:
            outcome["error"] = exc

    thread = threading.Thread(target=run_a)
    thread.start()
    assert started.wait(5)
    if fault == "stall":
        proxy.stall()
    else:
        proxy.cut()
    faulted_at = time.monotonic()
    # The lease runs out on the server's clock, renewals or not.
    while lease_held(direct, resource):
        assert time.monotonic() - faulted_at < LOCK_TTL + 2, "A's lease outlived the fault"
        time.sleep(0.02)
    expired_after = time.monotonic() - faulted_at

    def body_b() -> dict[str, Any]:
        lease = current_lease()
        assert lease is not None
        return {"by": "B", "fence": lease.fencing_token}

    value_b = b.execute(key, body_b)
    assert value_b["by"] == "B"
    assert value_b["fence"] > outcome["fence_a"]
    record_b = b.store.get(b.record_key(key))
    assert record_b is not None
    assert record_b.result["by"] == "B"
    assert record_b.fencing_token is not None
    assert record_b.fencing_token > outcome["fence_a"]
    # A's body returns while the network is still down, then the network comes back.
    b_done.set()
    thread.join(15)
    assert not thread.is_alive()
    proxy.resume()
    time.sleep(0.3)  # whatever A sent during the fault reaches Redis now

    error = outcome.get("error")
    assert isinstance(error, LockLostError), f"expected LockLostError, got {error!r}"
    assert error.key == key
    assert error.result == "A", "LockLostError must carry what the body returned"
    # B's record stands, and nothing holds the key (A did not release or renew B's lease)
    after = b.store.get(b.record_key(key))
    assert after is not None
    assert after.result["by"] == "B"
    assert after.fencing_token == record_b.fencing_token
    # Work resumes through the proxy: A replays B's result and runs new keys.
    assert a.execute(key, lambda: {"by": "A again"})["by"] == "B"
    assert a.execute(f"{key}-after", lambda: "fresh") == "fresh"
    FIGURES["stalls" if fault == "stall" else "cuts"] += 1
    FIGURES["lost_leases"] += 1
    record_figures(
        "network faults via TCP proxy (lock_ttl 1s)",
        **FIGURES,
        last_lease_expired_after_s=round(expired_after, 2),
    )


@pytest.mark.slow
def test_a_short_stall_is_ridden_out_by_renewals(
    clients: tuple[TcpProxy, redis.Redis, redis.Redis], key_prefix: str
) -> None:
    """A stall shorter than the lease: renewals catch up, the body commits normally."""
    proxy, through, direct = clients
    a = make_guard(through, key_prefix)

    def body() -> str:
        proxy.stall()
        time.sleep(LOCK_TTL * 0.4)
        proxy.resume()
        time.sleep(LOCK_TTL * 1.5)  # outlives the lease: renewals must have worked
        return "done"

    assert a.execute("short-stall", body) == "done"
    assert a.store.get(a.record_key("short-stall")) is not None
    assert not lease_held(direct, a.lock_resource("short-stall"))


def test_commands_through_a_stalled_proxy_fail_with_the_library_error_not_a_hang(
    clients: tuple[TcpProxy, redis.Redis, redis.Redis], key_prefix: str
) -> None:
    proxy, through, direct = clients
    a = make_guard(through, key_prefix)
    assert a.execute("warm", lambda: 1) == 1  # connection and scripts ready before the stall
    proxy.stall()
    started = time.monotonic()
    with pytest.raises(IdempotencyConnectionError) as info:
        a.execute("stalled", lambda: 2)
    assert time.monotonic() - started < 5, "a stalled Redis must fail, not hang"
    assert info.value.key == "stalled"
    assert "claim failed" in str(info.value)
    assert isinstance(info.value.__cause__, redis.TimeoutError)
    proxy.resume()
    # The claim that timed out was queued, not lost: it may take the lock when the network
    # returns. Its lease is an ordinary one and runs out within lock_ttl.
    time.sleep(0.2)
    pttl = lease_left_ms(direct, a.lock_resource("stalled"))
    assert pttl == -2 or 0 < pttl <= LOCK_TTL * 1000
    time.sleep(max(pttl, 0) / 1000 + 0.05)
    assert a.execute("stalled", lambda: 3) == 3


def report(
    guard: DistributedIdempotencyGuard, key: str, body: Callable[[], Any]
) -> tuple[bool, Any]:
    """(whether the guard reported the result as stored, the body's result).

    A CommitUnknownError is not an answer either way, so it fails the test: these faults are
    shorter than the lease, and the guard must resolve them."""
    try:
        return True, guard.execute(key, body)
    except CommitUnknownError as exc:
        raise AssertionError(f"the commit outcome was left unknown: {exc}") from exc
    except LockLostError as exc:
        return False, exc.result


@pytest.mark.slow
@pytest.mark.parametrize(
    "atomic",
    [
        # atomic: the reply of the commit is lost; the guard sends the commit again until
        # Redis answers, and the answer ("already stored by this lease") is the truth
        pytest.param(True, id="atomic"),
        # split: the stall catches the lease check (extend) before the write is sent
        pytest.param(False, id="split"),
    ],
)
def test_a_commit_reported_as_not_stored_is_never_stored_later(
    clients: tuple[TcpProxy, redis.Redis, redis.Redis], key_prefix: str, atomic: bool
) -> None:
    """The network stalls between the body and its commit, for less than the lease: the
    guard's timeout fires while the commit request is queued. Whatever the guard reports must
    still be true once the queued bytes arrive."""
    proxy, through, _ = clients
    # the stall (1.5 s) is well inside the lease, and no renewal falls into it
    a = make_guard(through, key_prefix, atomic=atomic, lock_ttl=5.0, renew_interval=4.0)
    assert a.execute("warm", lambda: 0) == 0  # scripts loaded: a late EVALSHA runs

    def body() -> str:
        proxy.stall()
        threading.Timer(1.5, proxy.resume).start()
        return "A"

    reported_stored, result = report(a, "blip", body)
    assert result == "A", "either way the caller gets what the body returned"
    time.sleep(2.0)  # the network is back and whatever was queued has arrived
    stored = a.store.get(a.record_key("blip")) is not None
    assert stored == reported_stored, (
        f"the guard reported the result as {'stored' if reported_stored else 'not stored'}, "
        f"but after the network returned it is {'stored' if stored else 'not stored'}"
    )
