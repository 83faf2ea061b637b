"""The PostgreSQL backend's connections and transactions (psycopg 3), below its protocol steps.

:class:`PsycopgTransactions` keeps a small pool of idle connections per process, opens a
guarded transaction with its first statements in one flight, runs more in it and ends it
(COMMIT in the same flight as the last statements, or ROLLBACK); :class:`Transaction` is one
open guarded transaction.
:class:`~celery_idempotent.backends.postgres.backend.PostgresBackend` builds the lock provider
and store on these steps; ``DjangoBackend`` replaces them with Django's connection and
``transaction.atomic``. psycopg is imported on first use only (:func:`import_psycopg`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from celery_idempotent.backends.postgres.sql import LOCK_NOT_AVAILABLE, Statements, ddl, is_pg_error
from celery_idempotent.backends.sql.connections import (
    ConnectionPool,
    Rollback,
    Transaction,
    ended_by_body,
    split_url,
)
from celery_idempotent.core import green
from celery_idempotent.core.exceptions import IdempotencyConnectionError

__all__ = [
    "KEEPALIVES",
    "SESSION_RESET",
    "PsycopgTransactions",
    "Rollback",
    "Transaction",
    "ended_by_body",
    "hold",
    "import_psycopg",
    "raw_alive",
    "split_url",
]

log = logging.getLogger("celery_idempotent")

#: TCP keepalives set on every connection unless the URL sets them: libpq's on the client
#: side, and the server's own (``tcp_keepalives_*``, per session) so that the server, which
#: holds the row lock, notices a worker that went silent within about idle + interval * count
#: seconds (25 s) and rolls its transaction back.
KEEPALIVES = {"idle": 10, "interval": 5, "count": 3}


#: Sent after the guard's COMMIT or ROLLBACK, in the same flight, on a connection the body was
#: handed: the session as it came out of the pool (settings and ``SET ROLE`` / ``SESSION
#: AUTHORIZATION`` reset to the connection's own, temporary tables dropped, session advisory
#: locks released, prepared statements and ``WITH HOLD`` cursors closed, ``LISTEN`` undone).
#: Settings given at connection time (the URL's ``options``, the keepalives) are what ``RESET``
#: returns to, so they stay.
SESSION_RESET = "DISCARD ALL"


def hold(conn: Any, delta: int) -> None:
    """Count the guard's transaction in psycopg's own count of open transaction blocks, so
    that ``conn.commit()`` / ``conn.rollback()`` in the body raise ``ProgrammingError`` (as
    inside ``with conn.transaction():``) instead of ending the guard's transaction. Nested
    ``conn.transaction()`` blocks in the body become savepoints either way."""
    if hasattr(conn, "_num_transactions"):
        conn._num_transactions = max(0, conn._num_transactions + delta)


def raw_alive(raw: Any) -> bool:
    """Whether a psycopg connection is still in its transaction, without a round trip.

    Called from the renewal thread while the body may be using the connection: when the body
    holds it (a query in flight), it is alive by definition; otherwise the socket is read for
    whatever the server sent unasked (a termination notice, EOF) and the status checked.
    """
    if raw is None or raw.closed or raw.broken:
        return False
    psycopg = import_psycopg()
    if not raw.lock.acquire(blocking=False):
        return True
    try:
        raw.pgconn.consume_input()
        return bool(
            raw.pgconn.status == psycopg.pq.ConnStatus.OK
            and raw.info.transaction_status
            in (psycopg.pq.TransactionStatus.INTRANS, psycopg.pq.TransactionStatus.ACTIVE)
        )
    except Exception:
        return False
    finally:
        raw.lock.release()


class PsycopgTransactions(ConnectionPool):
    """Connections (a per-process pool of idle ones) and guarded transactions on psycopg.

    The steps a backend's protocol methods are made of: :meth:`_begin` a transaction with its
    first statements, :meth:`_run` more in it (and COMMIT), :meth:`_rollback` or
    :meth:`_finish` it, :meth:`_alive` (is it still open), :meth:`autocommit` (statements in a
    transaction of their own). A subclass on another driver (``DjangoBackend``) replaces them.
    """

    sql: Statements

    # -- connections (psycopg) ----------------------------------------------------------------

    def _connect(self) -> Any:
        psycopg = import_psycopg()
        kwargs: dict[str, Any] = {"autocommit": True}
        given = psycopg.conninfo.conninfo_to_dict(self.url)
        kwargs.setdefault("connect_timeout", 10)
        if "keepalives" not in given:
            kwargs["keepalives"] = 1
            kwargs["keepalives_idle"] = KEEPALIVES["idle"]
            kwargs["keepalives_interval"] = KEEPALIVES["interval"]
            kwargs["keepalives_count"] = KEEPALIVES["count"]
            server = " ".join(f"-c tcp_keepalives_{k}={v}" for k, v in KEEPALIVES.items())
            kwargs["options"] = f"{given.get('options', '')} {server}".strip()
        kwargs.setdefault("application_name", given.get("application_name", "celery-idempotent"))
        # No server-side prepared statements: psycopg prepares a statement at its fifth use,
        # and when that use is in a pipeline that aborts (a claim that waited past
        # lock_timeout), it still counts the statement as prepared, so every later claim on
        # the connection failed with 'prepared statement "_pg3_N" does not exist'. Round
        # trips are unchanged (each flight is one pipeline either way).
        kwargs["prepare_threshold"] = None
        try:
            return psycopg.connect(self.url, **kwargs)
        except psycopg.OperationalError as exc:
            raise ConnectionError(f"cannot connect to PostgreSQL: {exc}") from exc

    def _reusable(self, conn: Any) -> bool:
        psycopg = import_psycopg()
        return bool(
            not conn.closed
            and not conn.broken
            and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
        )

    def _close(self, conn: Any) -> None:
        try:
            conn.close()
        except Exception:  # pragma: no cover - closing a broken connection
            log.debug("closing a PostgreSQL connection failed", exc_info=True)

    def _ensure_table(self, conn: Any) -> None:
        psycopg = import_psycopg()
        with conn.cursor() as cur:
            cur.execute(self.sql.exists, self.sql.exists_params)
            row = cur.fetchone()
            if not (row and row[0]):
                if not self.create_table:
                    raise IdempotencyConnectionError(
                        None,
                        f"table {self.table} does not exist and create_table=False: run the "
                        "DDL of 'celery -A <app> idempotency sql' first",
                    )
                # Two processes creating the table at once would collide in pg_type; and
                # CREATE INDEX IF NOT EXISTS locks the table even when the index exists, which
                # would wait behind running claims: look again under the lock first.
                with conn.transaction():
                    cur.execute(self.sql.ddl_lock, ("celery_idempotent:" + self.table,))
                    cur.execute(self.sql.exists, self.sql.exists_params)
                    again = cur.fetchone()
                    if not (again and again[0]):
                        cur.execute(ddl(self.table))
        del psycopg
        self._ready = True

    # -- the driver: begin, run, end ------------------------------------------------------------

    # BEGIN, COMMIT and ROLLBACK are sent as statements, inside the pipeline with the claim or
    # the commit: one flight each. (psycopg's Transaction block syncs the pipeline when it
    # opens and when it closes, which costs two more round trips.) What the block would add,
    # that the body cannot commit or roll back the guard's transaction with conn.commit() /
    # conn.rollback(), is kept by psycopg's own transaction counter (see hold).

    def _begin(
        self, key: str, statements: Sequence[tuple[str, Sequence[Any]]]
    ) -> tuple[Transaction, list[Any]]:
        """Open a transaction and run ``statements`` in it (one flight); on error it is
        rolled back and the error raised."""
        conn = self._get()
        results = self._send(conn, [("BEGIN", ()), *statements])[1:]
        hold(conn, 1)
        return Transaction(conn, True, key, conn), results

    def _begin_after(
        self,
        before: Sequence[tuple[str, Sequence[Any]]],
        key: str,
        statements: Sequence[tuple[str, Sequence[Any]]],
    ) -> tuple[Transaction, list[Any]]:
        """:meth:`_begin`, with ``before`` run first in a transaction of their own, committed
        without waiting for the WAL flush, all in the same flight (one round trip)."""
        conn = self._get()
        first = [("BEGIN", ()), ("SET LOCAL synchronous_commit TO OFF", ()), *before]
        sent = [*first, ("COMMIT", ()), ("BEGIN", ()), *statements]
        results = self._send(conn, sent)[len(first) + 2 :]
        hold(conn, 1)
        return Transaction(conn, True, key, conn), results

    def _send(self, conn: Any, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """:meth:`_flight` on a connection outside a transaction of the guard's; on error
        whatever it opened is rolled back, and a lost connection raised as
        ``ConnectionError`` (a lock that waited past ``lock_timeout`` is raised as it is)."""
        psycopg = import_psycopg()
        try:
            return self._flight(conn, statements)
        except BaseException as exc:
            self._end(conn, commit=False)
            if isinstance(exc, psycopg.OperationalError) and not is_pg_error(
                exc, LOCK_NOT_AVAILABLE
            ):
                raise ConnectionError(f"PostgreSQL: {exc}") from exc
            raise

    @staticmethod
    def _flight(
        conn: Any,
        statements: Sequence[tuple[str, Sequence[Any]]],
        cursors: list[Any] | None = None,
    ) -> list[Any]:
        """Send ``statements`` in one pipeline and return each one's rows (or row count).
        ``cursors``, when given, receives each statement's cursor as it is sent (after an
        error, those before it carry their ``statusmessage``)."""
        sent = [] if cursors is None else cursors
        with conn.pipeline():
            for sql, params in statements:
                cur = conn.cursor()
                sent.append(cur)
                cur.execute(sql, params or None)
        return [cur.rowcount if cur.description is None else cur.fetchall() for cur in sent]

    def _end(self, conn: Any, *, commit: bool, reset: bool = False) -> None:
        """ROLLBACK whatever is open (and, with ``reset``, :data:`SESSION_RESET`: one flight;
        closing the connection when either fails), then pool it."""
        psycopg = import_psycopg()
        try:
            if not conn.closed and not conn.broken:
                statements = []
                if conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE:
                    statements.append(("COMMIT" if commit else "ROLLBACK", ()))
                if reset:
                    statements.append((SESSION_RESET, ()))
                if statements:
                    self._flight(conn, statements)
        except Exception:
            log.debug("ending the transaction failed; closing the connection", exc_info=True)
            conn.close()
        self._put(conn)

    def _run(
        self, tx: Transaction, statements: Sequence[tuple[str, Sequence[Any]]], *, commit: bool
    ) -> list[Any]:
        """Run ``statements`` in ``tx`` (and COMMIT, when asked, then :data:`SESSION_RESET`
        when the body was handed the connection) in one flight."""
        psycopg = import_psycopg()
        conn = tx.conn
        tail: list[tuple[str, Sequence[Any]]] = []
        if commit:
            if tx.block:
                hold(conn, -1)
                tx.block = False
            status = conn.info.transaction_status
            if status != psycopg.pq.TransactionStatus.INTRANS:
                raise ended_by_body(status == psycopg.pq.TransactionStatus.INERROR)
            tail.append(("COMMIT", ()))
            if tx.lent:
                tail.append((SESSION_RESET, ()))
        cursors: list[Any] = []
        try:
            results = self._flight(conn, [*statements, *tail], cursors)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise ConnectionError(f"PostgreSQL: {exc}") from exc
            if (
                len(tail) == 2
                and len(cursors) == len(statements) + 2
                and cursors[-2].statusmessage == "COMMIT"
            ):
                # Committed; only the reset failed: the record stands, and the session is
                # not one to pool again.
                log.warning("resetting a PostgreSQL session failed (%s); closing it", exc)
                conn.close()
                return [
                    cur.rowcount if cur.description is None else cur.fetchall()
                    for cur in cursors[: len(statements)]
                ]
            raise
        return results[: len(statements)]

    def _rollback(self, tx: Transaction) -> None:
        if tx.block:
            hold(tx.conn, -1)
            tx.block = False
        self._end(tx.conn, commit=False, reset=tx.lent)

    def _finish(self, tx: Transaction) -> None:
        self._put(tx.conn)

    def _alive(self, tx: Transaction) -> bool:
        return raw_alive(tx.raw)

    def autocommit(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run ``statements`` in a transaction of their own and commit (one flight)."""
        conn = self._get()
        results = self._send(conn, [("BEGIN", ()), *statements, ("COMMIT", ())])
        self._put(conn)
        return results[1:-1]

    def _connection_of(self, tx: Transaction) -> Any:
        return tx.conn


def import_psycopg() -> Any:
    try:
        import psycopg  # noqa: PLC0415 - optional dependency
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the PostgreSQL backend needs psycopg 3: pip install 'celery-idempotent[postgres]'"
        ) from exc
    if green.runtime() is not None:
        cooperative_wait(psycopg)
    return psycopg


def cooperative_wait(psycopg: Any) -> None:
    """Make psycopg wait for the server through the green hub, not in a C ``poll``.

    psycopg picks its wait function when it is imported: a C ``poll`` (``wait_c``) unless
    gevent has patched ``select``. Eventlet is not detected (and gevent is not when psycopg
    was imported before patching), so every query, and a claim that waits up to
    ``lock_timeout`` for a key's holder, froze the whole event loop: under ``-P eventlet``
    the holder's body could not even run to end its transaction while the duplicate waited.
    ``wait_select`` calls ``select.select``, which both libraries patch to yield to the hub
    (their ``select`` has no ``FD_SETSIZE`` limit). Connection set-up (``wait_conn``) uses
    ``selectors.DefaultSelector``, which they patch too.
    """
    waiting = psycopg.waiting
    native = getattr(waiting, "wait_c", None)
    if native is not None and waiting.wait is native:
        waiting.wait = waiting.wait_select
