"""The SQL backends' shared contract (``tests/support/sql_contract.py``) on MySQL / MariaDB."""

from __future__ import annotations

from typing import Any

import pytest
from mysql_support import connect, query

from celery_idempotent import MySQLBackend
from tests.support.sql_contract import (  # noqa: F401 - collected here against MySQL
    SqlDb,
    test_a_body_that_ends_the_transaction_has_its_commit_refused,
    test_a_claim_that_waits_too_long_is_one_failed_attempt,
    test_a_connection_lost_mid_body_commits_nothing,
    test_a_duplicate_waits_on_the_row_lock_and_replays,
    test_a_failing_body_rolls_back_its_writes,
    test_body_writes_and_record_become_visible_together,
    test_cleanup_deletes_expired_rows_in_bounded_batches,
    test_delete_refuses_a_key_a_running_body_holds,
    test_fencing_tokens_increase_across_rollbacks_expiry_and_the_sweep,
)


def _execute(conn: Any, sql: str, *params: Any) -> None:
    with conn.cursor() as cur:
        cur.execute(sql, params or None)


def _kill(url: str, conn: Any) -> None:
    import time

    ident = conn.thread_id()
    query(url, f"KILL {int(ident)}")
    deadline = time.monotonic() + 10
    while query(
        url, "SELECT COUNT(*) FROM information_schema.PROCESSLIST WHERE ID = %s", ident
    ) != [(0,)]:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.fixture
def sqldb(mysql_url: str, my_table: str, my_backend: MySQLBackend) -> SqlDb:
    my_backend.cleanup()  # creates the table
    payments = f"`{my_table}_payments`"
    query(mysql_url, f"CREATE TABLE {payments} (k VARCHAR(64), fence BIGINT) ENGINE=InnoDB")
    created: list[MySQLBackend] = []

    def make(**options: Any) -> MySQLBackend:
        backend = MySQLBackend(mysql_url, table=my_table, **options)
        created.append(backend)
        return backend

    def count(sql: str) -> int:
        return int(query(mysql_url, sql)[0][0])

    return SqlDb(
        name="mysql",
        backend=my_backend,
        table=f"`{my_table}`",
        payments=payments,
        count=count,
        write=lambda conn, k, fence: _execute(
            conn, f"INSERT INTO {payments} VALUES (%s, %s)", k, fence
        ),
        execute=_execute,
        kill=lambda conn: _kill(mysql_url, conn),
        make=make,
    )


def _unused(*_: Any) -> None:  # pragma: no cover - keeps the imports above referenced
    connect("")


def test_round_trips_match_a_plain_transaction(mysql_url: str, my_table: str) -> None:
    """Counted by a TCP relay (benchmarks.pg.FlightCounter), not timed: a first execution
    costs what a plain START TRANSACTION / INSERT / COMMIT costs (3), a replay 2."""
    from benchmarks.mysql import round_trips

    query(mysql_url, f"CREATE TABLE `{my_table}_payments` (k VARCHAR(64)) ENGINE=InnoDB")
    trips = round_trips(mysql_url, my_table)
    assert trips == {"plain_tx": 3.0, "my_first": 3.0, "my_duplicate": 2.0}
