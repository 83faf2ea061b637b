"""The publish-side check on the SQL backends (``ChecksPublishes`` on the backend): the
decisions and the queued marker's life of the Redis check, in one flight (one round trip),
never waiting for a running body. Run against PostgreSQL
(``tests/postgres/test_postgres_publish_side.py``) and MySQL / MariaDB
(``tests/mysql/test_mysql_publish_side.py``), whose modules import these tests and give them
a ``sqlpub`` fixture (:class:`SqlPublish`), with the tests where the dialects differ.

The marker is a row in state ``queued`` (the task id in ``result``), which a claim takes as a
free row and a commit overwrites with the record; a running delivery's row shows the marker to
other sessions until it commits.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any

import pytest

from celery_idempotent.core.protocols import ChecksPublishes, IdempotencyRecord

REC = "idempotency:{pub.charge:key:order-1}"
LOCK = "idempotency:lock:{pub.charge:key:order-1}"


@dataclass(frozen=True)
class SqlPublish:
    """One SQL backend under the publish-side tests."""

    backend: Any
    #: seconds a check may take while a running body holds the key's row (it never waits
    #: for that lock: one that did would answer "publish unchecked", which the test rules out)
    quick: float
    #: statements sent in the one flight of a check (the transaction's own included)
    flight: int
    #: whether a claim marks the key's marker "claimed" (PostgreSQL's): a check while the body
    #: runs then reads the key as running; else the marker still reads as queued
    claims_marker: bool


def check(backend: Any, task_id: str, fp: str | None = "fp-1", ttl: float = 60.0) -> Any:
    return backend.check_publish(REC, LOCK, task_id, fp, ttl)


def test_the_backend_has_the_capability(sqlpub: SqlPublish) -> None:
    assert isinstance(sqlpub.backend, ChecksPublishes)


def test_decisions_through_a_keys_life(sqlpub: SqlPublish) -> None:
    backend = sqlpub.backend
    first = check(backend, "t-1")
    assert (first.action, first.unchecked) == ("publish", False)
    assert check(backend, "t-1").action == "publish"  # its own marker: goes through
    again = check(backend, "t-2")
    assert (again.action, again.task_id, again.state) == ("queued", "t-1", "queued")
    assert again.ttl_left is not None
    assert 0 < again.ttl_left <= 60
    other = check(backend, "t-3", fp="fp-other")
    assert (other.action, other.task_id, other.stored_fingerprint) == ("mismatch", "t-1", "fp-1")
    assert check(backend, "t-4", fp=None).action == "queued"  # no fingerprint: no mismatch

    # The delivery claims the key: while its body runs, a publish still sees the marker, at
    # once (no wait for the running transaction's row lock).
    claim = backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    try:
        began = time.monotonic()
        running = check(backend, "t-5")
        assert time.monotonic() - began < sqlpub.quick
        shown = "running" if sqlpub.claims_marker else "queued"
        assert (running.action, running.task_id, running.state) == ("queued", "t-1", shown)
        record = IdempotencyRecord({"ok": 1}, "fp-1", time.time(), claim.lease.fencing_token)
        assert backend.commit(claim.lease, REC, record, 60)
    except BaseException:
        backend.release(claim.lease)
        raise
    done = check(backend, "t-6")
    assert (done.action, done.state) == ("completed", "completed")
    assert done.ttl_left is not None
    assert 50 < done.ttl_left <= 60
    assert done.record is not None
    assert done.record.result == {"ok": 1}
    mismatch_done = check(backend, "t-7", fp="fp-other")
    assert mismatch_done.action == "completed"
    assert mismatch_done.stored_fingerprint == "fp-1"  # the caller raises the mismatch
    assert backend.drop_queued(REC, "t-1") is False  # a record now: not a marker


def test_a_lost_message_blocks_the_key_for_publish_ttl_only(sqlpub: SqlPublish) -> None:
    backend = sqlpub.backend
    assert check(backend, "t-1", ttl=0.3).action == "publish"
    assert check(backend, "t-2").action == "queued"
    time.sleep(0.5)
    fresh = check(backend, "t-2")
    assert (fresh.action, fresh.unchecked) == ("publish", False)
    assert check(backend, "t-3").task_id == "t-2"


def test_a_running_body_published_unchecked_is_left_to_the_guard(sqlpub: SqlPublish) -> None:
    backend = sqlpub.backend
    claim = backend.claim(LOCK, REC, 30)  # its row inserted, not committed: invisible
    assert claim.lease is not None
    try:
        began = time.monotonic()
        found = check(backend, "t-1")
        assert time.monotonic() - began < backend.lock_timeout + 2.0
        assert (found.action, found.unchecked) == ("publish", True)
    finally:
        backend.release(claim.lease)


def test_the_check_is_one_flight(sqlpub: SqlPublish, monkeypatch: pytest.MonkeyPatch) -> None:
    backend = sqlpub.backend
    check(backend, "warm-up")  # the table exists, a connection is pooled
    backend.drop_queued(REC, "warm-up")
    flights: list[int] = []
    send = backend._send

    def counted(conn: Any, statements: Any) -> Any:
        flights.append(len(statements))
        return send(conn, statements)

    monkeypatch.setattr(backend, "_send", counted)
    assert check(backend, "t-1").action == "publish"
    assert check(backend, "t-2").action == "queued"
    assert flights == [sqlpub.flight, sqlpub.flight]  # one flight each


def test_threads_publishing_one_key_at_once_make_one_publish(sqlpub: SqlPublish) -> None:
    backend = sqlpub.backend
    check(backend, "warm-up")
    backend.drop_queued(REC, "warm-up")
    n = 8
    barrier = threading.Barrier(n)
    decisions: dict[str, Any] = {}

    def one(i: int) -> None:
        barrier.wait()
        decisions[f"t-{i}"] = check(backend, f"t-{i}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(30)
    published = [tid for tid, d in decisions.items() if d.action == "publish"]
    assert len(decisions) == n
    assert len(published) == 1, decisions
    assert all(d.unchecked is False for d in decisions.values())
    assert {d.task_id for tid, d in decisions.items() if tid not in published} == set(published)


def test_status_and_forget_see_the_marker(sqlpub: SqlPublish) -> None:
    from celery_idempotent import DistributedIdempotencyGuard, admin

    backend = sqlpub.backend
    guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)
    key = "pub.charge:key:order-9"
    record, lock = guard.record_key(key), guard.lock_resource(key)
    assert admin.status_from_guard(guard, key).state == "absent"
    assert backend.check_publish(record, lock, "t-9", "fp", 60).action == "publish"
    status = admin.status_from_guard(guard, key)
    assert (status.state, status.task_id) == ("queued", "t-9")
    assert status.ttl is not None
    assert 0 < status.ttl <= 60
    gone = admin.forget_from_guard(guard, key, force=False)
    assert (gone.state, gone.deleted) == ("queued", (record,))
    assert admin.status_from_guard(guard, key).state == "absent"
