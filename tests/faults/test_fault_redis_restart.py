"""The idempotency Redis crashes and comes back on the same port, with AOF, mid-run.

The broker and the result backend live on another server, so only the locks and records go
away. A delivery caught by the outage before its body ran gets ``IdempotencyConnectionError``
(the library's error, chaining redis-py's) and re-queues itself; one caught after its body ran
fails with ``LockLostError`` carrying the body's result (the commit could not be confirmed),
and the caller may send it again. Keys committed before the crash are on disk
(``appendfsync always``) and are never run again.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import redis

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyConnectionError,
    LockAcquisitionError,
    LockLostError,
    RedisIdempotencyStore,
    RedisLockProvider,
)
from tests.faults.faultlib import (
    commits_by_key,
    counter,
    fault_env,
    load_runs,
    overlaps,
    record_figures,
    text,
    wait_ready,
)
from tests.support.redis_server import RedisServer

ServerFactory = Callable[..., RedisServer]
LOCK_TTL = 2.0


def crash_and_restart(server: RedisServer, downtime: float) -> float:
    """SIGKILL ``server`` (no shutdown, no final save), wait, start it on the same port and
    dir; returns how long it was unreachable."""
    assert server.pid is not None
    down_at = time.monotonic()
    os.kill(server.pid, signal.SIGKILL)
    server.stop()  # reaps the process, keeps the dir (and the AOF) for start()
    time.sleep(downtime)
    server.start()
    return time.monotonic() - down_at


def guard_for(client: redis.Redis, prefix: str, **options: Any) -> DistributedIdempotencyGuard:
    return DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(client),
        lock_provider=RedisLockProvider(client),
        key_prefix=prefix,
        **options,
    )


def recorder(calls: list[str], name: str, value: str | None) -> Callable[[], str | None]:
    """A body that notes ``name`` in ``calls`` when it runs and returns ``value``."""

    def body() -> str | None:
        calls.append(name)
        return value

    return body


@pytest.mark.slow
def test_guard_fails_fast_while_redis_is_down_and_finds_its_records_and_leases_after_restart(
    redis_server_factory: ServerFactory,
) -> None:
    server = redis_server_factory(appendonly=True)
    client = redis.Redis.from_url(server.url, socket_timeout=0.5, socket_connect_timeout=0.5)
    guard = guard_for(client, "restart:", lock_ttl=3, retry_count=0)
    calls: list[str] = []
    assert guard.execute("committed", recorder(calls, "committed", "v1")) == "v1"
    # a lease held across the crash: taken, never released (its holder "died")
    held = guard.lock_provider.acquire(guard.lock_resource("held"), 3.0)
    assert held is not None

    os.kill(server.pid or 0, signal.SIGKILL)
    server.stop()
    started = time.monotonic()
    with pytest.raises(IdempotencyConnectionError) as info:
        guard.execute("during", recorder(calls, "during", None))
    assert time.monotonic() - started < 3.0, "a refused connection must not hang"
    assert info.value.key == "during"
    assert "claim failed" in str(info.value)
    assert isinstance(info.value.__cause__, redis.ConnectionError)
    assert "during" not in calls

    server.start()
    # the record survived (AOF): replayed, the body does not run again
    assert guard.execute("committed", recorder(calls, "again", "v2")) == "v1"
    # the lease survived too, with its server-side expiry: still held, then free
    with pytest.raises(LockAcquisitionError):
        guard.execute("held", recorder(calls, "held", None))
    deadline = time.monotonic() + 5
    while guard.lock_provider.is_locked(guard.lock_resource("held")):
        assert time.monotonic() < deadline, "a lease restored from the AOF never expired"
        time.sleep(0.05)
    assert guard.execute("held", recorder(calls, "held", "h")) == "h"
    assert guard.execute("during", recorder(calls, "during", "d")) == "d"
    assert calls == ["committed", "held", "during"]
    client.close()


@pytest.mark.worker
@pytest.mark.slow
@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    "outage",
    [
        # a blip: redis-py's own retries (10, backing off to 1 s) and the guard's resent
        # commits ride it out; nothing may fail, run twice or be lost
        pytest.param(1.5, id="blip"),
        # longer than both: claims fail and are re-queued, commits end unconfirmed
        pytest.param(7.0, id="outage"),
    ],
)
def test_worker_rides_out_an_idempotency_redis_crash_and_committed_keys_never_rerun(
    redis_server_factory: ServerFactory, outage: float
) -> None:
    broker = redis_server_factory()
    idem = redis_server_factory(appendonly=True)
    with fault_env(broker=broker, idem_url=idem.url, lock_ttl=LOCK_TTL) as env:
        queue = f"restart-{env.prefix.split(':')[1]}"
        env.start_worker(concurrency=3, queue=queue)
        work = env.app.tasks["faults.work"]

        # --- phase 1: committed before the crash
        before = {n: work.apply_async((n, 0.02), queue=queue) for n in range(30)}
        assert not wait_ready(before.values(), timeout=30), env.logs()
        committed = {n: r.get(timeout=5)["exec"] for n, r in before.items()}

        # --- phase 2: a crash while 60 slower tasks are in flight
        inflight = {n: work.apply_async((n, 0.25), queue=queue) for n in range(100, 160)}
        deadline = time.monotonic() + 20
        while len(load_runs(env.marks, env.ns)) < 30 + 6:
            assert time.monotonic() < deadline, f"phase 2 did not start\n{env.logs()}"
            time.sleep(0.05)
        downtime = crash_and_restart(idem, downtime=outage)
        assert not wait_ready(inflight.values(), timeout=60), env.logs()

        # Caught after the body ran: the commit could not be confirmed, so the delivery fails
        # with LockLostError carrying the body's result (nothing to re-queue: the body ran).
        failed: dict[int, Any] = {}
        for n, result in inflight.items():
            if result.successful():
                continue
            with pytest.raises(LockLostError) as info:
                result.get(timeout=5, propagate=True)
            assert "Redis" in str(info.value), str(info.value)
            assert info.value.result["n"] == n, "LockLostError carries the body's result"
            failed[n] = info.value.result
        requeued = [text(r) for r in env.marks.lrange(f"{env.ns}retries", 0, -1)]
        assert set(requeued) <= {"IdempotencyConnectionError", "LockAcquisitionError"}, requeued
        hit = len(failed) + requeued.count("IdempotencyConnectionError")
        if outage > 5:
            assert hit >= 1, "the crash caught no task: the test did not test the outage"

        # --- the caller sends the failed ones again: they complete
        resent = {n: work.apply_async((n, 0.25), queue=queue) for n in failed}
        assert not wait_ready(resent.values(), timeout=30), env.logs()
        assert all(r.successful() for r in resent.values())
        # a commit that reached Redis just before the crash, its reply lost, replays here
        stored_anyway = sum(
            1 for n, r in resent.items() if r.get(timeout=5)["exec"] == failed[n]["exec"]
        )

        # --- phase 3: every key committed before the crash replays, never runs again
        runs_before = load_runs(env.marks, env.ns)
        again = {n: work.apply_async((n, 0.02), queue=queue) for n in range(30)}
        assert not wait_ready(again.values(), timeout=30), env.logs()
        assert {n: r.get(timeout=5)["exec"] for n, r in again.items()} == committed
        runs = load_runs(env.marks, env.ns)
        for n in range(30):
            assert len(runs[n]) == len(runs_before[n]) == 1, f"key {n} ran again: {runs[n]}"

        double = overlaps(runs, LOCK_TTL)
        assert not double, double[:3]
        commits = commits_by_key(env.marks, env.ns)
        twice = {key: fences for key, fences in commits.items() if len(fences) > 1}
        assert not twice, twice
        record_figures(
            f"idempotency Redis crash (SIGKILL, AOF always, restart on the same port, "
            f"{outage:g} s down)",
            restarts=1,
            downtime_seconds=round(downtime, 1),
            deliveries=counter(env.marks, env.ns, "deliveries"),
            executions=sum(len(r) for r in runs.values()),
            requeued_on_connection_error=requeued.count("IdempotencyConnectionError"),
            failed_after_body_lock_lost=len(failed),
            failed_but_stored_anyway=stored_anyway,
            committed_before_crash_rerun=0,
            double_executions=len(double),
            double_commits=len(twice),
        )
