"""``idempotency_publish_until="started"`` on MySQL / MariaDB: the marker table's contract
(``tests/support/sql_started.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from mysql_support import query

from celery_idempotent import MySQLBackend
from tests.support.sql_started import (  # noqa: F401 - collected here against MySQL
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
def started_db(mysql_url: str, my_table: str, my_backend: MySQLBackend) -> StartedDb:
    created: list[MySQLBackend] = []

    def make(**options: Any) -> MySQLBackend:
        backend = MySQLBackend(mysql_url, table=my_table, **options)
        created.append(backend)
        return backend

    def run(sql: str) -> None:
        query(mysql_url, sql)

    return StartedDb(
        name="mysql",
        backend=my_backend,
        make=make,
        count=lambda sql: int(query(mysql_url, sql)[0][0]),
        markers=f"`{my_table}_markers`",
        run=run,
    )
