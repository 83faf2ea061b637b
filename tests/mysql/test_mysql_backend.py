"""What the MySQL backend adds to the shared contracts: its own configuration, the session
each body gets, and the guards around the body's connection."""

from __future__ import annotations

from typing import Any

import pymysql
import pytest
from mysql_support import query

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyError,
    LockLostError,
    MySQLBackend,
    current_connection,
)


def make_guard(backend: MySQLBackend, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("retry_base_delay", 0.01)
    return DistributedIdempotencyGuard(store=backend, lock_provider=backend, **options)


def _one(conn: Any, sql: str) -> Any:
    with conn.cursor() as cur:
        cur.execute(sql)
        row = cur.fetchone()
    return None if row is None else row[0]


def _temporary_table_left(conn: Any) -> int:
    try:
        _one(conn, "SELECT COUNT(*) FROM scratch")
    except pymysql.err.ProgrammingError as exc:  # 1146: no such table in this session
        return 0 if exc.args[0] == 1146 else -1
    return 1


def test_the_next_body_gets_the_session_as_it_came_out(mysql_url: str, my_table: str) -> None:
    backend = MySQLBackend(mysql_url, table=my_table, max_idle=1)  # the same session again
    guard = make_guard(backend)
    seen: list[tuple[Any, ...]] = []

    def dirty() -> str:
        conn = current_connection()
        for sql in (
            "SET SESSION lock_wait_timeout = 7",
            "SET SESSION sql_mode = ''",
            "SET @mine = 42",
            "CREATE TEMPORARY TABLE scratch (x INT)",
            "SET SESSION TRANSACTION ISOLATION LEVEL SERIALIZABLE",
        ):
            with conn.cursor() as cur:
                cur.execute(sql)
        return "dirty"

    def look() -> str:
        conn = current_connection()
        seen.append(
            (
                _one(conn, "SELECT CONNECTION_ID()"),
                _one(conn, "SELECT @@SESSION.lock_wait_timeout = @@GLOBAL.lock_wait_timeout"),
                "STRICT_TRANS_TABLES" in _one(conn, "SELECT @@SESSION.sql_mode"),
                _one(conn, "SELECT @mine"),
                _temporary_table_left(conn),
                _one(conn, "SELECT @@SESSION.tx_isolation"),
            )
        )
        return "clean"

    pooled = backend._get()  # the one connection the bodies get (max_idle=1)
    first = _one(pooled, "SELECT CONNECTION_ID()")
    backend._put(pooled)
    assert guard.execute("a", dirty) == "dirty"
    assert guard.execute("b", look) == "clean"
    with pytest.raises(RuntimeError):  # a body that raises: rolled back, reset too
        guard.execute("c", lambda: (dirty(), (_ for _ in ()).throw(RuntimeError()))[0])
    assert guard.execute("d", look) == "clean"
    global_level = query(mysql_url, "SELECT @@GLOBAL.tx_isolation")[0][0]
    for ident, max_time, strict, mine, temps, level in seen:
        assert ident == first  # the same connection, reset, not a new one
        assert (max_time, strict, mine, temps) == (1, True, None, 0)
        assert level in ("READ-COMMITTED", global_level)  # the guard's, per transaction
    backend.close()


def test_the_body_cannot_commit_the_guards_transaction(my_backend: MySQLBackend) -> None:
    guard = make_guard(my_backend)

    def body() -> str:
        conn = current_connection()
        for call in (conn.commit, conn.rollback, conn.begin):
            with pytest.raises(pymysql.err.ProgrammingError, match="inside a guarded body"):
                call()
        return "ok"

    assert guard.execute("k", body) == "ok"
    assert my_backend.get(guard.record_key("k")) is not None


def test_ddl_in_the_body_commits_implicitly_and_the_commit_is_refused(
    my_backend: MySQLBackend, my_table: str
) -> None:
    guard = make_guard(my_backend)

    def body() -> str:
        with current_connection().cursor() as cur:
            cur.execute(f"CREATE TABLE `{my_table}_payments` (k INT)")
        return "made"

    with pytest.raises(LockLostError, match="ended the guard's transaction itself"):
        guard.execute("k", body)
    assert guard.execute("k", lambda: "again") == "again"


def test_the_guards_transaction_is_read_committed_whatever_the_session(
    mysql_url: str, my_table: str
) -> None:
    """The body reads twice; between its reads another session commits a row. At READ
    COMMITTED the second read sees it; at the session's REPEATABLE READ (set here on the
    pooled connection, and InnoDB's default) it would not: the first read fixes a snapshot."""
    payments = f"`{my_table}_payments`"
    query(mysql_url, f"CREATE TABLE {payments} (k INT) ENGINE=InnoDB")
    backend = MySQLBackend(mysql_url, table=my_table, max_idle=1)
    conn = backend._get()
    with conn.cursor() as cur:
        cur.execute("SET SESSION TRANSACTION ISOLATION LEVEL REPEATABLE READ")
    backend._put(conn)
    counts: list[int] = []

    def body() -> str:
        own = current_connection()
        counts.append(int(_one(own, f"SELECT COUNT(*) FROM {payments}")))
        query(mysql_url, f"INSERT INTO {payments} VALUES (1)")  # committed meanwhile
        counts.append(int(_one(own, f"SELECT COUNT(*) FROM {payments}")))
        return "ok"

    assert make_guard(backend).execute("k", body) == "ok"
    assert counts == [0, 1]
    backend.close()


def test_bad_configuration_names_the_option(mysql_url: str) -> None:
    with pytest.raises(ValueError, match="table"):
        MySQLBackend(mysql_url, table="bad name")
    with pytest.raises(ValueError, match="lock_timeout"):
        MySQLBackend(mysql_url, lock_timeout=-1)
    with pytest.raises(ValueError, match="lock_timeout"):
        MySQLBackend(mysql_url + "?lock_timeout=soon")
    with pytest.raises(ValueError, match="unknown mysql:// URL parameter 'colour'"):
        MySQLBackend("mysql://u@h/db?colour=blue")
    with pytest.raises(ValueError, match="must name the database"):
        MySQLBackend("mysql://u@h/")
    assert MySQLBackend(mysql_url, lock_timeout=0.2).wait_seconds == 1  # whole seconds, up
    assert MySQLBackend(mysql_url, lock_timeout=0).wait_seconds == 0
    assert MySQLBackend(mysql_url).wait_seconds == 1
    # The guard digests long keys; a row name past the primary key's width (a long prefix)
    # is refused by name.
    with pytest.raises(ValueError, match="at most 700 characters"):
        MySQLBackend(mysql_url).claim("p" * 800 + "lock:{k}", "p" * 800 + "{k}", 5)
    with pytest.raises(IdempotencyError):
        make_guard(MySQLBackend("mysql://root@127.0.0.1:1/none")).execute("k", lambda: 1)
