"""MySQLBackend: the lock provider, store and atomic backend on one InnoDB table.

The protocol's steps are the PostgreSQL backend's (:class:`PostgresBackend` is the base
class: acquire, extend, release, get, claim, the lost-reply check, the sweep's schedule);
what differs is the SQL (:mod:`celery_idempotent.backends.mysql.sql`), the driver
(:mod:`celery_idempotent.backends.mysql.connections`) and the steps whose statements differ
in shape (claim, commit, delete, probe, sweep).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Sequence
from typing import Any

from celery_idempotent import transactions
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
    quote_table,
)
from celery_idempotent.backends.postgres.backend import PostgresBackend
from celery_idempotent.backends.postgres.connections import ended_by_body, split_url
from celery_idempotent.backends.postgres.sql import PUBLISH_PARAMS, decode_row, record_columns
from celery_idempotent.core.exceptions import IdempotencyKeyHeldError
from celery_idempotent.core.protocols import Claim, IdempotencyRecord, Lease
from celery_idempotent.core.validate import check_delay, check_duration, check_ttl

__all__ = ["MySQLBackend"]


class MySQLBackend(PyMySQLTransactions, PostgresBackend):  # type: ignore[misc]
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

    def __init__(
        self,
        url: str | None = None,
        *,
        table: str | None = None,
        lock_timeout: Any = None,
        serializer: str = "json",
        accept: Iterable[str] | None = ("json",),
        create_table: bool = True,
        cleanup_interval: Any = 60.0,
        cleanup_batch: int = 500,
        max_idle: int = 8,
    ) -> None:
        given = lock_timeout
        if given is None and url is not None:
            given = split_url(url)[1].get("lock_timeout")
        if isinstance(given, str):
            try:
                given = float(given)
            except ValueError:
                raise ValueError(f"lock_timeout must be seconds, got {given!r}") from None
        wait = check_delay("lock_timeout", 1.0 if given is None else given)
        PostgresBackend.__init__(
            self,
            url,
            table=table,
            lock_timeout=wait or 1.0,  # PostgreSQL's check refuses 0: set below
            serializer=serializer,
            accept=accept,
            create_table=create_table,
            cleanup_interval=cleanup_interval,
            cleanup_batch=cleanup_batch,
            max_idle=max_idle,
        )
        self.lock_timeout = wait
        self.sql = Statements(self.table)
        if self.driver == "pymysql":
            if url is None:
                raise ValueError("MySQLBackend needs a mysql:// URL")
            import_pymysql()  # fail now, with the install line, when PyMySQL is missing
            connect_args(split_url(url)[0])  # a bad URL fails here, naming what is wrong

    @property
    def wait_seconds(self) -> int:
        """``innodb_lock_wait_timeout`` of a claim (``lock_timeout`` in whole seconds)."""
        return lock_seconds(self.lock_timeout)

    def _row(self, key: str) -> str:  # type: ignore[override]
        """The row of a record key (as on PostgreSQL), at most :data:`MAX_KEY` characters."""
        return self._short(PostgresBackend._row(key))

    def _lock_row(self, resource: str) -> str:  # type: ignore[override]
        """The row of a lock resource (as on PostgreSQL), at most :data:`MAX_KEY` characters."""
        return self._short(PostgresBackend._lock_row(resource))

    @staticmethod
    def _short(row: str) -> str:
        if len(row) > MAX_KEY:
            raise ValueError(
                f"the MySQL backend keeps keys of at most {MAX_KEY} characters (the table's "
                f"primary key); this one has {len(row)}: {row[:80]}..."
            )
        return row

    # -- publish side -------------------------------------------------------------------------

    def _publish_statement(self, params: Sequence[Any]) -> list[Any]:
        """The publish check's steps (:attr:`Statements.publish` and the ``publish_*`` around
        it) in a transaction of their own, one flight; the decision's row, as the PostgreSQL
        backend's statement returns it. An insert that waited past ``lock_timeout`` (a key's
        first claim holds its new row) answers "running": publish unchecked."""
        values = dict(zip(PUBLISH_PARAMS, params))
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

    def _claim_statements(self, row: str, lock_only: bool) -> list[tuple[str, Sequence[Any]]]:
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

    def _claim(self, resource: str, row: str, lock_only: bool, ttl: float = 0.0) -> Claim:
        # ``ttl``: the lease's, for a claimed marker; MySQL has no publish-side marker row.
        try:
            tx, results = self._begin(row, self._claim_statements(row, lock_only))
        except Exception as exc:
            if error_code(exc) in LOCK_ERRORS:
                return Claim(None, None)  # held (or a deadlock, rolled back): one failed attempt
            raise
        claimed, token, found = results[3], results[4], results[6]
        if claimed:
            lease = Lease(resource, uuid.uuid4().hex, int(token[0][0]))
            tx.lease = lease
            self._open[lease.token] = tx
            transactions.register(lease.token, self._connection_of(tx))
            return Claim(lease, None)
        self._rollback(tx)
        if found:
            return Claim(None, decode_row(self.codec, row, found[0]))
        return Claim(None, None)  # pragma: no cover - the row is ours until we roll back

    def is_locked(self, resource: str) -> bool:
        """Whether a transaction holds ``resource``'s row (or is inserting it) now."""
        row = self._lock_row(resource)
        try:
            tx, _ = self._begin(row, [(self.sql.probe, (row,))])
        except Exception as exc:
            if error_code(exc) in LOCK_ERRORS:
                return True
            raise
        self._rollback(tx)
        return False

    def clear(self) -> None:
        """Roll back this process's open transactions and delete every row of the table."""
        for token in list(self._open):
            tx = self._open.get(token)
            if tx is not None and tx.lease is not None:
                self.release(tx.lease)
        self.autocommit([(f"DELETE FROM {quote_table(self.table)}", ())])

    # -- store ----------------------------------------------------------------------------------

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        """Store ``record`` for ``ttl`` seconds in a transaction of its own."""
        ttl = check_duration("ttl", ttl)
        values = (record.fencing_token, *record_columns(self.codec, key, record), ttl)
        self.autocommit([(self.sql.upsert, (self._row(key), *values, *values))])

    def delete(self, key: str) -> bool:
        """Delete ``key``'s completed record; ``True`` when there was one. A row that a
        running body's transaction holds is waited for at most ``lock_timeout``, then
        :class:`~celery_idempotent.IdempotencyKeyHeldError` (nothing deleted)."""
        try:
            done = self.autocommit(
                [
                    (self.sql.wait, (self.wait_seconds,)),
                    (self.sql.delete, (self._row(key),)),
                    (self.sql.wait_reset, ()),
                ]
            )
        except Exception as exc:
            if error_code(exc) in LOCK_ERRORS:
                raise IdempotencyKeyHeldError(
                    key, None, None, "a running body's transaction holds the key's row"
                ) from exc
            raise
        return bool(done[1])

    # -- atomic backend ---------------------------------------------------------------------------

    def commit(self, lease: Lease, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """Write the record into the lease's transaction and COMMIT it (with the body's
        writes), in one flight. ``False`` when the lease is no longer ours. A connection
        error raises ``ConnectionError`` (the outcome is open); called again after one, it
        answers from the database whether this lease's record was committed. ``ttl == 0``
        (``idempotency_ttl=0``): the row is written already expired, so nothing is kept."""
        ttl = check_ttl("ttl", ttl)
        row = self._row(key)
        tx = self._open.get(lease.token)
        if tx is None:
            pending = self._unconfirmed.pop(lease.token, None)
            if pending is None:
                return False
            try:
                return self._verify(lease, row, pending)
            except ConnectionError:
                self._unconfirmed[lease.token] = pending
                raise
        ended = self._ended(tx)
        if ended is not None:
            self.release(lease)
            raise ended_by_body(aborted=ended)
        if not self._alive(tx):
            self.release(lease)
            return False
        params = (*record_columns(self.codec, key, record), ttl, row, lease.fencing_token)
        tx.lent = transactions.lent(lease.token)
        statements = [
            (self.sql.unmark, ()),
            (self.sql.commit, params),
            (self.sql.fenced, ()),
        ]
        try:
            self._run(tx, statements, commit=True)
        except ConnectionError:
            self._forget(lease, tx)  # the verification runs on another connection
            self._unconfirmed[lease.token] = tx.pid
            raise
        except Exception as exc:
            self._forget(lease, tx)
            self._rollback(tx)
            if error_code(exc) == FENCED:
                return False  # the row is not this lease's: nothing committed
            if error_code(exc) == SAVEPOINT_GONE:
                raise ended_by_body(aborted=False) from exc
            raise
        self._forget(lease, tx)
        self._finish(tx)
        self._maybe_cleanup()
        return True

    def _ended(self, tx: Any) -> bool | None:  # type: ignore[override]
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
        return count
