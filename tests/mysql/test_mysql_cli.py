"""The admin on MySQL / MariaDB: ``celery idempotency sql / inspect / forget / stats``, the
task's admin methods and ``admin.forget_all``, the shared tests of
``tests/support/sql_cli.py``."""

from __future__ import annotations

import pytest
from mysql_support import connect

from celery_idempotent import MySQLBackend
from celery_idempotent.backends.mysql import ddl
from tests.support.sql_cli import (  # noqa: F401 - collected here against MySQL
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
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            for statement in text.split(";\n"):
                if statement.strip():
                    cur.execute(statement)
    finally:
        conn.close()


@pytest.fixture
def sqlcli(mysql_url: str, my_table: str) -> SqlCli:
    return SqlCli(
        name="my",
        url=mysql_url,
        table=my_table,
        backend=MySQLBackend,
        ddl=ddl,
        sql_args=("--dialect", "mysql"),
        run_ddl=lambda text: _run_ddl(mysql_url, text),
        quoted=lambda table: f"`{table}`",
        short_wait=0,
    )
