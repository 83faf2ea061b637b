"""Every pool Celery ships, with a real ``celery worker -P <pool>``: one worker per pool.

On gevent and eventlet every body of a worker process shares one event loop: a body that
computes without yielding stops every other greenlet. Lease renewals run on an OS thread with a
Redis connection of their own, so that such a body costs neither its own lease nor those of
the worker's other bodies. Each pool's worker shows, with a 1 s lease:

- duplicates (same arguments; same task id) run the body once and all get its result;
- a cooperative body of 3 s (three leases) keeps its lease while duplicates arrive **and while
  a CPU-bound body of another key blocks the same worker for 3 s**, which keeps its own lease
  too: no ``LockLostError``, no second start of either key, no lost-lease line in the log;
- the start-up log: the pool warning on gevent/eventlet only, no eviction warning on a
  ``noeviction`` Redis.
"""

from __future__ import annotations

import signal
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from types import ModuleType
from typing import Any

import pytest

from tests.celery.cidem_helpers import count, key_of, signal_count
from tests.support.workers import WorkerGroup

pytestmark = [pytest.mark.worker, pytest.mark.redis]

TIMEOUT = 60
LEASE = 1.0  # the coop/spin tasks' idempotency_lock_ttl
BODY = 3 * LEASE

POOLS = {"prefork": 3, "threads": 4, "solo": 1, "gevent": 4, "eventlet": 4}


@pytest.fixture(scope="module")
def pool_workers(worker_factory: Callable[..., WorkerGroup]) -> Iterator[dict[str, Any]]:
    """One worker per pool, each on a queue of its own, all started at once."""

    def start(pool: str) -> Any:
        queue = f"pool-{pool}-{uuid.uuid4().hex[:6]}"
        group = worker_factory(1, pool=pool, concurrency=POOLS[pool], queues=[queue])
        group.queue = queue
        return group

    with ThreadPoolExecutor(max_workers=len(POOLS)) as executor:
        futures = {pool: executor.submit(start, pool) for pool in POOLS}
        groups = {pool: future.result() for pool, future in futures.items()}
    yield groups
    for group in groups.values():  # warm shutdowns at once: gevent/eventlet take seconds
        for worker in group:
            worker.signal(signal.SIGTERM)
    for group in groups.values():
        group.stop()


def runs(cidem: ModuleType, kind: str, tag: str) -> list[tuple[str, float, int, int]]:
    """(start|end, Redis time, pid, run number) marks of ``kind``'s bodies for ``tag``."""
    raw = cidem.client().lrange(cidem.ckey(f"{kind}-runs", tag), 0, -1)
    out = []
    for item in raw:
        what, at, pid, n = item.decode().split(":")
        out.append((what, float(at), int(pid), int(n)))
    return out


@pytest.mark.parametrize("pool", POOLS)
def test_duplicates_with_the_same_args_or_the_same_task_id_run_once(
    cidem: ModuleType, pool_workers: dict[str, Any], pool: str, tag: str
) -> None:
    queue = pool_workers[pool].queue
    by_args = [cidem.work.apply_async((tag, 1, 0.3), queue=queue) for _ in range(5)]
    task_id = f"same-{tag}"
    by_id = [
        cidem.work_by_id.apply_async((tag, 2, 0.3), task_id=task_id, queue=queue) for _ in range(3)
    ]

    values = [r.get(timeout=TIMEOUT) for r in by_args]
    assert values == [values[0]] * 5
    assert count(cidem, "work", tag) == 1
    key = key_of(cidem.work, tag, 1, 0.3)
    assert signal_count(cidem, "committed", key) == 1
    assert signal_count(cidem, "replayed", key) == 4
    for result in by_id:
        assert result.get(timeout=TIMEOUT)["x"] == 2
    assert count(cidem, "work_by_id", tag) == 1  # three deliveries of one task id


def blocking_scenario(cidem: ModuleType, group: Any, tag: str) -> None:
    """A cooperative body, then a CPU-bound body of another key, both 3 leases long, each
    followed by three duplicates, all on one worker."""
    queue = group.queue
    sent: dict[str, list[Any]] = {"coop": [], "spin": []}
    sent["coop"].append(cidem.coop.apply_async((tag, BODY), queue=queue))
    time.sleep(0.2)  # the cooperative body starts first: the blocking one then freezes it
    sent["spin"].append(cidem.spin.apply_async((tag, BODY), queue=queue))
    for gap in (0.15, 0.3, 0.2):
        time.sleep(gap)
        sent["coop"].append(cidem.coop.apply_async((tag, BODY), queue=queue))
        sent["spin"].append(cidem.spin.apply_async((tag, BODY), queue=queue))

    for kind, results in sent.items():
        values = [r.get(timeout=TIMEOUT) for r in results]  # a LockLostError would raise
        assert values == [values[0]] * len(values), kind
        assert values[0]["run"] == 1, kind
        assert count(cidem, kind, tag) == 1, f"{kind} started again"
        key = key_of(getattr(cidem, kind), tag, BODY)
        assert signal_count(cidem, "lease_lost", key) == 0, kind
        assert signal_count(cidem, "committed", key) == 1, kind
        marks = runs(cidem, kind, tag)
        assert [m[0] for m in marks] == ["start", "end"], marks
        assert marks[1][1] - marks[0][1] >= BODY - 0.05, marks  # it really outlived 3 leases

    worker = group[0]
    coop_marks, spin_marks = runs(cidem, "coop", tag), runs(cidem, "spin", tag)
    if worker.pool != "solo":
        # Both ran at once in one worker (for gevent/eventlet: in one process, one hub).
        assert spin_marks[0][1] < coop_marks[1][1], (coop_marks, spin_marks)
        if worker.pool != "prefork":
            assert spin_marks[0][2] == coop_marks[0][2] == worker.pid
    log = worker.log()
    assert " lost: " not in log, log
    assert "raised unexpected" not in log, log


def test_a_blocking_body_costs_no_lease_of_its_worker(
    cidem: ModuleType, pool_workers: dict[str, Any]
) -> None:
    """On every pool at once (each its own worker and keys)."""
    with ThreadPoolExecutor(max_workers=len(POOLS)) as executor:
        futures = {
            pool: executor.submit(blocking_scenario, cidem, group, f"{pool}-{uuid.uuid4().hex[:8]}")
            for pool, group in pool_workers.items()
        }
        failed = {}
        for pool, future in futures.items():
            try:
                future.result()
            except AssertionError as exc:
                failed[pool] = exc
    assert not failed, failed


@pytest.mark.parametrize("pool", POOLS)
def test_the_start_up_log_warns_about_green_pools_and_not_about_eviction(
    pool_workers: dict[str, Any], pool: str
) -> None:
    worker = pool_workers[pool][0]
    log = worker.log()
    pool_lines = [ln for ln in log.splitlines() if "celery-idempotent: pool " in ln]
    if worker.pool in ("gevent", "eventlet"):
        assert len(pool_lines) == 1, log
        line = pool_lines[0]
        assert "WARNING" in line
        assert f"pool {worker.pool}: lease renewals run on an OS thread" in line
        assert "C call that holds the GIL" in line
        assert "as short as 1s" in line  # the shortest idempotency_lock_ttl of the app
    else:
        assert pool_lines == [], log
    assert "maxmemory-policy" not in log, "the test Redis is noeviction: no warning"


# --------------------------------------------------------------------------- revoke, limits


@pytest.fixture
def prefork_worker(pool_workers: dict[str, Any]) -> Any:
    """Time limits and ``revoke(terminate=True)`` act on prefork children."""
    return pool_workers["prefork"]


def wait_started(cidem: ModuleType, kind: str, tag: str, n: int = 1) -> float:
    """Wait until run ``n`` of ``kind`` marked its start; its Redis time."""
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        for what, at, _, run in runs(cidem, kind, tag):
            if what == "start" and run == n:
                return at
        time.sleep(0.02)
    pytest.fail(f"run {n} of {kind} never started")


def fence_of(cidem: ModuleType, kind: str, tag: str, n: int) -> int:
    return int(cidem.client().get(cidem.ckey(f"{kind}-fence", tag, n)))


def check_cut_run_then_one_more(
    cidem: ModuleType, kind: str, tag: str, cut_at: float, duplicate: Any
) -> None:
    """The cut first run stored nothing (the duplicate ran the body itself, once), and the
    duplicate, sent while the first ran, started only after the first was cut."""
    value = duplicate.get(timeout=TIMEOUT)
    assert value["run"] == 2, "the duplicate got a stored result of the cut run"
    assert count(cidem, kind, tag) == 2
    marks = runs(cidem, kind, tag)
    assert [(m[0], m[3]) for m in marks] == [("start", 1), ("start", 2), ("end", 2)], marks
    second_start = marks[1][1]
    assert second_start >= cut_at, (
        f"run 2 started {cut_at - second_start:.3f}s before run 1 was cut"
    )
    assert fence_of(cidem, kind, tag, 2) > fence_of(cidem, kind, tag, 1)
    again = getattr(cidem, kind).apply_async((tag, 5.0), queue=duplicate.queue_name)
    assert again.get(timeout=TIMEOUT) == value  # run 2 is stored and replayed
    assert count(cidem, kind, tag) == 2


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGKILL"])
def test_revoke_terminate_mid_body_stores_nothing_and_the_duplicate_runs_after_it(
    cidem: ModuleType, prefork_worker: Any, tag: str, sig: str
) -> None:
    queue = prefork_worker.queue
    first = cidem.victim.apply_async((tag, 5.0), queue=queue)
    wait_started(cidem, "victim", tag)
    duplicate = cidem.victim.apply_async((tag, 5.0), queue=queue)
    duplicate.queue_name = queue
    time.sleep(0.5)  # the duplicate finds the key held and is re-queued
    cut_at = cidem.redis_now()
    first.revoke(terminate=True, signal=sig)

    check_cut_run_then_one_more(cidem, "victim", tag, cut_at, duplicate)
    assert first.state == "REVOKED"


def test_hard_time_limit_mid_body_stores_nothing_and_the_duplicate_runs_after_it(
    cidem: ModuleType, prefork_worker: Any, tag: str
) -> None:
    from celery.exceptions import TimeLimitExceeded

    queue = prefork_worker.queue
    first = cidem.hard_limited.apply_async((tag, 5.0), queue=queue)
    started = wait_started(cidem, "hard_limited", tag)
    duplicate = cidem.hard_limited.apply_async((tag, 5.0), queue=queue)
    duplicate.queue_name = queue

    with pytest.raises(TimeLimitExceeded):
        first.get(timeout=TIMEOUT)
    # the child was killed 1.5 s (time_limit) after the task began, so not before its start
    check_cut_run_then_one_more(cidem, "hard_limited", tag, started + 1.4, duplicate)


def test_soft_time_limit_inside_the_body_stores_nothing(
    cidem: ModuleType, prefork_worker: Any, tag: str
) -> None:
    from celery.exceptions import SoftTimeLimitExceeded

    queue = prefork_worker.queue
    first = cidem.soft_limited.apply_async((tag, 5.0), queue=queue)
    started = wait_started(cidem, "soft_limited", tag)
    duplicate = cidem.soft_limited.apply_async((tag, 5.0), queue=queue)
    duplicate.queue_name = queue

    with pytest.raises(SoftTimeLimitExceeded):
        first.get(timeout=TIMEOUT)
    check_cut_run_then_one_more(cidem, "soft_limited", tag, started + 0.9, duplicate)
