"""DjangoBackend: the PostgreSQL backend on Django's connection for a database alias."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_idempotent.backends.postgres.backend import PostgresBackend
from celery_idempotent.backends.postgres.connections import Transaction, raw_alive
from celery_idempotent.backends.postgres.sql import DIVISION_BY_ZERO, ddl, is_pg_error
from celery_idempotent.backends.sql.backend import Statement
from celery_idempotent.backends.sql.django_backend import (
    APP_NAME,
    DjangoSQLBackend,
    app_installed,
)

__all__ = ["APP_NAME", "DjangoBackend", "app_installed"]


class DjangoBackend(DjangoSQLBackend, PostgresBackend):
    """:class:`PostgresBackend` on Django's connection for a database ``alias``.

    The guard's transaction is ``transaction.atomic(using=alias)``, so the body's ORM writes
    (on that alias) commit together with the record; nested ``atomic()`` blocks in the body
    are savepoints. Tested with Django's PostgreSQL engine (psycopg 3); other engines are
    refused (they have no row locks to wait on).
    """

    driver = "django"
    vendor = "postgresql"
    database = "PostgreSQL"
    engine_needed = "; the idempotency backend needs PostgreSQL (django.db.backends.postgresql)"

    def _expected_error(self, exc: BaseException) -> bool:
        return is_pg_error(exc, DIVISION_BY_ZERO)

    def _begin(self, key: str, statements: Sequence[Statement]) -> tuple[Transaction, list[Any]]:
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
            if self._is_lock_error(exc):
                raise
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)):
                raise self._connection_error(exc) from exc
            raise

    def _begin_after(
        self,
        before: Sequence[Statement],
        key: str,
        statements: Sequence[Statement],
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
                raise self._connection_error(exc) from exc
            raise
        return self._begin(key, statements)

    def _django_ensure_table(self, conn: Any) -> None:
        with conn.cursor() as cur:
            if not self._table_exists(cur):
                self._table_missing()
                cur.execute(self.sql.ddl_lock, ["celery_idempotent:" + self.table])
                if not self._table_exists(cur):
                    for statement in ddl(self.table).split(";\n"):
                        if statement.strip():
                            cur.execute(statement)
        self._ready = True

    def _alive(self, tx: Transaction) -> bool:
        conn = tx.conn
        if not conn.in_atomic_block or conn.needs_rollback or conn.connection is not tx.raw:
            return False
        return raw_alive(tx.raw) if hasattr(tx.raw, "pgconn") else True

    def _publish_statement(self, values: Mapping[str, Any]) -> list[Any]:
        """One statement on Django's connection: in autocommit (one round trip) outside an
        atomic block; inside one (a view under ATOMIC_REQUESTS) it joins that transaction,
        so the marker commits with the caller's writes (publish from
        ``transaction.on_commit`` so that the row is not held until then)."""
        conn = self._db()
        if not self._ready and not conn.in_atomic_block:
            self._django_ensure_table(conn)
        # In the caller's transaction leave its durability alone.
        params = self._publish_params(values, sync=None if conn.in_atomic_block else "off")
        try:
            with conn.cursor() as cur:
                cur.execute(self.sql.publish, list(params))
                return list(cur.fetchall())
        except Exception as exc:
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)) and not self._is_lock_error(exc):
                raise self._connection_error(exc) from exc
            raise
