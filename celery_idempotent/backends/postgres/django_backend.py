"""DjangoBackend: the PostgreSQL backend on Django's connection for a database alias."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.postgres.backend import PostgresBackend
from celery_idempotent.backends.postgres.connections import Rollback, Transaction, raw_alive
from celery_idempotent.backends.postgres.sql import (
    DEFAULT_TABLE,
    DIVISION_BY_ZERO,
    LOCK_NOT_AVAILABLE,
    PUBLISH_PARAMS,
    ddl,
    is_pg_error,
)
from celery_idempotent.core.exceptions import IdempotencyConnectionError

__all__ = ["APP_NAME", "DjangoBackend", "app_installed"]

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


class DjangoBackend(PostgresBackend):
    """:class:`PostgresBackend` on Django's connection for a database ``alias``.

    The guard's transaction is ``transaction.atomic(using=alias)``, so the body's ORM writes
    (on that alias) commit together with the record; nested ``atomic()`` blocks in the body
    are savepoints. Tested with Django's PostgreSQL engine (psycopg 3); other engines are
    refused (they have no row locks to wait on).
    """

    driver = "django"

    def __init__(self, alias: str = "default", **options: Any) -> None:
        if not isinstance(alias, str) or not alias:
            raise ValueError(f"django:// needs a database alias, got {alias!r}")
        self.alias = alias
        super().__init__(None, **options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.alias!r}, table={self.table!r})"

    def _db(self) -> Any:
        from django.db import connections  # noqa: PLC0415 - Django is optional

        conn = connections[self.alias]
        if conn.vendor != "postgresql":
            raise ValueError(
                f"django://{self.alias}: the database's engine is {conn.vendor!r}; the "
                "idempotency backend needs PostgreSQL (django.db.backends.postgresql)"
            )
        return conn

    def _begin(
        self, key: str, statements: Sequence[tuple[str, Sequence[Any]]]
    ) -> tuple[Transaction, list[Any]]:
        from django.db import transaction  # noqa: PLC0415

        conn = self._db()
        block = transaction.atomic(using=self.alias)
        block.__enter__()
        try:
            if not self._ready:
                self._django_ensure_table(conn)
            results = self._execute(conn, statements)
            return Transaction(conn, block, key, conn.connection), results
        except BaseException as exc:
            block.__exit__(type(exc), exc, exc.__traceback__)
            if is_pg_error(exc, LOCK_NOT_AVAILABLE):
                raise
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)):
                raise ConnectionError(f"PostgreSQL (django://{self.alias}): {exc}") from exc
            raise

    def _begin_after(
        self,
        before: Sequence[tuple[str, Sequence[Any]]],
        key: str,
        statements: Sequence[tuple[str, Sequence[Any]]],
    ) -> tuple[Transaction, list[Any]]:
        """``before`` in autocommit (Django has no pipeline: one round trip each; inside a
        test's own transaction they join it), then :meth:`_begin`."""
        conn = self._db()
        if not self._ready and not conn.in_atomic_block:
            self._django_ensure_table(conn)
        try:
            self._execute(conn, before)
        except Exception as exc:
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)):
                raise ConnectionError(f"PostgreSQL (django://{self.alias}): {exc}") from exc
            raise
        return self._begin(key, statements)

    def _execute(self, conn: Any, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        results: list[Any] = []
        with conn.cursor() as cur:
            for sql, params in statements:
                cur.execute(sql, list(params) or None)
                results.append(cur.rowcount if cur.description is None else cur.fetchall())
        return results

    def _django_ensure_table(self, conn: Any) -> None:
        with conn.cursor() as cur:
            cur.execute(self.sql.exists, list(self.sql.exists_params))
            row = cur.fetchone()
            if not (row and row[0]):
                if app_installed():
                    raise IdempotencyConnectionError(
                        None,
                        f"table {self.table} does not exist on django://{self.alias}: with "
                        "celery_idempotent.contrib.django installed the backend runs no DDL; "
                        + (
                            "run `manage.py migrate celery_idempotent`"
                            if self.table == DEFAULT_TABLE
                            else "create it with `celery -A proj idempotency sql` (the "
                            f"app's migrations create {DEFAULT_TABLE} only)"
                        ),
                    )
                if not self.create_table:
                    raise IdempotencyConnectionError(
                        None, f"table {self.table} does not exist and create_table=False"
                    )
                cur.execute(self.sql.ddl_lock, ["celery_idempotent:" + self.table])
                cur.execute(self.sql.exists, list(self.sql.exists_params))
                again = cur.fetchone()
                if not (again and again[0]):
                    for statement in ddl(self.table).split(";\n"):
                        if statement.strip():
                            cur.execute(statement)
        self._ready = True

    def _run(
        self, tx: Transaction, statements: Sequence[tuple[str, Sequence[Any]]], *, commit: bool
    ) -> list[Any]:
        from django.db import InterfaceError, OperationalError  # noqa: PLC0415

        try:
            results = self._execute(tx.conn, statements)
            if commit:
                tx.block.__exit__(None, None, None)
        except (OperationalError, InterfaceError) as exc:
            if not is_pg_error(exc, DIVISION_BY_ZERO) and not self._usable(tx.conn):
                raise ConnectionError(f"PostgreSQL (django://{self.alias}): {exc}") from exc
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

    def _alive(self, tx: Transaction) -> bool:
        conn = tx.conn
        if not conn.in_atomic_block or conn.needs_rollback or conn.connection is not tx.raw:
            return False
        return raw_alive(tx.raw) if hasattr(tx.raw, "pgconn") else True

    def autocommit(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        tx, results = self._begin("", statements)
        tx.block.__exit__(None, None, None)
        return results

    def _publish_statement(self, params: Sequence[Any]) -> list[Any]:
        """One statement on Django's connection: in autocommit (one round trip) outside an
        atomic block; inside one (a view under ATOMIC_REQUESTS) it joins that transaction,
        so the marker commits with the caller's writes (publish from
        ``transaction.on_commit`` so that the row is not held until then)."""
        conn = self._db()
        if not self._ready and not conn.in_atomic_block:
            self._django_ensure_table(conn)
        if conn.in_atomic_block:  # the caller's transaction: leave its durability alone
            params = [
                None if name == "sync" else value for name, value in zip(PUBLISH_PARAMS, params)
            ]
        try:
            with conn.cursor() as cur:
                cur.execute(self.sql.publish, list(params))
                return list(cur.fetchall())
        except Exception as exc:
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)) and not is_pg_error(
                exc, LOCK_NOT_AVAILABLE
            ):
                raise ConnectionError(f"PostgreSQL (django://{self.alias}): {exc}") from exc
            raise

    def _connection_of(self, tx: Transaction) -> Any:
        return tx.conn

    def close(self) -> None:
        """Nothing to close: Django owns its connections."""
