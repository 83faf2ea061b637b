"""PostgresBackend: the lock provider, store and atomic backend on one PostgreSQL table.

The steps of each protocol method are :class:`~celery_idempotent.backends.sql.backend.SQLBackend`'s
(shared with the MySQL backend); what is PostgreSQL's here is the order of
:mod:`celery_idempotent.backends.postgres.sql`'s statements in each step, how psycopg's errors
read (SQLSTATE codes) and the transactions of
:class:`~celery_idempotent.backends.postgres.connections.PsycopgTransactions`. How one delivery
goes is in :mod:`celery_idempotent.backends.postgres`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from celery_idempotent.backends.postgres.connections import (
    PsycopgTransactions,
    Transaction,
    import_psycopg,
)
from celery_idempotent.backends.postgres.sql import (
    DIVISION_BY_ZERO,
    ENDED_MARK,
    INVALID_TEXT_REPRESENTATION,
    LOCK_NOT_AVAILABLE,
    PUBLISH_PARAMS,
    STARTED_PARAMS,
    Statements,
    is_pg_error,
    quote_table,
    record_columns,
)
from celery_idempotent.backends.sql.backend import SQLBackend, Statement, statements_of
from celery_idempotent.core.protocols import IdempotencyRecord

__all__ = ["PostgresBackend"]


class PostgresBackend(SQLBackend, PsycopgTransactions):
    """Locks and records in one PostgreSQL table; the record commits in the body's transaction.

    It is at once the guard's ``lock_provider``, its ``store`` and (``atomic_with``) the
    backend that claims and commits in one step: pass the same instance as both::

        backend = PostgresBackend("postgresql://app@db/app")
        guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)

        def body():
            current_connection().execute("INSERT INTO payments ...")   # commits with the record

    ``url`` is a libpq URL (its query may carry libpq parameters; ``table`` and
    ``lock_timeout`` are read from it too, as defaults of the keywords). ``table`` names the
    table (``schema.table`` allowed). A claim waits at most ``lock_timeout`` seconds for a
    key's current holder, then counts as one failed lock attempt: the guard backs off and
    tries again, as with Redis. ``serializer`` and ``accept`` are kombu serializer names, as
    for :class:`~celery_idempotent.RedisIdempotencyStore` (pickle is loaded only when
    accepted). ``create_table=False`` never runs DDL (see :func:`ddl`). ``cleanup_interval``
    seconds at least between two bounded sweeps of at most ``cleanup_batch`` expired rows.
    ``max_idle`` connections are kept open for reuse per process.
    """

    driver = "psycopg"
    #: The SQL dialect (the CLI picks its admin module by it).
    dialect = "postgresql"

    def _statements(self, table: str) -> Statements:
        return Statements(table)

    def _check_driver(self, url: str | None) -> None:
        if self.driver == "psycopg":
            if url is None:
                raise ValueError("PostgresBackend needs a postgresql:// URL")
            import_psycopg()  # fail now, with the install line, when psycopg is missing

    def _is_lock_error(self, exc: BaseException) -> bool:
        return is_pg_error(exc, LOCK_NOT_AVAILABLE)

    @property
    def _wait(self) -> str:
        """``lock_timeout`` as PostgreSQL's setting (whole milliseconds, at least 1)."""
        return f"{max(1, round(self.lock_timeout * 1000))}ms"

    def _quoted_table(self) -> str:
        return quote_table(self.table)

    # -- lock provider ------------------------------------------------------------------------

    def _claim_statements(self, row: str, lock_only: bool) -> list[Statement]:
        return [
            (self.sql.lock_timeout, (self._wait,)),
            (self.sql.insert, (row,)),
            (self.sql.lock if lock_only else self.sql.claim, (row,)),
            (self.sql.select, (row,)),
            (self.sql.lock_timeout_reset, ()),
        ]

    def _claim_begin(
        self, row: str, statements: Sequence[Statement], lock_only: bool, ttl: float = 0.0
    ) -> tuple[Transaction, list[Any]]:
        if lock_only or not self.checks_publishes():
            return self._begin(row, statements)
        # The key's queued marker becomes "claimed" for the lease's ttl, committed first
        # (same flight): if this delivery's transaction dies, the row is left claimed and
        # unlocked, which holds the key until that ttl has run out (SPEC §8: a killed body
        # frees its key within lock_ttl) and no longer.
        marker = [(self.sql.claim_marker, (ttl, row))]
        return self._begin_after(marker, row, statements)

    def _claim_result(
        self, tx: Transaction, results: Sequence[Any]
    ) -> tuple[int | None, Sequence[Any]]:
        claimed, found = results[2], results[3]
        if not claimed:
            return None, found
        tx.xid = int(claimed[0][1])
        return int(claimed[0][0]), found

    def _probe_statements(self, row: str) -> list[Statement]:
        return [
            (self.sql.lock_timeout, ("1ms",)),
            (self.sql.insert, (row,)),
            (self.sql.probe, (row,)),
        ]

    def _probe_held(self, results: Sequence[Any]) -> bool:
        probed = results[2]  # the probe's row: a claimed marker within its lease?
        return bool(probed and probed[0][0])

    # -- store ----------------------------------------------------------------------------------

    def _waiting(self, statement: Statement) -> list[Statement]:
        return [(self.sql.lock_timeout, (self._wait,)), statement]

    def _upsert(self, row: str, record: IdempotencyRecord, ttl: float) -> Statement:
        columns = record_columns(self.codec, row, record)
        return self.sql.upsert, (row, record.fencing_token, *columns, ttl)

    # -- publish side (ChecksPublishes) --------------------------------------------------------

    def _publish_params(self, values: Mapping[str, Any], sync: str | None) -> tuple[Any, ...]:
        """:attr:`Statements.publish`'s parameters: ``values`` with the lock wait and
        ``synchronous_commit`` (``None``: the session's own)."""
        every = {**values, "wait": self._wait, "sync": sync}
        return tuple(every[name] for name in PUBLISH_PARAMS)

    def _publish_statement(self, values: Mapping[str, Any]) -> list[Any]:
        """The statement in a transaction of its own (one flight), committed without waiting
        for the WAL flush (see :attr:`Statements.publish`)."""
        params = self._publish_params(values, sync="off")
        result: list[Any] = self.autocommit([(self.sql.publish, params)])[0]
        return result

    def _started_statement(self, values: Mapping[str, Any]) -> tuple[Any, Any, Any, Any]:
        """:attr:`Statements.publish_started` in a transaction of its own (committed without
        waiting for the WAL flush): (a live record, the queued slot's task id, its
        fingerprint, its seconds left)."""
        every = {**values, "sync": "off"}
        params = tuple(every[name] for name in STARTED_PARAMS)
        rows = self.autocommit([(self.sql.publish_started, params)])[0]
        completed, first, stored_fp, left = rows[0]
        return bool(completed), first, stored_fp, left

    def _create_markers(self) -> None:
        """Run the marker table's DDL (under the advisory lock of the table's DDL)."""
        from celery_idempotent.backends.postgres.sql import markers_ddl  # noqa: PLC0415

        statements: list[Statement] = [(self.sql.ddl_lock, ("celery_idempotent:" + self.table,))]
        statements += [(each, ()) for each in statements_of(markers_ddl(self.table))]
        self.autocommit(statements)

    # -- atomic backend ---------------------------------------------------------------------------

    def _commit_statements(self, tx: Transaction, params: Sequence[Any]) -> list[Statement]:
        return [(self.sql.same_transaction, (tx.xid,)), (self.sql.commit, params)]

    def _commit_refusal(self, exc: BaseException) -> str | None:
        if is_pg_error(exc, DIVISION_BY_ZERO):
            return "fenced"
        if is_pg_error(exc, INVALID_TEXT_REPRESENTATION) and ENDED_MARK in str(exc):
            return "ended"
        return None

    def _ended(self, tx: Transaction) -> bool | None:
        """Whether the body left the guard's transaction (no I/O): ``None`` while it is still
        in it (or the connection is lost: not the body's doing), ``False`` when the session is
        idle (the body sent COMMIT or ROLLBACK), ``True`` when a failed statement aborted it."""
        raw = tx.raw
        if raw is None or not hasattr(raw, "pgconn") or raw.closed or raw.broken:
            return None
        status = raw.info.transaction_status
        psycopg = import_psycopg()
        if status == psycopg.pq.TransactionStatus.IDLE:
            return False
        if status == psycopg.pq.TransactionStatus.INERROR:
            return True
        return None

    def cleanup(self, limit: int | None = None) -> int:
        """Delete at most ``limit`` (``cleanup_batch``) expired rows, oldest first, skipping
        rows a claim holds; returns how many were deleted. Uses the ``expires_at`` index."""
        n = self.cleanup_batch if limit is None else limit
        statements: list[Statement] = [(self.sql.cleanup, (n,))]
        if self.markers_ready(create=False):
            statements.append((self.sql.cleanup_markers, (n,)))
        return sum(int(each) for each in self.autocommit(statements))
