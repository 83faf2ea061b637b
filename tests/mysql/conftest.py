"""Fixtures of the MySQL / MariaDB backend suite.

``mysql_url`` is ``MYSQL_URL`` when given (``.ci/run`` passes the machine's MariaDB), else a
private server started once per session from ``mariadbd`` (or ``mysqld``) on ``PATH`` or in
``/usr/sbin``; with neither, these tests are skipped and say why (``CELERY_IDEMPOTENT_STRICT``
makes that a failure). Every test works in a table of its own (``my_table``), dropped
afterwards with its fencing table and ``<table>_payments``.
"""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).parent.parent / "redis"))  # the shared contract suite
sys.path.insert(0, str(Path(__file__).parent))  # mysql_support

from mysql_support import connect

from celery_idempotent.servers.mysql_server import MySQLServer, find_server


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "mysql_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.mysql)


@pytest.fixture(scope="session")
def mysql_url() -> Iterator[str]:
    """A MySQL URL: ``MYSQL_URL``, or a private MariaDB server for this session."""
    given = os.environ.get("MYSQL_URL")
    if given:
        yield given
        return
    if find_server() is None:
        pytest.skip(
            "no MySQL/MariaDB: set MYSQL_URL, or install mariadbd (Debian: mariadb-server-core)"
        )
    with MySQLServer() as server:
        yield server.url


def drop_table(url: str, table: str) -> None:
    conn = connect(url)
    try:
        with conn.cursor() as cur:
            # A transaction a failed test left open must not hang the suite: fail loudly.
            cur.execute("SET SESSION lock_wait_timeout = 10")
            for name in (
                table,
                f"{table}_fencing",
                f"{table}_payments",
                f"{table}_runs",
                f"{table}_markers",
            ):
                cur.execute(f"DROP TABLE IF EXISTS `{name}`")
    finally:
        conn.close()


@pytest.fixture
def my_table(mysql_url: str) -> Iterator[str]:
    """A table name of this test's own (``t_<hex>``), dropped afterwards (with
    ``<table>_fencing``, ``<table>_payments`` and ``<table>_runs``)."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    yield table
    drop_table(mysql_url, table)


@pytest.fixture
def my_backend(mysql_url: str, my_table: str) -> Iterator[Any]:
    from celery_idempotent import MySQLBackend

    backend = MySQLBackend(mysql_url, table=my_table, lock_timeout=0)
    yield backend
    for token in list(backend._open):
        tx = backend._open[token]
        if tx.lease is not None:
            backend.release(tx.lease)
    backend.close()


@pytest.fixture(scope="session")
def sql_side(mysql_url: str) -> Any:
    """This server as the SQL worker tests read it (``tests/support/sql_side.py``)."""
    from mysql_support import query

    from tests.support.sql_side import SqlSide

    return SqlSide(
        name="mysql",
        url=mysql_url,
        query=lambda sql, *params: query(mysql_url, sql, *params),
        quote=lambda name: f"`{name}`",
        exists=lambda table: bool(query(mysql_url, "SHOW TABLES LIKE %s", table)),
        drop=lambda table: drop_table(mysql_url, table),
        serial_key="BIGINT AUTO_INCREMENT",
        table_options=" ENGINE=InnoDB",
        app="my_app",
        app_dir=Path(__file__).resolve().parent,
        env="MY",
        django_backend="celery_idempotent.backends.mysql.django_backend:DjangoMySQLBackend",
    )
