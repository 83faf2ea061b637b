"""DjangoSQLBackend: an SQL backend on Django's connection for a database alias, any dialect.

What the PostgreSQL and the MySQL backends on ``django://<alias>`` share: the guard's
transaction is ``transaction.atomic(using=alias)``, statements run one round trip each on
Django's cursor, Django's errors read as connection errors, a missing table is explained (the
Django app's migrations own it when the app is installed). Each dialect's ``DjangoBackend``
subclasses this class and its own backend, and opens the transaction its way (``_begin``).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any, ClassVar

from celery_idempotent.backends.sql.backend import SQLBackend, Statement
from celery_idempotent.backends.sql.connections import Rollback, Transaction
from celery_idempotent.backends.sql.records import DEFAULT_TABLE
from celery_idempotent.core.exceptions import IdempotencyConnectionError

__all__ = ["APP_NAME", "DjangoSQLBackend", "app_installed"]

log = logging.getLogger("celery_idempotent")

#: The dotted name of the Django app whose migrations own the table
#: (``celery_idempotent.contrib.django``, which re-exports it): named here, below the app, so
#: that a backend asks Django whether the app is installed without importing it.
APP_NAME = "celery_idempotent.contrib.django"


def app_installed() -> bool:
    """Whether Django is configured with the app in ``INSTALLED_APPS`` (never imports Django
    for a process that has not loaded it)."""
    import sys  # noqa: PLC0415

    if "django.apps" not in sys.modules:
        return False
    from django.apps import apps  # noqa: PLC0415

    try:
        return bool(apps.ready and apps.is_installed(APP_NAME))
    except Exception:  # settings not configured
        return False


class DjangoSQLBackend(SQLBackend):
    """The Django half of a dialect's ``DjangoBackend`` (listed before the dialect's backend
    in its bases, so that these steps replace the driver's): ``alias`` names the database,
    the other keywords are the dialect backend's."""

    driver = "django"
    #: Django's ``vendor`` of the dialect's engine.
    vendor: ClassVar[str] = ""
    #: The database's name in errors.
    database: ClassVar[str] = ""
    #: What an error about another engine says after naming it.
    engine_needed: ClassVar[str] = ""
    #: The command that prints the table's DDL.
    sql_command: ClassVar[str] = "celery -A proj idempotency sql"

    _ready: bool  # the transactions class's: whether the table is known to exist

    def __init__(self, alias: str = "default", **options: Any) -> None:
        if not isinstance(alias, str) or not alias:
            raise ValueError(f"django:// needs a database alias, got {alias!r}")
        self.alias = alias
        super().__init__(None, **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.alias!r}, table={self.table!r})"

    def _db(self) -> Any:
        """Django's connection for the alias; an error when its engine is another vendor's."""
        from django.db import connections  # noqa: PLC0415 - Django is optional

        conn = connections[self.alias]
        if conn.vendor != self.vendor:
            raise ValueError(
                f"django://{self.alias}: the database's engine is {conn.vendor!r}"
                + self.engine_needed
            )
        return conn

    def _connection_error(self, exc: BaseException) -> ConnectionError:
        return ConnectionError(f"{self.database} (django://{self.alias}): {exc}")

    def _expected_error(self, exc: BaseException) -> bool:
        """Whether ``exc``, raised by a statement of the guard's, is the dialect's answer (a
        lock error, the fence) rather than a sign that the connection failed."""
        raise NotImplementedError

    def _execute(self, conn: Any, statements: Sequence[Statement]) -> list[Any]:
        results: list[Any] = []
        with conn.cursor() as cur:
            for sql, params in statements:
                cur.execute(sql, list(params) or None)
                results.append(cur.rowcount if cur.description is None else cur.fetchall())
        return results

    def _table_exists(self, cur: Any) -> bool:
        """Whether the table exists (asked on Django's cursor ``cur``)."""
        cur.execute(self.sql.exists, list(self.sql.exists_params))
        row = cur.fetchone()
        return bool(row and row[0])

    def _table_missing(self) -> None:
        """The table does not exist: an error when this backend may not create it."""
        if app_installed():
            raise IdempotencyConnectionError(
                None,
                f"table {self.table} does not exist on django://{self.alias}: with "
                "celery_idempotent.contrib.django installed the backend runs no DDL; "
                + (
                    "run `manage.py migrate celery_idempotent`"
                    if self.table == DEFAULT_TABLE
                    else f"create it with `{self.sql_command}` (the app's migrations create "
                    f"{DEFAULT_TABLE} only)"
                ),
            )
        if not self.create_table:
            raise IdempotencyConnectionError(
                None, f"table {self.table} does not exist and create_table=False"
            )

    def _run(self, tx: Transaction, statements: Sequence[Statement], *, commit: bool) -> list[Any]:
        from django.db import InterfaceError, OperationalError  # noqa: PLC0415

        try:
            results = self._execute(tx.conn, statements)
            if commit:
                tx.block.__exit__(None, None, None)
        except (OperationalError, InterfaceError) as exc:
            if not self._expected_error(exc) and not self._usable(tx.conn):
                raise self._connection_error(exc) from exc
            raise
        return results

    @staticmethod
    def _usable(conn: Any) -> bool:
        try:
            return bool(conn.connection is not None and conn.is_usable())
        except Exception:
            return False

    def _rollback(self, tx: Transaction) -> None:
        error = Rollback()
        try:
            tx.block.__exit__(Rollback, error, None)
        except Exception:
            log.debug("rollback failed", exc_info=True)

    def _finish(self, tx: Transaction) -> None:
        return None

    def autocommit(self, statements: Sequence[Statement]) -> list[Any]:
        tx, results = self._begin("", statements)
        tx.block.__exit__(None, None, None)
        return results

    def _connection_of(self, tx: Transaction) -> Any:
        return tx.conn

    def close(self) -> None:
        """Nothing to close: Django owns its connections."""
