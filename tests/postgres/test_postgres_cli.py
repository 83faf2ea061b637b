"""The admin on PostgreSQL: ``celery idempotency sql / inspect / forget / stats``, the task's
admin methods and ``admin.forget_all``, the shared tests of ``tests/support/sql_cli.py``."""

from __future__ import annotations

import psycopg
import pytest

from celery_idempotent import PostgresBackend
from celery_idempotent.backends.postgres import ddl
from tests.support.sql_cli import (  # noqa: F401 - collected here against PostgreSQL
    SqlCli,
    app,
    run,
    test_a_held_key_follows_idempotency_on_locked,
    test_forget_all,
    test_inspect_forget_stats,
    test_no_ddl_and_no_table_is_a_clear_error,
    test_sql_prints_ddl_that_creates_a_working_table,
    test_sql_through_the_celery_program,
    test_the_tasks_admin_methods_read_and_forget_records,
)


def _run_ddl(url: str, text: str) -> None:
    with psycopg.connect(url, autocommit=True) as conn:
        conn.execute(text)


@pytest.fixture
def sqlcli(postgres_url: str, pg_table: str) -> SqlCli:
    return SqlCli(
        name="pg",
        url=postgres_url,
        table=pg_table,
        backend=PostgresBackend,
        ddl=ddl,
        sql_args=(),
        run_ddl=lambda text: _run_ddl(postgres_url, text),
        quoted=lambda table: f'"{table}"',
        short_wait=0.05,
    )
