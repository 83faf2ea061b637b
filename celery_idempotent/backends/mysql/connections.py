"""The MySQL / MariaDB backend's connections and transactions (PyMySQL), below its steps.

:class:`PyMySQLTransactions` keeps a small pool of idle connections per process and sends
each step's statements in one flight: one ``COM_QUERY`` holding several statements
(``CLIENT_MULTI_STATEMENTS``), whose results come back in order. The server stops at the
first statement that fails, so a COMMIT sent after a failing statement never runs: the commit
of a lease that is no longer ours fails in the same flight (:attr:`~.sql.Statements.fenced`).

PyMySQL was chosen over mysqlclient: it is pure Python, so ``pip install
celery-idempotent[mysql]`` works on any machine (mysqlclient compiles against the MySQL or
MariaDB client headers), and its sockets are Python sockets, which gevent and eventlet
patch: a claim waiting for a key's holder yields to the hub instead of freezing a green
worker. The price is CPU per query, not round trips (the same flights either way).
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Sequence
from typing import Any
from urllib.parse import parse_qsl, unquote, urlsplit

from celery_idempotent.backends.mysql.sql import (
    LOCK_ERRORS,
    Statements,
    check_server,
    ddl,
    error_code,
)
from celery_idempotent.backends.sql.connections import ConnectionPool, Transaction
from celery_idempotent.core.exceptions import IdempotencyConnectionError

__all__ = [
    "KEEPALIVES",
    "PyMySQLTransactions",
    "connect_args",
    "guarded_connection_class",
    "import_pymysql",
    "in_transaction",
    "socket_alive",
]

log = logging.getLogger("celery_idempotent")

#: Client-side TCP keepalives of every connection (seconds): a worker notices a silent
#: server within about idle + interval * count. The server side, which holds the row lock,
#: has no per-session setting on MySQL: see the backend's documentation.
KEEPALIVES = {"idle": 10, "interval": 5, "count": 3}
IN_TRANS = 1  # SERVER_STATUS_IN_TRANS
AUTOCOMMIT = 2  # SERVER_STATUS_AUTOCOMMIT
#: ``COM_RESET_CONNECTION`` (MySQL 5.7+, MariaDB 10.2.4+): the session as it was at connect
#: time (session variables, user variables, temporary tables, user locks, prepared
#: statements), the connection kept. Sent after the guard's COMMIT or ROLLBACK on a connection
#: the body was handed, written right behind it: the same flight.
COM_RESET_CONNECTION = 0x1F
#: URL query parameters handed to PyMySQL (the backend's own, ``table`` and
#: ``lock_timeout``, are taken out before).
DRIVER_PARAMS = {
    "unix_socket": str,
    "charset": str,
    "connect_timeout": float,
    "read_timeout": float,
    "write_timeout": float,
    "ssl_ca": str,
    "ssl_cert": str,
    "ssl_key": str,
    "ssl_verify_cert": bool,
    "ssl_verify_identity": bool,
    "ssl_disabled": bool,
}


def import_pymysql() -> Any:
    try:
        import pymysql  # noqa: PLC0415 - optional dependency
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the MySQL backend needs PyMySQL: pip install 'celery-idempotent[mysql]'"
        ) from exc
    return pymysql


def connect_args(url: str) -> dict[str, Any]:
    """PyMySQL's ``connect()`` keywords for a ``mysql://user:password@host:port/database``
    URL; an unknown query parameter is an error that names it."""
    parts = urlsplit(url)
    if parts.scheme != "mysql":
        raise ValueError(f"a MySQL URL starts with mysql://, got {parts.scheme}://")
    database = unquote(parts.path.lstrip("/"))
    if not database:
        raise ValueError("a mysql:// URL must name the database: mysql://user@host:3306/<db>")
    args: dict[str, Any] = {
        "host": parts.hostname or "localhost",
        "port": parts.port or 3306,
        "user": unquote(parts.username) if parts.username else None,
        "password": unquote(parts.password) if parts.password else "",
        "database": database,
        "charset": "utf8mb4",
        "connect_timeout": 10,
    }
    for name, value in parse_qsl(parts.query, keep_blank_values=True):
        kind = DRIVER_PARAMS.get(name)
        if kind is None:
            known = ", ".join(["table", "lock_timeout", *DRIVER_PARAMS])
            raise ValueError(f"unknown mysql:// URL parameter {name!r} (known: {known})")
        if kind is bool:
            args[name] = value.lower() in ("1", "true", "yes", "on")
        elif kind is float:
            try:
                args[name] = float(value)
            except ValueError:
                raise ValueError(
                    f"mysql:// URL parameter {name} must be seconds, got {value!r}"
                ) from None
        else:
            args[name] = value
    return args


_GUARDED: Any = None


def guarded_connection_class() -> Any:
    """PyMySQL's ``Connection`` refusing ``commit()``, ``rollback()`` and ``begin()`` while a
    guarded body's transaction is open on it (as psycopg refuses them inside a
    ``transaction()`` block), so that a body cannot end the guard's transaction by mistake."""
    global _GUARDED  # noqa: PLW0603 - one class per process, made when PyMySQL is first needed
    if _GUARDED is None:
        pymysql = import_pymysql()

        class GuardedConnection(pymysql.connections.Connection):  # type: ignore[misc, name-defined]
            celery_idem_guarded = False

            def _refuse(self, what: str) -> None:
                if self.celery_idem_guarded:
                    raise pymysql.err.ProgrammingError(
                        f"{what}() inside a guarded body: the idempotency guard commits this "
                        "transaction together with the record (use SAVEPOINTs to undo part)"
                    )

            def commit(self) -> None:
                self._refuse("commit")
                super().commit()

            def rollback(self) -> None:
                self._refuse("rollback")
                super().rollback()

            def begin(self) -> None:
                self._refuse("begin")
                super().begin()

        _GUARDED = GuardedConnection
    return _GUARDED


def in_transaction(conn: Any) -> bool:
    """Whether the server said, in its last reply, that a transaction is open (no I/O)."""
    return bool(getattr(conn, "server_status", 0) & IN_TRANS)


def socket_alive(sock: Any) -> bool:
    """Whether ``sock`` has not been closed by its peer (a non-blocking peek, no I/O sent);
    safe from another thread while the body uses the connection (nothing is consumed)."""
    if sock is None:
        return False
    try:
        data = sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except (BlockingIOError, InterruptedError):
        return True
    except OSError:
        return False
    return bool(data != b"")


class PyMySQLTransactions(ConnectionPool):
    """Connections (a per-process pool of idle ones) and guarded transactions on PyMySQL.

    The same steps as :class:`~celery_idempotent.backends.postgres.connections.PsycopgTransactions`
    (``_begin``, ``_run``, ``_rollback``, ``_finish``, ``_alive``, ``autocommit``), each one
    flight; the MySQL backend's protocol methods are made of them.
    """

    sql: Statements

    # -- connections ------------------------------------------------------------------------

    def _connect(self) -> Any:
        pymysql = import_pymysql()
        args = connect_args(self.url or "")
        try:
            conn = pymysql.connect(
                **args,
                autocommit=True,
                client_flag=pymysql.constants.CLIENT.MULTI_STATEMENTS,
                program_name="celery-idempotent",
                defer_connect=False,
                cursorclass=pymysql.cursors.Cursor,
            )
        except pymysql.err.MySQLError as exc:
            raise ConnectionError(f"cannot connect to MySQL: {exc}") from exc
        sock = getattr(conn, "_sock", None)
        if sock is not None and sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            for option, value in (
                ("TCP_KEEPIDLE", KEEPALIVES["idle"]),
                ("TCP_KEEPINTVL", KEEPALIVES["interval"]),
                ("TCP_KEEPCNT", KEEPALIVES["count"]),
            ):
                if hasattr(socket, option):
                    sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)
        conn.__class__ = guarded_connection_class()
        return conn

    def _reusable(self, conn: Any) -> bool:
        return bool(
            conn.open
            and not in_transaction(conn)
            and getattr(conn, "server_status", 0) & AUTOCOMMIT
        )

    def _close(self, conn: Any) -> None:
        try:
            if conn.open:
                conn.close()
        except Exception:  # pragma: no cover - closing a broken connection
            log.debug("closing a MySQL connection failed", exc_info=True)

    def _ensure_table(self, conn: Any) -> None:
        # The first use of a backend: a server without SKIP LOCKED is refused here, by name,
        # rather than by a syntax error in the first claim (the version is the handshake's).
        refused = check_server(str(conn.get_server_info()))
        if refused is not None:
            raise IdempotencyConnectionError(None, refused)
        found = self._flight(conn, [(self.sql.exists, self.sql.exists_params)])[0]
        if not (found and found[0][0]):
            if not self.create_table:
                raise IdempotencyConnectionError(
                    None,
                    f"table {self.table} does not exist and create_table=False: run the "
                    "DDL of 'celery -A <app> idempotency sql --url mysql://...' first",
                )
            # CREATE TABLE IF NOT EXISTS is safe to race: the server serializes it on the
            # table's metadata lock, and the loser only gets a warning.
            statements = [(s, ()) for s in ddl(self.table).split(";\n") if s.strip()]
            self._send(conn, statements)
        self._ready = True

    # -- one flight -----------------------------------------------------------------------------

    @staticmethod
    def _flight(conn: Any, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Send ``statements`` as one multi-statement query and return each one's rows (or
        affected-row count). The server stops at the first that fails; its error is raised."""
        cur = conn.cursor()
        try:
            text = ";\n".join(cur.mogrify(sql, tuple(params) or None) for sql, params in statements)
            cur.execute(text)
            results = [cur.rowcount if cur.description is None else cur.fetchall()]
            while cur.nextset():
                results.append(cur.rowcount if cur.description is None else cur.fetchall())
        finally:
            cur.close()
        return results

    @staticmethod
    def _flight_and_reset(conn: Any, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """:meth:`_flight`, with ``COM_RESET_CONNECTION`` written right behind the query (one
        flight): whatever session state the body left (``SET SESSION``, user variables,
        temporary tables, ``GET_LOCK``) does not reach the next body on this connection.
        The reset runs whether a statement failed or not; its error closes the connection."""
        pymysql = import_pymysql()
        cur = conn.cursor()
        try:
            text = ";\n".join(cur.mogrify(sql, tuple(params) or None) for sql, params in statements)
        finally:
            cur.close()
        conn._execute_command(pymysql.constants.COMMAND.COM_QUERY, text)
        conn._execute_command(COM_RESET_CONNECTION, b"")
        conn._next_seq_id = 1
        results: list[Any] = []
        failed: BaseException | None = None
        try:
            while True:
                conn._read_query_result()
                found = conn._result
                results.append(found.affected_rows if found.description is None else found.rows)
                if not found.has_next:
                    break
        except pymysql.err.MySQLError as exc:  # the server ran no statement after it
            failed = exc
        try:
            conn._next_seq_id = 1
            packet = conn._read_packet()  # the reset's OK (an error packet raises)
            conn.server_status = pymysql.protocol.OKPacketWrapper(packet).server_status
            conn._result = None
        except Exception:
            log.debug("resetting a MySQL session failed; closing it", exc_info=True)
            conn.close()
            if failed is None:
                raise
        if failed is not None:
            raise failed
        return results

    def _send(self, conn: Any, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """:meth:`_flight` on a connection outside a transaction of the guard's; on error
        whatever it opened is rolled back, and a lost connection raised as
        ``ConnectionError`` (a lock wait that ran out, or a deadlock, is raised as it is)."""
        try:
            return self._flight(conn, statements)
        except BaseException as exc:
            self._end(conn, commit=False)
            if self._connection_lost(conn, exc):
                raise ConnectionError(f"MySQL: {exc}") from exc
            raise

    @staticmethod
    def _connection_lost(conn: Any, exc: BaseException) -> bool:
        """Whether ``exc`` lost the connection (not a lock wait, deadlock or SQL error)."""
        pymysql = import_pymysql()
        if not isinstance(exc, pymysql.err.MySQLError):
            return isinstance(exc, OSError)
        code = error_code(exc)
        if code in LOCK_ERRORS:
            return False
        return isinstance(exc, pymysql.err.InterfaceError) or not conn.open or (code or 0) >= 2000

    def _end(self, conn: Any, *, commit: bool, reset: bool = False) -> None:
        """End whatever is open (closing the connection when that fails), then pool it;
        ``reset``: the session too (the body was handed the connection)."""
        try:
            if conn.open:
                end = "COMMIT" if commit else "ROLLBACK"
                flight = self._flight_and_reset if reset else self._flight
                flight(conn, [(end, ()), (self.sql.wait_reset, ())])
        except Exception:
            log.debug("ending the transaction failed; closing the connection", exc_info=True)
            self._close(conn)
        self._put(conn)

    # -- the steps: begin, run, end -------------------------------------------------------------

    def _begin(
        self, key: str, statements: Sequence[tuple[str, Sequence[Any]]]
    ) -> tuple[Transaction, list[Any]]:
        """Open a READ COMMITTED transaction and run ``statements`` in it (one flight); on
        error it is rolled back and the error raised."""
        conn = self._get()
        opening = [(self.sql.isolation, ()), ("START TRANSACTION", ())]
        results = self._send(conn, [*opening, *statements])[len(opening) :]
        conn.celery_idem_guarded = True
        tx = Transaction(conn, True, key, None)
        tx.raw = conn
        tx.pid = conn.thread_id()
        return tx, results

    def _run(
        self, tx: Transaction, statements: Sequence[tuple[str, Sequence[Any]]], *, commit: bool
    ) -> list[Any]:
        """Run ``statements`` in ``tx`` (and COMMIT, when asked) in one flight."""
        conn = tx.conn
        if commit:
            conn.celery_idem_guarded = False
            if not in_transaction(conn):
                # The body ended the guard's transaction itself (a raw COMMIT or ROLLBACK):
                # whatever it committed is not this commit's to vouch for.
                raise RuntimeError("the guard's transaction was ended inside the body")
            statements = [*statements, ("COMMIT", ())]
        flight = self._flight_and_reset if commit and tx.lent else self._flight
        try:
            results = flight(conn, statements)
        except Exception as exc:
            if self._connection_lost(conn, exc):
                raise ConnectionError(f"MySQL: {exc}") from exc
            raise
        return results[: len(results) - 1] if commit else results

    def _rollback(self, tx: Transaction) -> None:
        tx.conn.celery_idem_guarded = False
        self._end(tx.conn, commit=False, reset=tx.lent)

    def _finish(self, tx: Transaction) -> None:
        self._put(tx.conn)

    def _alive(self, tx: Transaction) -> bool:
        conn = tx.conn
        return bool(conn.open) and in_transaction(conn) and socket_alive(conn._sock)

    def autocommit(self, statements: Sequence[tuple[str, Sequence[Any]]]) -> list[Any]:
        """Run ``statements`` in a READ COMMITTED transaction of their own and commit
        (one flight)."""
        conn = self._get()
        opening = [(self.sql.isolation, ()), ("START TRANSACTION", ())]
        results = self._send(conn, [*opening, *statements, ("COMMIT", ())])
        self._put(conn)
        return results[len(opening) : -1]

    def _connection_of(self, tx: Transaction) -> Any:
        return tx.conn
