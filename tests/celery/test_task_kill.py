"""A prefork child SIGKILLed mid-body (``task_acks_late`` + ``task_reject_on_worker_lost``).

The message is requeued (same task id) once the worker notices the loss, which can take a
few seconds; a duplicate published right after the kill finds the killed run's lease still
alive and re-queues itself (``on_locked="retry"``) until the lease expires
(``idempotency_lock_ttl=3``, no one renews it any more). Only then does the body run again,
once, for both deliveries. The runs never overlap, nothing was committed by the killed run,
and after the commit duplicates replay.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest

from celery_idempotent.backends.redis import keyspace
from tests.celery.cidem_helpers import count, key_of, signal_count
from tests.support.leases import lease_held
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]

TIMEOUT = 30
LOCK_TTL = 3.0


@pytest.fixture(scope="module")
def kill_workers(worker_factory: Callable[..., WorkerGroup]) -> Iterator[WorkerGroup]:
    group = worker_factory(1, pool="prefork", concurrency=2)
    yield group
    group.stop()


def _runs(cidem: ModuleType, tag: str) -> list[tuple[str, float, int, int]]:
    raw = cidem.client().lrange(cidem.ckey("fragile-runs", tag), 0, -1)
    runs = []
    for item in raw:
        what, at, pid, n = item.decode().split(":")
        runs.append((what, float(at), int(pid), int(n)))
    return runs


def test_killed_child_reruns_only_after_the_lease_expired_never_concurrently(
    cidem: ModuleType, kill_workers: WorkerGroup, tag: str, redis_client: object
) -> None:
    task = cidem.fragile
    assert task.acks_late
    assert task.reject_on_worker_lost
    assert task.idempotency_settings().idempotency_lock_ttl == LOCK_TTL
    (worker,) = kill_workers
    result = task.apply_async((tag, 30.0))

    pid = wait_for(
        lambda: cidem.client().get(cidem.ckey("fragile-pid", tag, 1)), TIMEOUT, what="first run"
    )
    victim = int(pid)
    lock = cidem.client().get(cidem.ckey("fragile-lock", tag)).decode()
    assert victim in worker.child_pids()
    time.sleep(1.2)  # let the keeper renew the lease at least once (every lock_ttl / 3)
    # Redis' clock and the lease's remaining time, read together: the lease cannot expire
    # before killed_at + remaining (a renewal between this read and the kill only delays it)
    pipe = cidem.client().pipeline(transaction=True)
    pipe.time()
    pipe.get(lock)
    (sec, usec), value = pipe.execute()
    killed_at = sec + usec / 1_000_000
    deadline_ms = keyspace.parse_lock(value.decode()).deadline_ms
    assert deadline_ms is not None
    remaining_ms = deadline_ms - (sec * 1_000_000 + usec) // 1000
    assert remaining_ms > LOCK_TTL * 1000 * 2 / 3 - 200  # renewed: more than the first ttl left
    worker.kill_child(victim)
    # a duplicate (another task id) published now finds the dead run's lease still alive
    duplicate = task.apply_async((tag, 30.0))

    # the killed run's lease lives on until lock_ttl after its last renewal, then expires
    wait_for(lambda: not lease_held(cidem.client(), lock), LOCK_TTL + 5, 0.01, "lease expiry")
    value = result.get(timeout=TIMEOUT)
    assert duplicate.get(timeout=TIMEOUT) == value

    assert value["run"] == 2
    assert count(cidem, "fragile", tag) == 2
    runs = _runs(cidem, tag)
    assert [(what, n) for what, _, _, n in runs] == [("start", 1), ("start", 2), ("end", 2)]
    first_start, second_start, second_end = (at for _, at, _, _ in runs)
    assert runs[1][2] != victim
    # never at the same time: the second run began only after the killed run's lease was gone
    assert second_start >= killed_at + remaining_ms / 1000 - 0.01
    assert first_start < killed_at < second_start < second_end
    key = key_of(task, tag, 30.0)
    assert signal_count(cidem, "contended", key) >= 1  # the duplicate waited for the lease
    assert signal_count(cidem, "committed", key) == 1

    # after the commit, duplicates replay: the body does not run a third time
    assert task.apply_async((tag, 30.0)).get(timeout=TIMEOUT) == value
    assert task.apply_async((tag, 30.0), task_id=result.id).get(timeout=TIMEOUT) == value
    assert count(cidem, "fragile", tag) == 2
    assert len(_runs(cidem, tag)) == 3
    kill_workers[0].child_pids(wait=True)  # the pool replaced its child
