"""The SQL backends' shared contract (``tests/support/sql_contract.py``) on PostgreSQL."""

from __future__ import annotations

import time
from typing import Any

import psycopg
import pytest

from celery_idempotent import PostgresBackend
from tests.support.sql_contract import (  # noqa: F401 - collected here against PostgreSQL
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


def _kill(url: str, conn: Any) -> None:
    pid = conn.info.backend_pid
    with psycopg.connect(url, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
        deadline = time.monotonic() + 10
        while admin.execute(
            "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
        ).fetchone() != (0,):
            assert time.monotonic() < deadline
            time.sleep(0.01)


@pytest.fixture
def sqldb(postgres_url: str, pg_table: str, pg_backend: PostgresBackend) -> SqlDb:
    pg_backend.cleanup()  # creates the table
    payments = f'"{pg_table}_payments"'
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {payments} (k text, fence bigint)")
    created: list[PostgresBackend] = []

    def make(**options: Any) -> PostgresBackend:
        if options.get("lock_timeout") == 0:
            options["lock_timeout"] = 0.01  # PostgreSQL's least wait
        backend = PostgresBackend(postgres_url, table=pg_table, **options)
        created.append(backend)
        return backend

    def count(sql: str) -> int:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            row = conn.execute(sql).fetchone()
        assert row is not None
        return int(row[0])

    def set_timeout(value: float) -> None:
        pg_backend.lock_timeout = value or 0.01

    return SqlDb(
        name="postgres",
        backend=pg_backend,
        table=f'"{pg_table}"',
        payments=payments,
        count=count,
        write=lambda conn, k, fence: conn.execute(
            f"INSERT INTO {payments} VALUES (%s, %s)", (k, fence)
        ),
        execute=lambda conn, sql: conn.execute(sql),
        kill=lambda conn: _kill(postgres_url, conn),
        make=make,
    )
