"""``idempotency_publish_until="started"`` on the SQL backends (issue 24): the marker table's
contract, run against PostgreSQL (``tests/postgres/test_postgres_started.py``) and MySQL /
MariaDB (``tests/mysql/test_mysql_started.py``).

Each of those modules imports the tests below and gives them a ``started_db`` fixture: a
:class:`StartedDb`, the backend under test and a way to make another backend on the same
table. The key's row is held by a real claim on another thread's transaction (the running
body); every publish check is shown not to wait for it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import pytest

from celery_idempotent import DistributedIdempotencyGuard, IdempotencyConnectionError
from celery_idempotent.admin import status_from_guard
from celery_idempotent.core.protocols import IdempotencyRecord

KEY = "st.job:key:j-1"
REC = "idempotency:{st.job:key:j-1}"
LOCK = "idempotency:lock:{st.job:key:j-1}"


@dataclass
class StartedDb:
    """One SQL backend under the marker table's contract."""

    name: str
    backend: Any
    #: a new backend on the same table (keywords: the backend's)
    make: Callable[..., Any]
    #: ``count(sql)``: the first column of the first row of ``sql``, from another connection
    count: Callable[[str], int]
    #: the marker table, as SQL (quoted)
    markers: str
    #: ``run(sql)``: run a statement from another connection
    run: Callable[[str], None]


def make_guard(backend: Any, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("retry_base_delay", 0.01)
    return DistributedIdempotencyGuard(store=backend, lock_provider=backend, **options)


def publish(backend: Any, task_id: str, fp: str | None = "fp", ttl: float = 60) -> Any:
    return backend.check_publish(REC, LOCK, task_id, fp, ttl, until="started")


@pytest.fixture
def held(started_db: StartedDb) -> Iterator[Callable[[str], None]]:
    """``hold(task_id)``: a delivery of ``task_id`` claims the key on another thread and its
    body starts (its queued marker ended, as the worker's delivery does) and runs until the
    test ends; the claim's transaction holds the key's row all along."""
    release = threading.Event()
    threads: list[threading.Thread] = []

    def hold(task_id: str) -> None:
        running = threading.Event()
        guard = make_guard(started_db.backend)

        def body() -> str:
            started_db.backend.start_marker(REC, task_id, 60)
            running.set()
            release.wait(30)
            return "first"

        thread = threading.Thread(target=lambda: guard.run(KEY, body, task_id=task_id))
        thread.start()
        threads.append(thread)
        assert running.wait(10)

    yield hold
    release.set()
    for thread in threads:
        thread.join(30)


def test_one_running_one_queued_a_third_stopped(
    started_db: StartedDb, held: Callable[[str], None]
) -> None:
    backend = started_db.backend
    assert publish(backend, "t-1").action == "publish"
    assert publish(backend, "t-2").action == "queued"  # t-1 has not started
    held("t-1")
    # t-1 runs (its row locked): its marker ended as it started, so one more may queue.
    start = time.monotonic()
    second = publish(backend, "t-2")
    assert (second.action, second.unchecked) == ("publish", False)
    third = publish(backend, "t-3")
    assert time.monotonic() - start < 1.0  # neither waited for the running body's row
    assert (third.action, third.task_id, third.state) == ("queued", "t-2", "queued")
    assert third.ttl_left is not None
    assert 50 < third.ttl_left <= 60
    assert publish(backend, "t-2").action == "publish"  # its own marker: published again


def test_status_reports_the_running_call_and_the_queued_one(
    started_db: StartedDb, held: Callable[[str], None]
) -> None:
    backend = started_db.backend
    guard = make_guard(backend)
    assert publish(backend, "t-1").action == "publish"
    queued = status_from_guard(guard, KEY)
    assert (queued.state, queued.task_id, queued.queued_task_id) == ("queued", "t-1", None)
    held("t-1")
    running = status_from_guard(guard, KEY)
    assert (running.state, running.task_id, running.queued_task_id) == ("running", "t-1", None)
    assert publish(backend, "t-2").action == "publish"
    both = status_from_guard(guard, KEY)
    assert (both.state, both.task_id, both.queued_task_id) == ("running", "t-1", "t-2")


def test_a_record_is_published_past_and_the_queued_call_replays_it(
    started_db: StartedDb,
) -> None:
    backend = started_db.backend
    guard = make_guard(backend)
    assert publish(backend, "t-1").action == "publish"
    claim = backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    backend.start_marker(REC, "t-1", 60)
    assert publish(backend, "t-2").action == "publish"
    record = IdempotencyRecord("v", "fp", time.time(), claim.lease.fencing_token, "t-1")
    assert backend.commit(claim.lease, REC, record, 60)
    backend.end_marker(REC, "t-1")
    # t-2 is still queued (its message not delivered yet): a publish is stopped by it.
    assert publish(backend, "t-3").task_id == "t-2"
    # t-2's delivery replays the record and ends its marker; then a record is published past.
    assert guard.run(KEY, lambda: "again", task_id="t-2").replayed
    backend.end_marker(REC, "t-2")
    past = publish(backend, "t-4")
    assert (past.action, past.unchecked) == ("publish", True)
    assert started_db.count(f"SELECT count(*) FROM {started_db.markers}") == 0


def test_ttl_zero_lets_the_queued_call_run_after_the_first(started_db: StartedDb) -> None:
    backend = started_db.backend
    assert publish(backend, "t-1").action == "publish"
    claim = backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    backend.start_marker(REC, "t-1", 60)
    assert publish(backend, "t-2").action == "publish"
    record = IdempotencyRecord("v", "fp", time.time(), claim.lease.fencing_token, "t-1")
    assert backend.commit(claim.lease, REC, record, 0)  # ttl=0: nothing kept
    backend.end_marker(REC, "t-1")
    assert publish(backend, "t-3").task_id == "t-2"  # t-2 still queued
    again = backend.claim(LOCK, REC, 30)
    assert again.lease is not None  # t-2 runs: nothing was kept
    backend.start_marker(REC, "t-2", 60)
    assert publish(backend, "t-3").action == "publish"
    backend.release(again.lease)


def test_a_mismatch_and_an_expired_marker(started_db: StartedDb) -> None:
    backend = started_db.backend
    assert publish(backend, "t-1", fp="a", ttl=0.3).action == "publish"
    other = publish(backend, "t-2", fp="b")
    assert (other.action, other.task_id, other.stored_fingerprint) == ("mismatch", "t-1", "a")
    time.sleep(0.5)
    assert publish(backend, "t-2", fp="b").action == "publish"  # t-1's marker expired


def test_concurrent_publishes_queue_exactly_one(started_db: StartedDb) -> None:
    backends = [started_db.make() for _ in range(6)]
    try:
        barrier = threading.Barrier(len(backends))
        answers: list[Any] = [None] * len(backends)

        def go(i: int) -> None:
            barrier.wait()
            answers[i] = publish(backends[i], f"t-{i}")

        threads = [threading.Thread(target=go, args=(i,)) for i in range(len(backends))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        published = [a for a in answers if a.action == "publish"]
        assert len(published) == 1
        assert not published[0].unchecked
        winner = next(f"t-{i}" for i, a in enumerate(answers) if a.action == "publish")
        assert {a.task_id for a in answers if a.action == "queued"} == {winner}
    finally:
        for each in backends:
            each.close()


def test_drop_queued_and_forget_end_the_markers(started_db: StartedDb) -> None:
    backend = started_db.backend
    assert publish(backend, "t-1").action == "publish"
    assert backend.drop_queued(REC, "t-1")  # a revoked call's marker
    assert publish(backend, "t-2").action == "publish"
    assert backend.forget_markers(REC) == 1
    assert publish(backend, "t-3").action == "publish"


def test_an_install_from_before_gets_the_marker_table_at_first_use(
    started_db: StartedDb,
) -> None:
    backend = started_db.backend
    backend.cleanup()  # the key table exists, as an install from before the mode has it
    started_db.run(f"DROP TABLE {started_db.markers}")
    plain = started_db.make()
    fixed = started_db.make(create_table=False)
    try:
        assert plain.check_publish(REC, LOCK, "t-0", None, 60).action == "publish"  # other mode
        with pytest.raises(IdempotencyConnectionError, match=r"_markers.*create_table=False"):
            publish(fixed, "t-1")
        assert publish(plain, "t-1").action == "publish"  # created now
        assert started_db.count(f"SELECT count(*) FROM {started_db.markers}") == 1
    finally:
        plain.close()
        fixed.close()


def test_inspect_and_forget_of_the_cli_read_the_marker_table(
    started_db: StartedDb, held: Callable[[str], None]
) -> None:
    """``celery idempotency inspect`` (the dialect's admin ``describe``) names the running call
    and the queued one; ``forget`` of a key a body holds keeps it, of a queued key ends it."""
    from celery_idempotent.backends.sql import admin as sql_admin

    backend = started_db.backend
    nkey = KEY
    assert publish(backend, "t-1").action == "publish"
    doc = sql_admin.describe(backend, "idempotency:", nkey, show_result=False, shown_url="-")
    assert (doc["state"], doc["queued"]["task_id"]) == ("queued", "t-1")
    held("t-1")
    assert publish(backend, "t-2").action == "publish"
    doc = sql_admin.describe(backend, "idempotency:", nkey, show_result=False, shown_url="-")
    assert doc["held"]
    assert (doc["running"]["task_id"], doc["queued"]["task_id"]) == ("t-1", "t-2")
    kept = sql_admin.forget_one(backend, "idempotency:", nkey, dry_run=False)
    assert kept["deleted"] == 0  # held: nothing deleted, the queued call stays
    assert publish(backend, "t-3").task_id == "t-2"
    gone = sql_admin.forget_task(backend, "idempotency:", "st.job", dry_run=False)
    assert gone["records"] == 1  # the queued marker (the held row is kept)
    assert publish(backend, "t-3").action == "publish"
