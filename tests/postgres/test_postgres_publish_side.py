"""The publish-side check on PostgreSQL: the tests shared with MySQL
(``tests/support/sql_publish_side.py``), in one statement (one round trip: BEGIN, the
statement, COMMIT in one pipeline flight), and what is PostgreSQL's own: a claim marks the
marker "claimed", committed at once, so a body that ends without committing frees its key; a
re-queued delivery queues its marker again; the marker's age.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from tests.support.sql_publish_side import (  # noqa: F401 - collected here against PostgreSQL
    LOCK,
    REC,
    SqlPublish,
    check,
    test_a_lost_message_blocks_the_key_for_publish_ttl_only,
    test_a_running_body_published_unchecked_is_left_to_the_guard,
    test_decisions_through_a_keys_life,
    test_status_and_forget_see_the_marker,
    test_the_backend_has_the_capability,
    test_the_check_is_one_flight,
    test_threads_publishing_one_key_at_once_make_one_publish,
)


@pytest.fixture
def sqlpub(pg_backend: Any) -> SqlPublish:
    # BEGIN, the statement, COMMIT: one pipeline flight. A check never waits for the running
    # body's row lock: one that did would answer "publish unchecked" after lock_timeout (0.1 s),
    # which the decision asserted rules out; the time bound only says it did not hang (0.1 s
    # was missed by 0.05 s on a loaded host).
    return SqlPublish(pg_backend, quick=1.0, flight=3, claims_marker=True)


def test_a_body_that_ends_without_committing_frees_its_key(pg_backend: Any) -> None:
    # SPEC §8: a body that raises, Ignore: the claim marked the marker "claimed" (committed
    # at once), the transaction is gone, the delivery drops the marker: the key is free.
    assert check(pg_backend, "t-1").action == "publish"
    claim = pg_backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    assert pg_backend.drop_queued(REC, "t-1") is False  # held now: left to the body's end
    pg_backend.release(claim.lease)  # rolled back
    assert pg_backend.drop_queued(REC, "t-1") is True  # the worker knows it ended
    after = check(pg_backend, "t-2")
    assert (after.action, after.unchecked) == ("publish", False)
    assert check(pg_backend, "t-3").task_id == "t-2"
    assert pg_backend.drop_queued(REC, "t-other") is False  # only its own marker
    assert pg_backend.drop_queued(REC, "t-2") is True
    assert check(pg_backend, "t-4").action == "publish"


def _hold_row_for(pg_backend: Any, row: str, seconds: float) -> threading.Thread:
    """Lock ``row`` from a connection of its own for ``seconds`` (as a status probe does for
    a moment, ``is_locked``: FOR UPDATE NOWAIT, then ROLLBACK), in a thread; returns once
    the lock is held."""
    import psycopg

    held = threading.Event()

    def hold() -> None:
        with psycopg.connect(pg_backend.url) as conn:
            conn.execute(
                f"SELECT 1 FROM {pg_backend._quoted_table()} WHERE key = %s FOR UPDATE", (row,)
            )
            held.set()
            time.sleep(seconds)
            conn.rollback()

    thread = threading.Thread(target=hold)
    thread.start()
    assert held.wait(10)
    return thread


@pytest.mark.parametrize("change", ["drop", "requeue"])
def test_a_marker_change_outlasts_a_probe_holding_its_row_for_a_moment(
    pg_backend: Any, change: str
) -> None:
    # The changes never wait for a row lock (SKIP LOCKED: a running body holds its row), so
    # a status probe holding the row for a moment made them skip it, and a dead call's marker
    # then blocked its key for publish_ttl (the life-cycle matrix's "expired before claimed",
    # under load). They try again while a plain read still shows their row.
    assert check(pg_backend, "t-1").action == "publish"
    row = pg_backend._row(REC)
    if change == "requeue":
        pg_backend.autocommit([(pg_backend.sql.claim_marker, (30, row))])  # claimed, unlocked
    thread = _hold_row_for(pg_backend, row, 0.05)
    try:
        if change == "drop":
            assert pg_backend.drop_queued(REC, "t-1") is True
        else:
            assert pg_backend.requeue_marker(REC, "t-1", 60) is True
    finally:
        thread.join()
    after = check(pg_backend, "t-2")
    if change == "drop":
        assert (after.action, after.unchecked) == ("publish", False)
    else:
        assert (after.action, after.task_id) == ("queued", "t-1")


def test_a_marker_change_leaves_a_row_held_past_its_retries_to_its_holder(
    pg_backend: Any,
) -> None:
    # A lock held longer than the retries (a running body's) is not waited for: the change
    # gives up after MARKER_RETRY_DELAYS and the marker stays, as before.
    from celery_idempotent.backends.sql.backend import MARKER_RETRY_DELAYS

    assert check(pg_backend, "t-1").action == "publish"
    thread = _hold_row_for(pg_backend, pg_backend._row(REC), 3.0)
    try:
        started = time.monotonic()
        assert pg_backend.drop_queued(REC, "t-1") is False
        assert time.monotonic() - started < 2.5  # gave up, did not wait for the holder
    finally:
        thread.join()
    assert sum(MARKER_RETRY_DELAYS) < 0.5
    assert check(pg_backend, "t-2").task_id == "t-1"  # still queued


def test_a_killed_delivery_holds_its_key_until_its_lease_runs_out(pg_backend: Any) -> None:
    # SPEC §8, hard time limit or a killed child: the transaction dies with its client and no
    # one drops the marker. The claimed row holds the key for the lease's ttl (status,
    # inspect and the publish check say so), then frees it: never free for a moment while
    # the dead client's claim could still take the row (issue 22's open PostgreSQL row).
    assert check(pg_backend, "t-1").action == "publish"
    claim = pg_backend.claim(LOCK, REC, 1.5)
    assert claim.lease is not None
    pg_backend.release(claim.lease)  # rolled back, as when the child is SIGKILLed
    held = check(pg_backend, "t-2")
    assert (held.action, held.task_id, held.state) == ("queued", "t-1", "running")
    assert pg_backend.is_locked(LOCK) is True
    assert pg_backend.queued_marker(REC) is None  # not queued: claimed
    time.sleep(1.7)
    assert pg_backend.is_locked(LOCK) is False
    after = check(pg_backend, "t-3")
    assert (after.action, after.unchecked) == ("publish", False)
    assert check(pg_backend, "t-4").task_id == "t-3"


def test_a_claim_in_flight_holds_its_key_before_it_locks_the_row(pg_backend: Any) -> None:
    # The claim's flight commits the "claimed" marker, then locks the row in the next
    # transaction; a killed client's server still runs both. Between the two (seen under load
    # after a hard time limit) the key read "absent" and the publish right after found the
    # row locked and answered with the killed call. The committed marker alone holds it now.
    assert check(pg_backend, "t-1").action == "publish"
    pg_backend.autocommit([(pg_backend.sql.claim_marker, (30, REC))])  # first half only
    assert pg_backend.is_locked(LOCK) is True
    held = check(pg_backend, "t-2")
    assert (held.action, held.task_id, held.state) == ("queued", "t-1", "running")
    claim = pg_backend.claim(LOCK, REC, 30)  # the second half: the delivery still claims it
    assert claim.lease is not None
    pg_backend.release(claim.lease)


def test_a_requeued_delivery_queues_its_marker_again(pg_backend: Any) -> None:
    # A published retry or Reject(requeue=True): the marker names the call again, for
    # publish_ttl, once the delivery's transaction has ended.
    assert check(pg_backend, "t-1").action == "publish"
    claim = pg_backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    assert pg_backend.requeue_marker(REC, "t-1", 60) is True  # deferred: our own row
    pg_backend.release(claim.lease)
    again = check(pg_backend, "t-2")
    assert (again.action, again.task_id) == ("queued", "t-1")
    # A marker that is not claimed is not touched.
    assert pg_backend.requeue_marker(REC, "t-1", 60) is False


def test_status_shows_the_markers_age_and_whether_a_delivery_claimed_it(pg_backend: Any) -> None:
    """SPEC §8: ``Task.idempotency_status`` (and ``inspect``) show a queued key's age and
    whether a delivery ever claimed it, on PostgreSQL as on Redis."""
    from celery_idempotent import DistributedIdempotencyGuard, admin
    from celery_idempotent.backends.sql import admin as pg_admin

    guard = DistributedIdempotencyGuard(store=pg_backend, lock_provider=pg_backend)
    key = "pub.charge:key:order-1"
    assert (guard.record_key(key), guard.lock_resource(key)) == (REC, LOCK)
    assert check(pg_backend, "t-1").action == "publish"
    time.sleep(0.3)
    fresh = admin.status_from_guard(guard, key)
    assert (fresh.state, fresh.task_id, fresh.claimed) == ("queued", "t-1", False)
    assert fresh.age is not None
    assert 0.25 <= fresh.age < 30
    doc = pg_admin.describe(pg_backend, "idempotency:", key, show_result=False, shown_url="pg")
    assert doc["queued"]["claimed"] is False
    assert 0.25 <= doc["queued"]["age"] < 30
    # Claimed, then queued again (a published retry): "claimed" says a delivery had it.
    claim = pg_backend.claim(LOCK, REC, 30)
    assert claim.lease is not None
    assert pg_backend.requeue_marker(REC, "t-1", 60) is True
    pg_backend.release(claim.lease)
    again = admin.status_from_guard(guard, key)
    assert (again.state, again.task_id, again.claimed) == ("queued", "t-1", True)
    doc = pg_admin.describe(pg_backend, "idempotency:", key, show_result=False, shown_url="pg")
    assert doc["queued"]["claimed"] is True
    # A fresh publish after the key frees is unclaimed again.
    admin.forget_from_guard(guard, key, force=False)
    assert check(pg_backend, "t-2").action == "publish"
    assert admin.status_from_guard(guard, key).claimed is False


def test_a_subclass_without_the_statement_leaves_publishes_to_the_guard(pg_backend: Any) -> None:
    from celery_idempotent.celery.publish import publish_checker

    assert publish_checker(pg_backend) is pg_backend
    pytest.importorskip("pymysql", reason="the MySQL backend's driver (test extra)")
    from celery_idempotent.backends.mysql.backend import MySQLBackend

    mysql = MySQLBackend("mysql://root@127.0.0.1:3306/none")  # no connection is made
    assert mysql.checks_publishes() is True  # issue 26: MySQL has its own statements
    assert publish_checker(mysql) is mysql
    # A subclass whose SQL has no publish statement leaves publishes to the guard.
    import types

    mysql.sql = types.SimpleNamespace(  # type: ignore[assignment]
        **{k: v for k, v in vars(mysql.sql).items() if k != "publish"}
    )
    assert mysql.checks_publishes() is False
    assert publish_checker(mysql) is None
    assert mysql.queued_marker("idempotency:{t:key:k}") is None
