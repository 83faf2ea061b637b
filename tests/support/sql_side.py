"""What the SQL worker tests need of a database, whichever the dialect: :class:`SqlSide`.

The PostgreSQL and MySQL suites run the same worker tests (``tests/support/sql_django.py``,
``sql_proxy_cut.py``, ``sql_publish_side.py``): each suite's conftest gives them a ``sql_side``
fixture, the database read from outside the workers (a connection of the test's own) with the
few steps whose SQL differs, and the suite's worker app.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class SqlSide:
    """One SQL database of the worker tests."""

    #: ``postgres`` or ``mysql`` (the parametrized tests' id)
    name: str
    #: the server's URL, as the backend takes it
    url: str
    #: ``query(sql, *params)``: the rows of ``sql`` (``[]`` for a statement without), on an
    #: autocommit connection of its own
    query: Callable[..., list[Any]]
    #: ``quote(name)``: an identifier quoted for this dialect
    quote: Callable[[str], str]
    #: ``exists(table)``: whether the table exists
    exists: Callable[[str], bool]
    #: ``drop(table)``: the table dropped with its fencing sequence or table and its
    #: ``<table>_payments``
    drop: Callable[[str], None]
    #: the column type of an auto-increment primary key (what Django's ``BigAutoField`` makes)
    serial_key: str
    #: what a ``CREATE TABLE`` ends with (the storage engine on MySQL)
    table_options: str
    #: the suite's worker app (``pg_app``, ``my_app``), in :attr:`app_dir`, configured from the
    #: environment variables ``<env>_BROKER_URL``, ``<env>_IDEMPOTENCY_URL``, ``<env>_DATA_URL``,
    #: ``<env>_TABLE``, ``<env>_QUEUE``
    app: str
    app_dir: Path
    env: str
    #: the dialect's backend on ``django://``, as ``module:class``
    django_backend: str

    def payments(self, table: str) -> str:
        """The quoted name of ``table``'s side-effect table, ``<table>_payments``."""
        return self.quote(f"{table}_payments")

    def app_env(self, broker: str, idempotency: str, table: str, queue: str) -> dict[str, str]:
        """The worker app's environment: broker, idempotency URL, data and table, queue."""
        prefix = self.env
        return {
            f"{prefix}_BROKER_URL": broker,
            f"{prefix}_IDEMPOTENCY_URL": idempotency,
            f"{prefix}_DATA_URL": self.url,
            f"{prefix}_TABLE": table,
            f"{prefix}_QUEUE": queue,
        }

    def paid(self, table: str, order: str) -> dict[int, int]:
        """``{pid: rows}`` of the payment rows committed for ``order``."""
        rows = self.query(
            f"SELECT pid, count(*) FROM {self.payments(table)} WHERE order_id = %s GROUP BY pid",
            order,
        )
        return {int(pid): int(n) for pid, n in rows}
