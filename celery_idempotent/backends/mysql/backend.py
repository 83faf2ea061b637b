"""MySQLBackend: the lock provider, store and atomic backend on one InnoDB table.

The protocol's steps are :class:`~celery_idempotent.backends.sql.backend.SQLBackend`'s
(shared with the PostgreSQL backend: acquire, extend, release, get, claim, commit, the publish
decision, the lost-reply check, the sweep's schedule); what is MySQL's here is the order of
:mod:`celery_idempotent.backends.mysql.sql`'s statements in each step, how PyMySQL's errors read
(error numbers), the keys' length limit, the publish check's and the sweep's own shape, and the
transactions of :class:`~celery_idempotent.backends.mysql.connections.PyMySQLTransactions`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_idempotent.backends.mysql.connections import (
    PyMySQLTransactions,
    connect_args,
    import_pymysql,
    in_transaction,
    socket_alive,
)
from celery_idempotent.backends.mysql.sql import (
    FENCED,
    LOCK_ERRORS,
    MAX_KEY,
    SAVEPOINT_GONE,
    Statements,
    error_code,
    lock_seconds,
    markers_ddl,
    quote_table,
)
from celery_idempotent.backends.sql.backend import SQLBackend, Statement
from celery_idempotent.backends.sql.connections import Transaction, split_url
from celery_idempotent.backends.sql.records import record_columns
from celery_idempotent.core.protocols import IdempotencyRecord
from celery_idempotent.core.validate import check_delay

__all__ = ["MySQLBackend"]


class MySQLBackend(SQLBackend, PyMySQLTransactions):
    """Locks and records in one MySQL 8 / MariaDB 10.6+ table; the record commits in the
    body's transaction.

    At once the guard's ``lock_provider``, its ``store`` and (``atomic_with``) the backend
    that claims and commits in one step: pass the same instance as both::

        backend = MySQLBackend("mysql://app:secret@db:3306/app")
        guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)

        def body():
            with current_connection().cursor() as cur:   # a PyMySQL connection
                cur.execute("INSERT INTO payments ...")  # commits with the record

    ``url`` is ``mysql://user:password@host:port/database`` (query parameters: ``table``,
    ``lock_timeout``, and PyMySQL's ``unix_socket``, ``charset``, ``connect_timeout``,
    ``read_timeout``, ``write_timeout``, ``ssl_ca``, ``ssl_cert``, ``ssl_key``,
    ``ssl_verify_cert``, ``ssl_verify_identity``, ``ssl_disabled``). A claim waits at most
    ``lock_timeout`` seconds for a key's current holder, rounded up to whole seconds
    (InnoDB's ``innodb_lock_wait_timeout`` has no finer unit; ``0``: no wait, which MySQL,
    unlike MariaDB, raises to 1 second), then counts as one failed lock attempt. The other
    keywords are :class:`~celery_idempotent.PostgresBackend`'s.
    """

    driver = "pymysql"
    #: The SQL dialect (the CLI picks its admin module by it).
    dialect = "mysql"
    default_lock_timeout = 1.0

    def _check_lock_timeout(self, seconds: float) -> float:
        """Seconds, ``0`` allowed (no wait)."""
        return check_delay("lock_timeout", seconds)

    def _statements(self, table: str) -> Statements:
        return Statements(table)

    def _check_driver(self, url: str | None) -> None:
        if self.driver == "pymysql":
            if url is None:
                raise ValueError("MySQLBackend needs a mysql:// URL")
            import_pymysql()  # fail now, with the install line, when PyMySQL is missing
            connect_args(split_url(url)[0])  # a bad URL fails here, naming what is wrong

    def _is_lock_error(self, exc: BaseException) -> bool:
        """A lock wait past ``lock_timeout``, a ``NOWAIT`` refusal, or a deadlock (InnoDB
        rolled the transaction back)."""
        return error_code(exc) in LOCK_ERRORS

    def _quoted_table(self) -> str:
        return quote_table(self.table)

    @property
    def wait_seconds(self) -> int:
        """``innodb_lock_wait_timeout`` of a claim (``lock_timeout`` in whole seconds)."""
        return lock_seconds(self.lock_timeout)

    def _row(self, key: str) -> str:
        """The row of a record key (as on PostgreSQL), at most :data:`MAX_KEY` characters."""
        return self._short(super()._row(key))

    def _lock_row(self, resource: str) -> str:
        """The row of a lock resource (as on PostgreSQL), at most :data:`MAX_KEY` characters."""
        return self._short(super()._lock_row(resource))

    @staticmethod
    def _short(row: str) -> str:
        if len(row) > MAX_KEY:
            raise ValueError(
                f"the MySQL backend keeps keys of at most {MAX_KEY} characters (the table's "
                f"primary key); this one has {len(row)}: {row[:80]}..."
            )
        return row

    # -- publish side -------------------------------------------------------------------------

    def _publish_statement(self, values: Mapping[str, Any]) -> list[Any]:
        """The publish check's steps (:attr:`Statements.publish` and the ``publish_*`` around
        it) in a transaction of their own, one flight; the decision's row, as the PostgreSQL
        backend's statement returns it. An insert that waited past ``lock_timeout`` (a key's
        first claim holds its new row) answers "running": publish unchecked."""
        key, tid = values["key"], values["tid"]
        # The lock wait is set after the SKIP LOCKED read: on MariaDB 10.11 a SKIP LOCKED
        # read that skipped a row under innodb_lock_wait_timeout = 0 made the transaction's
        # COMMIT fail ('Got error 1 "Operation not permitted" during COMMIT').
        statements = [
            (self.sql.publish_reset, ()),
            (self.sql.publish_seen, (key,)),
            (self.sql.publish_free, (key,)),
            (self.sql.wait, (self.wait_seconds,)),
            (self.sql.publish_decide, (tid,)),
            (self.sql.publish, (key, values["fp"], tid, values["now"], values["ttl"])),
            (self.sql.publish_result, (key, tid)),
            (self.sql.wait_reset, ()),
        ]
        try:
            results = self.autocommit(statements)
        except Exception as exc:
            if error_code(exc) in LOCK_ERRORS:
                return [("running", 0, None, None, None, None, None, None, None, None)]
            raise
        found: list[Any] = results[6]
        return found

    # -- lock provider ------------------------------------------------------------------------

    def _started_statement(self, values: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
        """The publish check of ``idempotency_publish_until="started"`` (the PostgreSQL
        statement's steps, one flight): (a live record, the queued slot's task id, its
        fingerprint, its seconds left). The upsert waits only for another publisher's or a
        starter's statement on the slot (at least 1 s); a deadlock between publishers (InnoDB
        rolled one back) is tried again."""
        key = values["key"]
        statements = [
            (self.sql.wait, (max(1, self.wait_seconds),)),
            (self.sql.started_rec, (key,)),
            (
                self.sql.started_put,
                (key, values["tid"], values["fp"], values["now"], values["ttl"]),
            ),
            (self.sql.started_seen, (key,)),
            (self.sql.wait_reset, ()),
        ]
        for attempt in range(3):
            try:
                rows = self.autocommit(statements)[3]
                break
            except Exception as exc:
                if error_code(exc) not in LOCK_ERRORS or attempt == 2:
                    raise
        completed, first, stored_fp, left = rows[0]
        return bool(completed), first, stored_fp, left

    def _create_markers(self) -> None:
        """Run the marker table's DDL (``CREATE TABLE IF NOT EXISTS`` is safe to race)."""
        statements = [(s, ()) for s in markers_ddl(self.table).split(";\n") if s.strip()]
        self.autocommit(statements)

    def _claim_statements(self, row: str, lock_only: bool) -> list[Statement]:
        return [
            (self.sql.wait, (self.wait_seconds,)),
            (self.sql.insert, (row,)),
            (self.sql.draw, ()),
            (self.sql.lock if lock_only else self.sql.claim, (row,)),
            (self.sql.token, ()),
            (self.sql.drop, ()),
            (self.sql.select, (row,)),
            (self.sql.wait_reset, ()),
            (self.sql.mark, ()),
        ]

    def _claim_result(
        self, tx: Transaction, results: Sequence[Any]
    ) -> tuple[int | None, Sequence[Any]]:
        claimed, token, found = results[3], results[4], results[6]
        return (int(token[0][0]) if claimed else None), found

    def _probe_statements(self, row: str) -> list[Statement]:
        return [(self.sql.probe, (row,))]

    # -- store ----------------------------------------------------------------------------------

    def _waiting(self, statement: Statement) -> list[Statement]:
        return [(self.sql.wait, (self.wait_seconds,)), statement, (self.sql.wait_reset, ())]

    def _upsert(self, row: str, record: IdempotencyRecord, ttl: float) -> Statement:
        values = (record.fencing_token, *record_columns(self.codec, row, record), ttl)
        return self.sql.upsert, (row, *values, *values)

    # -- atomic backend ---------------------------------------------------------------------------

    def _commit_statements(self, tx: Transaction, params: Sequence[Any]) -> list[Statement]:
        """The commit in one flight: the claim's savepoint released (an error when the body
        ended the transaction), the record written, the fence checked."""
        return [
            (self.sql.unmark, ()),
            (self.sql.commit, params),
            (self.sql.fenced, ()),
        ]

    def _commit_refusal(self, exc: BaseException) -> str | None:
        code = error_code(exc)
        if code == FENCED:
            return "fenced"
        if code == SAVEPOINT_GONE:
            return "ended"
        return None

    def _ended(self, tx: Transaction) -> bool | None:
        """Whether the body ended the guard's transaction (no I/O): the connection is up,
        but the server's last reply said no transaction is open (a COMMIT, ROLLBACK, or a
        statement that commits implicitly: DDL, LOCK TABLES, ...)."""
        conn = tx.conn
        if not getattr(conn, "open", False) or not socket_alive(getattr(conn, "_sock", None)):
            return None  # lost: not the body's doing
        return False if not in_transaction(conn) else None

    def cleanup(self, limit: int | None = None) -> int:
        """Delete at most ``limit`` (``cleanup_batch``) expired rows, oldest first, skipping
        rows a claim holds; returns how many were deleted. Uses the ``expires_at`` index."""
        n = self.cleanup_batch if limit is None else limit
        tx, results = self._begin("", [(self.sql.expired, (n,))])
        keys = [k for (k,) in results[0]]
        try:
            if keys:
                deleted = self._run(tx, self.sql.delete_keys(keys), commit=True)
                count = sum(int(n) for n in deleted)
            else:
                count = 0
        except BaseException:
            self._rollback(tx)
            raise
        if keys:
            self._finish(tx)
        else:
            self._rollback(tx)
        if self.markers_ready(create=False):
            count += int(self.autocommit([(self.sql.cleanup_markers, (n,))])[0])
        return count
