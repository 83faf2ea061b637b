"""DjangoMySQLBackend: the MySQL backend on Django's connection for a database alias."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.mysql.backend import MySQLBackend
from celery_idempotent.backends.mysql.sql import (
    DEFAULT_TABLE,
    LOCK_ERRORS,
    check_server,
    ddl,
    error_code,
)
from celery_idempotent.backends.postgres.connections import Rollback, Transaction
from celery_idempotent.backends.postgres.django_backend import app_installed
from celery_idempotent.core.exceptions import IdempotencyConnectionError

__all__ = ["DjangoMySQLBackend"]

log = logging.getLogger("celery_idempotent")


class DjangoMySQLBackend(MySQLBackend):
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
        if conn.vendor != "mysql":
            raise ValueError(
                f"django://{self.alias}: the database's engine is {conn.vendor!r}, not MySQL"
            )
        return conn

    def _begin(
        self, key: str, statements: Sequence[tuple[str, Sequence[Any]]]
    ) -> tuple[Transaction, list[Any]]:
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
            if error_code(exc) in LOCK_ERRORS:
                self._reset_wait(conn)
            block.__exit__(type(exc), exc, exc.__traceback__)
            if error_code(exc) in LOCK_ERRORS:
                raise
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)) and not self._usable(conn):
                raise ConnectionError(f"MySQL (django://{self.alias}): {exc}") from exc
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

    def _execute(self, conn: Any, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        results: list[Any] = []
        with conn.cursor() as cur:
            for sql, params in statements:
                cur.execute(sql, list(params) or None)
                results.append(cur.rowcount if cur.description is None else cur.fetchall())
        return results

    def _django_ensure_table(self, conn: Any) -> None:
        # Django's own version check (at connect) read and cached the server's version.
        refused = check_server(str(conn.mysql_server_info))
        if refused is not None:
            raise IdempotencyConnectionError(None, f"django://{self.alias}: {refused}")
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
                        else "create it with `celery -A proj idempotency sql --dialect mysql` "
                        f"(the app's migrations create {DEFAULT_TABLE} only)"
                    ),
                )
            if not self.create_table:
                raise IdempotencyConnectionError(
                    None, f"table {self.table} does not exist and create_table=False"
                )
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

    def _run(
        self, tx: Transaction, statements: Sequence[tuple[str, Sequence[Any]]], *, commit: bool
    ) -> list[Any]:
        from django.db import InterfaceError, OperationalError  # noqa: PLC0415

        try:
            results = self._execute(tx.conn, statements)
            if commit:
                tx.block.__exit__(None, None, None)
        except (OperationalError, InterfaceError) as exc:
            if error_code(exc) not in (*LOCK_ERRORS, 1172) and not self._usable(tx.conn):
                raise ConnectionError(f"MySQL (django://{self.alias}): {exc}") from exc
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
        return bool(conn.in_atomic_block and not conn.needs_rollback and conn.connection is tx.raw)

    def autocommit(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        tx, results = self._begin("", statements)
        tx.block.__exit__(None, None, None)
        return results

    def close(self) -> None:
        """Nothing to close: Django owns its connections."""
