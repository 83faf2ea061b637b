"""DjangoMySQLBackend: the MySQL backend on Django's connection for a database alias."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.mysql.backend import MySQLBackend
from celery_idempotent.backends.mysql.sql import FENCED, LOCK_ERRORS, check_server, ddl, error_code
from celery_idempotent.backends.sql.backend import Statement
from celery_idempotent.backends.sql.connections import Transaction
from celery_idempotent.backends.sql.django_backend import DjangoSQLBackend
from celery_idempotent.core.exceptions import IdempotencyConnectionError

__all__ = ["DjangoMySQLBackend"]

log = logging.getLogger("celery_idempotent")


class DjangoMySQLBackend(DjangoSQLBackend, MySQLBackend):
    """:class:`MySQLBackend` on Django's connection for a database ``alias`` whose engine is
    ``django.db.backends.mysql`` (mysqlclient, or PyMySQL installed as ``MySQLdb``).

    The guard's transaction is ``transaction.atomic(using=alias)``, so the body's ORM writes
    (on that alias) commit together with the record; nested ``atomic()`` blocks in the body
    are savepoints. Its first statement sets READ COMMITTED for that transaction (Django's
    own default level on MySQL). Django's connection may not accept several statements in
    one query, so each statement is its own round trip here, and the commit's fence check is
    a statement of its own before Django's COMMIT: the same guarantees, more round trips
    than ``mysql://`` (the benchmark counts both).
    """

    driver = "django"
    vendor = "mysql"
    database = "MySQL"
    engine_needed = ", not MySQL"
    sql_command = "celery -A proj idempotency sql --dialect mysql"

    def _expected_error(self, exc: BaseException) -> bool:
        return error_code(exc) in (*LOCK_ERRORS, FENCED)

    def _begin(self, key: str, statements: Sequence[Statement]) -> tuple[Transaction, list[Any]]:
        from django.db import transaction  # noqa: PLC0415

        conn = self._db()
        outermost = not conn.in_atomic_block
        block = transaction.atomic(using=self.alias)
        block.__enter__()
        try:
            if not self._ready:
                self._django_ensure_table(conn)
            opening = [(self.sql.isolation, ())] if outermost else []
            results = self._execute(conn, [*opening, *statements])[len(opening) :]
        except BaseException as exc:
            if self._is_lock_error(exc):
                self._reset_wait(conn)
            block.__exit__(type(exc), exc, exc.__traceback__)
            if self._is_lock_error(exc):
                raise
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)) and not self._usable(conn):
                raise self._connection_error(exc) from exc
            raise
        tx = Transaction(conn, block, key, None)
        tx.raw = conn.connection
        tx.pid = self._thread_id(conn)
        return tx, results

    def _reset_wait(self, conn: Any) -> None:
        try:
            with conn.cursor() as cur:
                cur.execute(self.sql.wait_reset)
        except Exception:
            log.debug("resetting innodb_lock_wait_timeout failed", exc_info=True)

    @staticmethod
    def _thread_id(conn: Any) -> int | None:
        raw = conn.connection
        ident = getattr(raw, "thread_id", None)
        return int(ident()) if callable(ident) else None

    def _django_ensure_table(self, conn: Any) -> None:
        # Django's own version check (at connect) read and cached the server's version.
        refused = check_server(str(conn.mysql_server_info))
        if refused is not None:
            raise IdempotencyConnectionError(None, f"django://{self.alias}: {refused}")
        with conn.cursor() as cur:
            exists = self._table_exists(cur)
        if not exists:
            self._table_missing()
            # DDL commits implicitly on MySQL: on a connection of its own, never inside
            # the guard's atomic block.
            from django.db import connections  # noqa: PLC0415

            other = connections.create_connection(self.alias)
            try:
                with other.cursor() as cur:
                    for statement in ddl(self.table).split(";\n"):
                        if statement.strip():
                            cur.execute(statement)
            finally:
                other.close()
        self._ready = True

    def _alive(self, tx: Transaction) -> bool:
        conn = tx.conn
        return bool(conn.in_atomic_block and not conn.needs_rollback and conn.connection is tx.raw)
