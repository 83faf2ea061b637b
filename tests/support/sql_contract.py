"""The SQL backends' shared contract: what a backend whose record commits in the body's own
transaction promises, run against PostgreSQL (``tests/postgres/test_postgres_sql_contract.py``)
and MySQL / MariaDB (``tests/mysql/test_mysql_sql_contract.py``).

Each of those modules imports the tests below and gives them an ``sqldb`` fixture: a
:class:`SqlDb`, the backend under test with the few database-specific steps a test needs
(a side-effect table, a count from another connection, a write through the body's
connection, ending a session from the server's side).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyKeyHeldError,
    LockLostError,
    current_connection,
    current_lease,
)


@dataclass
class SqlDb:
    """One SQL backend under the shared contract."""

    name: str
    backend: Any
    #: the backend's table, as SQL (quoted)
    table: str
    #: a side-effect table ``(k, fence)`` of this test, as SQL (quoted)
    payments: str
    #: ``count(sql)``: the first column of the first row of ``sql``, from another connection
    count: Callable[[str], int]
    #: ``write(conn, k, fence)``: insert a payment through the body's connection
    write: Callable[[Any, str, int], None]
    #: ``execute(conn, sql)``: run raw SQL on the body's connection
    execute: Callable[[Any, str], None]
    #: ``kill(conn)``: the server ends the session of the body's connection, and returns
    #: once it has ended
    kill: Callable[[Any], None]
    #: a new backend on the same table (keywords: the backend's)
    make: Callable[..., Any]


def make_guard(backend: Any, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("retry_base_delay", 0.01)
    return DistributedIdempotencyGuard(store=backend, lock_provider=backend, **options)


def test_body_writes_and_record_become_visible_together(sqldb: SqlDb) -> None:
    guard = make_guard(sqldb.backend)
    seen_inside: list[tuple[int, int]] = []
    records = f"SELECT count(*) FROM {sqldb.table} WHERE state = 'completed'"

    def body() -> str:
        lease = current_lease()
        assert lease is not None
        sqldb.write(current_connection(), "k", lease.fencing_token)
        # From another connection: neither the payment nor the record exists yet.
        seen_inside.append(
            (sqldb.count(f"SELECT count(*) FROM {sqldb.payments}"), sqldb.count(records))
        )
        return "paid"

    assert guard.execute("k", body) == "paid"
    assert seen_inside == [(0, 0)]
    assert sqldb.count(f"SELECT count(*) FROM {sqldb.payments}") == 1
    assert sqldb.count(records) == 1
    assert guard.execute("k", body) == "paid"  # replayed: no second payment
    assert sqldb.count(f"SELECT count(*) FROM {sqldb.payments}") == 1


def test_a_failing_body_rolls_back_its_writes(sqldb: SqlDb) -> None:
    guard = make_guard(sqldb.backend)

    def body() -> None:
        sqldb.write(current_connection(), "k", 1)
        raise RuntimeError("declined")

    with pytest.raises(RuntimeError, match="declined"):
        guard.execute("k", body)
    assert sqldb.count(f"SELECT count(*) FROM {sqldb.payments}") == 0
    assert sqldb.count(f"SELECT count(*) FROM {sqldb.table}") == 0  # the claim's row too
    assert guard.execute("k", lambda: "again") == "again"


def test_fencing_tokens_increase_across_rollbacks_expiry_and_the_sweep(sqldb: SqlDb) -> None:
    guard = make_guard(sqldb.backend, ttl=0.2)
    tokens: list[int] = []

    def failing() -> None:
        tokens.append(current_lease().fencing_token)  # type: ignore[union-attr]
        raise RuntimeError

    for _ in range(3):
        with pytest.raises(RuntimeError):
            guard.execute("k", failing)
    first = guard.run("k", lambda: "v")
    assert first.fencing_token is not None
    tokens.append(first.fencing_token)
    time.sleep(0.3)  # the record expires: replaced in place by the next claim
    second = guard.run("k", lambda: "w")
    assert not second.replayed
    assert second.fencing_token is not None
    tokens.append(second.fencing_token)
    time.sleep(0.3)
    assert sqldb.backend.cleanup() == 1  # the row is gone: the next claim inserts it anew
    third = guard.run("k", lambda: "x")
    assert third.fencing_token is not None
    tokens.append(third.fencing_token)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


def test_a_duplicate_waits_on_the_row_lock_and_replays(sqldb: SqlDb) -> None:
    sqldb.backend.lock_timeout = 5.0
    guard = make_guard(sqldb.backend, retry_count=0)
    running = threading.Event()
    results: list[Any] = []

    def slow() -> str:
        running.set()
        time.sleep(0.3)
        return "first"

    holder = threading.Thread(target=lambda: results.append(guard.run("k", slow)))
    holder.start()
    assert running.wait(5)
    duplicate = guard.run("k", lambda: "second")  # one attempt: it waits for the commit
    holder.join()
    assert duplicate.replayed
    assert duplicate.value == "first"
    assert duplicate.attempts == 1
    assert results[0].value == "first"


def test_a_claim_that_waits_too_long_is_one_failed_attempt(sqldb: SqlDb) -> None:
    other = sqldb.make(lock_timeout=0)
    try:
        held = sqldb.backend.claim("p:lock:{hot}", "p:{hot}", 10)
        assert held.lease is not None
        started = time.monotonic()
        assert other.claim("p:lock:{hot}", "p:{hot}", 10) == (None, None)
        assert time.monotonic() - started < 2.5
        # The connection is usable afterwards, and the session's own lock wait is back.
        for index in range(3):
            claim = other.claim(f"p:lock:{{c{index}}}", f"p:{{c{index}}}", 10)
            assert claim.lease is not None
            other.release(claim.lease)
        assert sqldb.backend.release(held.lease)
    finally:
        other.close()


def test_cleanup_deletes_expired_rows_in_bounded_batches(sqldb: SqlDb) -> None:
    guard = make_guard(sqldb.backend, ttl=0.1)
    for index in range(7):
        guard.execute(f"k{index}", lambda: 1)
    lease = sqldb.backend.acquire("p:lock:{held}", 5)  # an uncommitted row: never swept
    time.sleep(0.2)
    assert sqldb.backend.cleanup(limit=5) == 5
    assert sqldb.backend.cleanup(limit=5) == 2
    assert sqldb.backend.cleanup(limit=5) == 0
    assert lease is not None
    assert sqldb.backend.release(lease)


def test_a_connection_lost_mid_body_commits_nothing(sqldb: SqlDb) -> None:
    guard = make_guard(sqldb.backend)

    def body() -> str:
        conn = current_connection()
        sqldb.write(conn, "k", 1)
        sqldb.kill(conn)
        return "lost"

    with pytest.raises(LockLostError) as caught:
        guard.execute("k", body)
    assert caught.value.result == "lost"
    assert sqldb.count(f"SELECT count(*) FROM {sqldb.payments}") == 0
    assert guard.execute("k", lambda: "again") == "again"


@pytest.mark.parametrize("ending", ["COMMIT", "ROLLBACK", "COMMIT; BEGIN"])
def test_a_body_that_ends_the_transaction_has_its_commit_refused(sqldb: SqlDb, ending: str) -> None:
    guard = make_guard(sqldb.backend)

    def body() -> str:
        conn = current_connection()
        sqldb.write(conn, "before", 1)
        for statement in ending.split("; "):
            sqldb.execute(conn, statement)
        sqldb.write(conn, "after", 2)
        return "paid"

    with pytest.raises(LockLostError, match="ended the guard's transaction itself") as caught:
        guard.execute("k", body)
    assert caught.value.result == "paid"
    assert sqldb.backend.get(guard.record_key("k")) is None
    assert guard.execute("k", lambda: "again") == "again"


def test_delete_refuses_a_key_a_running_body_holds(sqldb: SqlDb) -> None:
    guard = make_guard(sqldb.backend)
    sqldb.backend.lock_timeout = 0.01 if sqldb.name == "postgres" else 0
    inside = threading.Event()
    release = threading.Event()
    errors: list[BaseException] = []
    deleted: list[bool] = []

    def body() -> str:
        inside.set()
        release.wait(10)
        return "done"

    thread = threading.Thread(target=lambda: guard.execute("k", body))
    thread.start()
    try:
        assert inside.wait(5)
        other = sqldb.make(lock_timeout=0)
        try:
            assert other.is_locked(guard.lock_resource("k"))
            # Refused (MySQL waits on the row, then says so) or nothing to delete
            # (PostgreSQL does not see a first claim's uncommitted row): never deleted.
            try:
                deleted.append(other.delete(guard.record_key("k")))
            except IdempotencyKeyHeldError as exc:
                errors.append(exc)
        finally:
            other.close()
    finally:
        release.set()
        thread.join()
    assert len(errors) + deleted.count(False) == 1, (errors, deleted)
    assert sqldb.backend.get(guard.record_key("k")) is not None  # the body's commit stands
    assert sqldb.backend.delete(guard.record_key("k"))
    assert not sqldb.backend.is_locked(guard.lock_resource("k"))
