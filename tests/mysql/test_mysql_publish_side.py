"""The publish-side check on MySQL / MariaDB (``ChecksPublishes`` on the backend): the decisions
and the queued marker's life of the Redis and PostgreSQL checks, in one flight (one round trip),
never waiting for a running body.

The marker is a row in state ``queued`` (the task id in ``result``), which a claim takes as a
free row and a commit overwrites with the record; a running delivery's row shows the marker to
other sessions until it commits.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from celery_idempotent.core.protocols import ChecksPublishes, IdempotencyRecord

REC = "idempotency:{pub.charge:key:order-1}"
LOCK = "idempotency:lock:{pub.charge:key:order-1}"


def check(backend: Any, task_id: str, fp: str | None = "fp-1", ttl: float = 60.0) -> Any:
    return backend.check_publish(REC, LOCK, task_id, fp, ttl)


def test_the_backend_has_the_capability(my_backend: Any) -> None:
    assert isinstance(my_backend, ChecksPublishes)


def test_decisions_through_a_keys_life(my_backend: Any) -> None:
    first = check(my_backend, "t-1")
    assert (first.action, first.unchecked) == ("publish", False)
    assert check(my_backend, "t-1").action == "publish"  # its own marker: goes through
    again = check(my_backend, "t-2")
    assert (again.action, again.task_id) == ("queued", "t-1")
    other = check(my_backend, "t-3", fp="fp-other")
    assert (other.action, other.task_id, other.stored_fingerprint) == ("mismatch", "t-1", "fp-1")
    assert check(my_backend, "t-4", fp=None).action == "queued"  # no fingerprint: no mismatch

    # The delivery claims the key: while its body runs, a publish still sees the marker, at
    # once (no wait for the running transaction's row lock).
    claim = my_backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    try:
        began = time.monotonic()
        running = check(my_backend, "t-5")
        assert time.monotonic() - began < 1.0  # no wait for the running body's row lock
        assert (running.action, running.task_id) == ("queued", "t-1")
        record = IdempotencyRecord({"ok": 1}, "fp-1", time.time(), claim.lease.fencing_token)
        assert my_backend.commit(claim.lease, REC, record, 60)
    except BaseException:
        my_backend.release(claim.lease)
        raise
    done = check(my_backend, "t-6")
    assert done.action == "completed"
    assert done.record is not None
    assert done.record.result == {"ok": 1}
    mismatch_done = check(my_backend, "t-7", fp="fp-other")
    assert mismatch_done.action == "completed"
    assert mismatch_done.stored_fingerprint == "fp-1"  # the caller raises the mismatch
    assert my_backend.drop_queued(REC, "t-1") is False  # a record now: not a marker


def test_a_failed_body_leaves_the_marker_until_the_worker_drops_it(my_backend: Any) -> None:
    assert check(my_backend, "t-1").action == "publish"
    claim = my_backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    my_backend.release(claim.lease)  # the body raised: rolled back, the marker is back
    assert check(my_backend, "t-2").action == "queued"
    assert my_backend.drop_queued(REC, "t-other") is False  # only its own marker
    assert my_backend.drop_queued(REC, "t-1") is True
    assert check(my_backend, "t-2").action == "publish"  # free at once


def test_a_lost_message_blocks_the_key_for_publish_ttl_only(my_backend: Any) -> None:
    assert check(my_backend, "t-1", ttl=0.3).action == "publish"
    assert check(my_backend, "t-2").action == "queued"
    time.sleep(0.5)
    fresh = check(my_backend, "t-2")
    assert (fresh.action, fresh.unchecked) == ("publish", False)
    assert check(my_backend, "t-3").task_id == "t-2"


def test_a_running_body_published_unchecked_is_left_to_the_guard(my_backend: Any) -> None:
    claim = my_backend.claim(LOCK, REC, 30)  # its row inserted, not committed: invisible
    assert claim.lease is not None
    try:
        began = time.monotonic()
        found = check(my_backend, "t-1")
        assert time.monotonic() - began < my_backend.lock_timeout + 2.0
        assert (found.action, found.unchecked) == ("publish", True)
    finally:
        my_backend.release(claim.lease)


def test_the_check_is_one_flight(my_backend: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    check(my_backend, "warm-up")  # the table exists, a connection is pooled
    my_backend.drop_queued(REC, "warm-up")
    flights: list[int] = []
    send = my_backend._send

    def counted(conn: Any, statements: Any) -> Any:
        flights.append(len(statements))
        return send(conn, statements)

    monkeypatch.setattr(my_backend, "_send", counted)
    assert check(my_backend, "t-1").action == "publish"
    assert check(my_backend, "t-2").action == "queued"
    assert flights == [11, 11]  # one multi-statement query each (the transaction's own too)


def test_threads_publishing_one_key_at_once_make_one_publish(my_backend: Any) -> None:
    check(my_backend, "warm-up")
    my_backend.drop_queued(REC, "warm-up")
    n = 8
    barrier = threading.Barrier(n)
    decisions: dict[str, Any] = {}

    def one(i: int) -> None:
        barrier.wait()
        decisions[f"t-{i}"] = check(my_backend, f"t-{i}")

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


def test_status_and_forget_see_the_marker(my_backend: Any) -> None:
    from celery_idempotent import DistributedIdempotencyGuard, admin

    guard = DistributedIdempotencyGuard(store=my_backend, lock_provider=my_backend)
    key = "pub.charge:key:order-9"
    record, lock = guard.record_key(key), guard.lock_resource(key)
    assert admin.status_from_guard(guard, key).state == "absent"
    assert my_backend.check_publish(record, lock, "t-9", "fp", 60).action == "publish"
    status = admin.status_from_guard(guard, key)
    assert (status.state, status.task_id) == ("queued", "t-9")
    assert status.ttl is not None
    assert 0 < status.ttl <= 60
    gone = admin.forget_from_guard(guard, key, force=False)
    assert (gone.state, gone.deleted) == ("queued", (record,))
    assert admin.status_from_guard(guard, key).state == "absent"
