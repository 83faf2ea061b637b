"""PostgreSQL backend: the key's lock is a row lock, its record commits in the body's transaction.

``idempotency_url = "postgresql://user@host:5432/db"`` (psycopg 3, ``pip install
celery-idempotent[postgres]``) or ``"django://<alias>"`` (Django's connection for that alias).
One delivery goes::

    BEGIN; lock the key's row (wait at most lock_timeout); fencing token = nextval(sequence)
        ├── a completed, unexpired record ──> ROLLBACK, replay it
        └── ours: the body runs on current_connection(), inside this transaction
              ├── raises / killed / connection lost ──> ROLLBACK (by us or by the server):
              │       the body's writes and the claim vanish together
              └── returns ──> UPDATE the row to 'completed' with the result; COMMIT:
                      the body's writes and the record become visible at once

The lease is the transaction itself: it ends when the transaction does, never by a timer, so
``lock_ttl`` and renewals have nothing to do here (``extend`` only checks the connection). A
worker that dies or is cut off has its transaction rolled back by the server: at once when the
socket closes (a SIGKILL, a crash), after the TCP keepalive probes (set on both ends of every
connection, see :data:`KEEPALIVES`) when the network goes silent.

Table (name configurable, created on first use unless ``create_table=False``; ``celery
idempotency sql`` prints the DDL): one row per key with its state, result, fingerprint,
fencing token and ``expires_at``. Fencing tokens come from one sequence: ``nextval`` is never
rolled back, and it is called only after the row lock is taken, so tokens strictly increase
across the successive holders of a key, also across rollbacks and record expiry.

Expired rows are replaced in place by the next claim of their key; the others are deleted by
a bounded sweep that runs at most once per ``cleanup_interval`` per process, after a commit:
``DELETE ... WHERE ctid = ANY(ARRAY(SELECT ctid ... WHERE expires_at < now() ORDER BY
expires_at LIMIT n FOR UPDATE SKIP LOCKED))``, which walks the ``expires_at`` index, touches
at most ``n`` rows and skips rows a claim holds: never a full-table scan on the hot path.

Round trips (psycopg pipeline mode): a first execution costs 1 to claim (BEGIN, lock, token and
record look-up in one flight) and 1 to commit (UPDATE and COMMIT in one flight): the same two a
plain ``BEGIN ... COMMIT`` transaction costs with psycopg, which sends BEGIN on its own. A
duplicate of a completed key costs 2 (claim, ROLLBACK).
"""

from __future__ import annotations

import logging
import os
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from celery_idempotent import _green, _txn
from celery_idempotent._validate import check_duration
from celery_idempotent.exceptions import (
    IdempotencyConnectionError,
    IdempotencyKeyHeldError,
)
from celery_idempotent.postgres_sql import (
    DEFAULT_TABLE,
    DIVISION_BY_ZERO,
    LOCK_NOT_AVAILABLE,
    RowCodec,
    Statements,
    check_table,
    ddl,
    is_pg_error,
    quote_table,
)
from celery_idempotent.protocols import Claim, IdempotencyRecord, Lease
from celery_idempotent.setting_checks import POSTGRES_SCHEMES
from celery_idempotent.urls import redact

__all__ = [
    "DEFAULT_TABLE",
    "KEEPALIVES",
    "POSTGRES_SCHEMES",
    "DjangoBackend",
    "PostgresBackend",
    "backend_from_url",
    "ddl",
]

log = logging.getLogger("celery_idempotent")

#: TCP keepalives set on every connection unless the URL sets them: libpq's on the client
#: side, and the server's own (``tcp_keepalives_*``, per session) so that the server, which
#: holds the row lock, notices a worker that went silent within about idle + interval * count
#: seconds (25 s) and rolls its transaction back.
KEEPALIVES = {"idle": 10, "interval": 5, "count": 3}


class _Rollback(Exception):
    """Passed to a transaction block's ``__exit__`` to make it roll back."""


class _Tx:
    """One open guarded transaction (a lease): its connection and how to end it."""

    __slots__ = ("block", "conn", "key", "lease", "pid", "raw")

    def __init__(self, conn: Any, block: Any, key: str, raw: Any) -> None:
        self.conn = conn
        self.block = block
        self.key = key
        self.lease: Lease | None = None
        self.raw = raw  # the psycopg connection (conn itself, or under Django's wrapper)
        self.pid: int | None = raw.info.backend_pid if raw is not None else None


def _hold(conn: Any, delta: int) -> None:
    """Count the guard's transaction in psycopg's own count of open transaction blocks, so
    that ``conn.commit()`` / ``conn.rollback()`` in the body raise ``ProgrammingError`` (as
    inside ``with conn.transaction():``) instead of ending the guard's transaction. Nested
    ``conn.transaction()`` blocks in the body become savepoints either way."""
    if hasattr(conn, "_num_transactions"):
        conn._num_transactions = max(0, conn._num_transactions + delta)


def _raw_alive(raw: Any) -> bool:
    """Whether a psycopg connection is still in its transaction, without a round trip.

    Called from the renewal thread while the body may be using the connection: when the body
    holds it (a query in flight), it is alive by definition; otherwise the socket is read for
    whatever the server sent unasked (a termination notice, EOF) and the status checked.
    """
    if raw is None or raw.closed or raw.broken:
        return False
    psycopg = _psycopg()
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


class PostgresBackend:
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
        options: dict[str, str] = {}
        if url is not None:
            url, options = _split_url(url)
        self.url = url
        self.table = check_table(
            table if table is not None else options.get("table", DEFAULT_TABLE)
        )
        timeout = lock_timeout if lock_timeout is not None else options.get("lock_timeout", 0.5)
        if isinstance(timeout, str):
            try:
                timeout = float(timeout)
            except ValueError:
                raise ValueError(f"lock_timeout must be seconds, got {timeout!r}") from None
        self.lock_timeout = check_duration("lock_timeout", timeout)
        self.cleanup_interval = check_duration("cleanup_interval", cleanup_interval)
        if not isinstance(cleanup_batch, int) or cleanup_batch < 1:
            raise ValueError(f"cleanup_batch must be a positive int, got {cleanup_batch!r}")
        if not isinstance(max_idle, int) or max_idle < 0:
            raise ValueError(f"max_idle must be an int >= 0, got {max_idle!r}")
        if not isinstance(create_table, bool):
            raise TypeError(f"create_table must be True or False, got {create_table!r}")
        self.cleanup_batch = cleanup_batch
        self.max_idle = max_idle
        self.create_table = create_table
        self._codec = RowCodec(serializer, accept)
        self.serializer = serializer
        self.accept = self._codec.accept
        self.sql = Statements(self.table)
        self._lock = threading.Lock()
        self._ddl_lock = threading.Lock()
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._ready = False
        self._next_cleanup = time.monotonic() + self.cleanup_interval * _jitter()
        self._open: dict[str, _Tx] = {}
        # lease token -> backend pid of a commit whose reply was lost
        self._unconfirmed: dict[str, int | None] = {}
        if self.driver == "psycopg":
            if url is None:
                raise ValueError("PostgresBackend needs a postgresql:// URL")
            _psycopg()  # fail now, with the install line, when psycopg is missing

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact(self.url or '')!r}, table={self.table!r})"

    # -- connections (psycopg) ----------------------------------------------------------------

    def _connect(self) -> Any:
        psycopg = _psycopg()
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

    def _get(self) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                # Connections made before a fork belong to the parent: never use or close
                # them here (psycopg itself does not end a connection of another process
                # when it is garbage collected: tests/postgres/test_postgres_backend.py).
                self._idle = []
                self._open = {}
                self._pid = os.getpid()
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        if not self._ready:
            with self._ddl_lock:
                if not self._ready:
                    try:
                        self._ensure_table(conn)
                    except BaseException:
                        conn.close()
                        raise
        return conn

    def _put(self, conn: Any) -> None:
        psycopg = _psycopg()
        usable = (
            not conn.closed
            and not conn.broken
            and conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            and self._pid == os.getpid()
        )
        if usable:
            with self._lock:
                if len(self._idle) < self.max_idle:
                    self._idle.append(conn)
                    return
        try:
            conn.close()
        except Exception:  # pragma: no cover - closing a broken connection
            log.debug("closing a PostgreSQL connection failed", exc_info=True)

    def close(self) -> None:
        """Close the idle connections (open transactions are left to their holders)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def _ensure_table(self, conn: Any) -> None:
        psycopg = _psycopg()
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
    # conn.rollback(), is kept by psycopg's own transaction counter (see _hold).

    def _begin(
        self, key: str, statements: Sequence[tuple[str, Sequence[Any]]]
    ) -> tuple[_Tx, list[Any]]:
        """Open a transaction and run ``statements`` in it (one flight); on error it is
        rolled back and the error raised."""
        psycopg = _psycopg()
        conn = self._get()
        try:
            results = self._flight(conn, [("BEGIN", ()), *statements])[1:]
        except BaseException as exc:
            self._end(conn, commit=False)
            if isinstance(exc, psycopg.OperationalError) and not is_pg_error(
                exc, LOCK_NOT_AVAILABLE
            ):
                raise ConnectionError(f"PostgreSQL: {exc}") from exc
            raise
        _hold(conn, 1)
        return _Tx(conn, True, key, conn), results

    @staticmethod
    def _flight(conn: Any, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Send ``statements`` in one pipeline and return each one's rows (or row count)."""
        cursors = []
        with conn.pipeline():
            for sql, params in statements:
                cur = conn.cursor()
                cur.execute(sql, params or None)
                cursors.append(cur)
        return [cur.rowcount if cur.description is None else cur.fetchall() for cur in cursors]

    def _end(self, conn: Any, *, commit: bool) -> None:
        """ROLLBACK whatever is open (closing the connection when that fails), then pool it."""
        psycopg = _psycopg()
        try:
            if (
                not conn.closed
                and not conn.broken
                and conn.info.transaction_status != psycopg.pq.TransactionStatus.IDLE
            ):
                conn.execute("COMMIT" if commit else "ROLLBACK")
        except Exception:
            log.debug("ending the transaction failed; closing the connection", exc_info=True)
            conn.close()
        self._put(conn)

    def _run(
        self, tx: _Tx, statements: Sequence[tuple[str, Sequence[Any]]], *, commit: bool
    ) -> list[Any]:
        """Run ``statements`` in ``tx`` (and COMMIT, when asked) in one flight."""
        psycopg = _psycopg()
        conn = tx.conn
        if commit:
            if tx.block:
                _hold(conn, -1)
                tx.block = False
            if conn.info.transaction_status != psycopg.pq.TransactionStatus.INTRANS:
                # The body ended the guard's transaction itself (a raw COMMIT or ROLLBACK):
                # whatever it committed is not this commit's to vouch for.
                raise RuntimeError("the guard's transaction was ended inside the body")
            statements = [*statements, ("COMMIT", ())]
        try:
            results = self._flight(conn, statements)
        except psycopg.Error as exc:
            if conn.broken or conn.closed:
                raise ConnectionError(f"PostgreSQL: {exc}") from exc
            raise
        return results[: len(results) - 1] if commit else results

    def _rollback(self, tx: _Tx) -> None:
        if tx.block:
            _hold(tx.conn, -1)
            tx.block = False
        self._end(tx.conn, commit=False)

    def _finish(self, tx: _Tx) -> None:
        self._put(tx.conn)

    def _alive(self, tx: _Tx) -> bool:
        return _raw_alive(tx.raw)

    def _autocommit(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run ``statements`` in a transaction of their own and commit (one flight)."""
        psycopg = _psycopg()
        conn = self._get()
        try:
            results = self._flight(conn, [("BEGIN", ()), *statements, ("COMMIT", ())])
        except BaseException as exc:
            self._end(conn, commit=False)
            if isinstance(exc, psycopg.OperationalError) and not is_pg_error(
                exc, LOCK_NOT_AVAILABLE
            ):
                raise ConnectionError(f"PostgreSQL: {exc}") from exc
            raise
        self._put(conn)
        return results[1:-1]

    def _connection_of(self, tx: _Tx) -> Any:
        return tx.conn

    # -- lock provider ------------------------------------------------------------------------

    def _row(self, name: str) -> str:
        """The row of a lock resource or record key: ``P lock:{K}`` and ``P{K}`` share one."""
        at = name.find("lock:{")
        return name[:at] + name[at + 5 :] if at >= 0 else name

    def _claim_statements(self, row: str, lock_only: bool) -> list[tuple[str, Sequence[Any]]]:
        ms = f"{max(1, round(self.lock_timeout * 1000))}ms"
        return [
            (self.sql.lock_timeout, (ms,)),
            (self.sql.insert, (row,)),
            (self.sql.lock if lock_only else self.sql.claim, (row,)),
            (self.sql.select, (row,)),
            (self.sql.lock_timeout_reset, ()),
        ]

    def _claim(self, resource: str, row: str, lock_only: bool) -> Claim:
        try:
            tx, results = self._begin(row, self._claim_statements(row, lock_only))
        except Exception as exc:
            if is_pg_error(exc, LOCK_NOT_AVAILABLE):
                return Claim(None, None)  # held: one failed attempt
            raise
        claimed, found = results[2], results[3]
        if claimed:
            lease = Lease(resource, uuid.uuid4().hex, int(claimed[0][0]))
            tx.lease = lease
            self._open[lease.token] = tx
            _txn.register(lease.token, self._connection_of(tx))
            return Claim(lease, None)
        self._rollback(tx)
        if found:
            return Claim(None, self._codec.decode(row, found[0]))
        return Claim(None, None)  # deleted meanwhile: try again

    def acquire(self, resource: str, ttl: float) -> Lease | None:
        """Lock ``resource``'s row in a new transaction (``ttl`` is checked, not used: the
        lease lasts as long as the transaction); ``None`` when held past ``lock_timeout``."""
        check_duration("ttl", ttl)
        return self._claim(resource, self._row(resource), lock_only=True).lease

    def extend(self, lease: Lease, ttl: float) -> bool:
        """``True`` while the lease's transaction is open on a healthy connection (no I/O)."""
        check_duration("ttl", ttl)
        tx = self._open.get(lease.token)
        return tx is not None and self._alive(tx)

    def release(self, lease: Lease) -> bool:
        """Roll back the lease's transaction (the body's writes with it)."""
        tx = self._open.pop(lease.token, None)
        if tx is None:
            return False
        _txn.unregister(lease.token)
        alive = self._alive(tx)
        self._rollback(tx)
        return alive

    def is_locked(self, resource: str) -> bool:
        """Whether a transaction holds ``resource``'s row (or is inserting it) now."""
        row = self._row(resource)
        statements = [
            (self.sql.lock_timeout, ("1ms",)),
            (self.sql.insert, (row,)),
            (self.sql.probe, (row,)),
        ]
        try:
            tx, _ = self._begin(row, statements)
        except Exception as exc:
            if is_pg_error(exc, LOCK_NOT_AVAILABLE):
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
        self._autocommit([(f"DELETE FROM {quote_table(self.table)}", ())])

    # -- store ----------------------------------------------------------------------------------

    def get(self, key: str) -> IdempotencyRecord | None:
        """The unexpired completed record of ``key`` (not waiting for a running holder)."""
        rows = self._autocommit([(self.sql.select, (self._row(key),))])[0]
        return self._codec.decode(key, rows[0]) if rows else None

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        """Store ``record`` for ``ttl`` seconds in a transaction of its own."""
        ttl = check_duration("ttl", ttl)
        ctype, encoding, data = self._codec.encode(key, record)
        params = (
            self._row(key),
            record.fencing_token,
            record.fingerprint,
            ctype,
            encoding,
            data,
            float(record.created_at),
            ttl,
        )
        self._autocommit([(self.sql.upsert, params)])

    def delete(self, key: str) -> bool:
        """Delete ``key``'s completed record; ``True`` when there was one. A row that a
        running body's transaction holds is waited for at most ``lock_timeout``, then
        :class:`~celery_idempotent.IdempotencyKeyHeldError` (nothing deleted)."""
        ms = f"{max(1, round(self.lock_timeout * 1000))}ms"
        try:
            done = self._autocommit(
                [(self.sql.lock_timeout, (ms,)), (self.sql.delete, (self._row(key),))]
            )
        except Exception as exc:
            if is_pg_error(exc, LOCK_NOT_AVAILABLE):
                raise IdempotencyKeyHeldError(
                    key, None, None, "a running body's transaction holds the key's row"
                ) from exc
            raise
        return bool(done[1])

    def atomic_with(self, lock_provider: Any) -> PostgresBackend | None:
        """Itself when ``lock_provider`` is this very backend: claim and commit in one step."""
        return self if lock_provider is self else None

    # -- atomic backend ---------------------------------------------------------------------------

    def claim(self, resource: str, key: str, ttl: float) -> Claim:
        """Lock ``key``'s row in a new transaction, unless it holds an unexpired record (then
        that record, no lease); ``Claim(None, None)`` when held past ``lock_timeout``."""
        check_duration("ttl", ttl)
        return self._claim(resource, self._row(key), lock_only=False)

    def commit(self, lease: Lease, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """Write the record into the lease's transaction and COMMIT it (with the body's
        writes). ``False`` when the lease is no longer ours. A connection error raises
        ``ConnectionError`` (the outcome is open); called again after one, it answers from
        the database whether this lease's record was committed."""
        ttl = check_duration("ttl", ttl)
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
        if not self._alive(tx):
            self.release(lease)
            return False
        ctype, encoding, data = self._codec.encode(key, record)
        params = (
            record.fingerprint,
            ctype,
            encoding,
            data,
            float(record.created_at),
            ttl,
            row,
            lease.fencing_token,
        )
        try:
            self._run(tx, [(self.sql.commit, params)], commit=True)
        except ConnectionError:
            self._forget(lease, tx)  # the verification runs on another connection
            self._unconfirmed[lease.token] = tx.pid
            raise
        except Exception as exc:
            self._forget(lease, tx)
            self._rollback(tx)
            if is_pg_error(exc, DIVISION_BY_ZERO):
                return False  # the row is not this lease's: nothing committed
            raise
        self._forget(lease, tx)
        self._finish(tx)
        self._maybe_cleanup()
        return True

    def _forget(self, lease: Lease, tx: _Tx) -> None:
        self._open.pop(lease.token, None)
        _txn.unregister(lease.token)

    def _verify(self, lease: Lease, row: str, pid: int | None) -> bool:
        """After a lost commit reply: the record is there with this lease's token (True),
        or the server has ended the session that sent the commit without it (False); while
        that session still exists the outcome is open (ConnectionError)."""
        rows, alive = self._autocommit([(self.sql.verify, (row,)), (self.sql.session, (pid,))])
        if rows and rows[0][0] == "completed" and rows[0][1] == lease.fencing_token:
            return True
        if alive and alive[0][0]:
            raise ConnectionError("the session that sent the commit is still open on the server")
        return False

    def _maybe_cleanup(self) -> None:
        now = time.monotonic()
        if now < self._next_cleanup:
            return
        self._next_cleanup = now + self.cleanup_interval * _jitter()
        try:
            self.cleanup()
        except Exception as exc:  # never fail a committed delivery over housekeeping
            log.warning(
                "celery-idempotent: sweeping expired rows of %s failed: %r", self.table, exc
            )

    def cleanup(self, limit: int | None = None) -> int:
        """Delete at most ``limit`` (``cleanup_batch``) expired rows, oldest first, skipping
        rows a claim holds; returns how many were deleted. Uses the ``expires_at`` index."""
        n = self.cleanup_batch if limit is None else limit
        return int(self._autocommit([(self.sql.cleanup, (n,))])[0])


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
    ) -> tuple[_Tx, list[Any]]:
        from django.db import transaction  # noqa: PLC0415

        conn = self._db()
        block = transaction.atomic(using=self.alias)
        block.__enter__()
        try:
            if not self._ready:
                self._django_ensure_table(conn)
            results = self._execute(conn, statements)
            return _Tx(conn, block, key, conn.connection), results
        except BaseException as exc:
            block.__exit__(type(exc), exc, exc.__traceback__)
            if is_pg_error(exc, LOCK_NOT_AVAILABLE):
                raise
            from django.db import InterfaceError, OperationalError  # noqa: PLC0415

            if isinstance(exc, (OperationalError, InterfaceError)):
                raise ConnectionError(f"PostgreSQL (django://{self.alias}): {exc}") from exc
            raise

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
        self, tx: _Tx, statements: Sequence[tuple[str, Sequence[Any]]], *, commit: bool
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

    def _rollback(self, tx: _Tx) -> None:
        error = _Rollback()
        try:
            tx.block.__exit__(_Rollback, error, None)
        except Exception:
            log.debug("rollback failed", exc_info=True)

    def _finish(self, tx: _Tx) -> None:
        return None

    def _alive(self, tx: _Tx) -> bool:
        conn = tx.conn
        if not conn.in_atomic_block or conn.needs_rollback or conn.connection is not tx.raw:
            return False
        return _raw_alive(tx.raw) if hasattr(tx.raw, "pgconn") else True

    def _autocommit(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        tx, results = self._begin("", statements)
        tx.block.__exit__(None, None, None)
        return results

    def _connection_of(self, tx: _Tx) -> Any:
        return tx.conn

    def close(self) -> None:
        """Nothing to close: Django owns its connections."""


# --------------------------------------------------------------------------- helpers


def _psycopg() -> Any:
    try:
        import psycopg  # noqa: PLC0415 - optional dependency
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the PostgreSQL backend needs psycopg 3: pip install 'celery-idempotent[postgres]'"
        ) from exc
    if _green.runtime() is not None:
        _cooperative_wait(psycopg)
    return psycopg


def _cooperative_wait(psycopg: Any) -> None:
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


def _jitter() -> float:
    import random  # noqa: PLC0415

    return 0.5 + random.random()  # noqa: S311 - spreads the sweeps of many processes


_OURS = ("table", "lock_timeout")


def _split_url(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without this backend's own query parameters, and those parameters."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in _OURS}
    rest = [(k, v) for k, v in query if k not in _OURS]
    return urlunsplit(parts._replace(query=urlencode(rest))), ours


def backend_from_url(
    url: str, *, serializer: str = "json", accept: Iterable[str] | None = ("json",)
) -> PostgresBackend:
    """The backend an ``idempotency_url`` of this module's schemes stands for."""
    if url.startswith("django://"):
        rest, options = _split_url(url)
        alias = urlsplit(rest).netloc or "default"
        return DjangoBackend(
            alias,
            table=options.get("table"),
            lock_timeout=options.get("lock_timeout"),
            serializer=serializer,
            accept=accept,
        )
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    return PostgresBackend(url, serializer=serializer, accept=accept)
