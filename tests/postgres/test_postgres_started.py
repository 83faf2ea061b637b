"""``idempotency_publish_until="started"`` on PostgreSQL: the marker table's contract
(``tests/support/sql_started.py``)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest

from celery_idempotent import PostgresBackend
from tests.support.sql_started import (  # noqa: F401 - collected here against PostgreSQL
    StartedDb,
    held,
    test_a_mismatch_and_an_expired_marker,
    test_a_record_is_published_past_and_the_queued_call_replays_it,
    test_an_install_from_before_gets_the_marker_table_at_first_use,
    test_concurrent_publishes_queue_exactly_one,
    test_drop_queued_and_forget_end_the_markers,
    test_inspect_and_forget_of_the_cli_read_the_marker_table,
    test_one_running_one_queued_a_third_stopped,
    test_status_reports_the_running_call_and_the_queued_one,
    test_ttl_zero_lets_the_queued_call_run_after_the_first,
)


@pytest.fixture
def started_db(postgres_url: str, pg_table: str, pg_backend: PostgresBackend) -> StartedDb:
    created: list[PostgresBackend] = []

    def make(**options: Any) -> PostgresBackend:
        backend = PostgresBackend(postgres_url, table=pg_table, **options)
        created.append(backend)
        return backend

    def count(sql: str) -> int:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            row = conn.execute(sql).fetchone()
        assert row is not None
        return int(row[0])

    def run(sql: str) -> None:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            conn.execute(sql)

    return StartedDb(
        name="postgres",
        backend=pg_backend,
        make=make,
        count=count,
        markers=f'"{pg_table}_markers"',
        run=run,
    )
