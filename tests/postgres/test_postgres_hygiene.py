"""What a body does to its connection stays in its body (issue 30).

- The pooled connection goes back as it came out: whatever session state a body left (settings,
  role, search_path, TimeZone, a temporary table, an advisory lock, a prepared statement, a
  ``WITH HOLD`` cursor, a ``LISTEN``) is gone for the next body on the same connection, after
  a commit and after a rollback, and the reset costs no round trip of its own.
- A body that ends the guard's transaction itself, by any means, is told so at the commit,
  which is refused; nothing is recorded, and the key is free.
- Any key prefix the settings accept maps a key's lock and its record to one row.
"""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    LockLostError,
    PostgresBackend,
    current_connection,
    current_lease,
)
from celery_idempotent.setting_checks import check_key_prefix


def make_guard(backend: PostgresBackend, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("retry_base_delay", 0.01)
    return DistributedIdempotencyGuard(store=backend, lock_provider=backend, **options)


def conn() -> psycopg.Connection[Any]:
    c = current_connection()
    assert isinstance(c, psycopg.Connection)
    return c


def one(sql: str, *params: Any) -> Any:
    row = conn().execute(sql, params or None).fetchone()
    assert row is not None
    return row[0]


@pytest.fixture
def backend(postgres_url: str, pg_table: str) -> Iterator[PostgresBackend]:
    # One idle connection at most: every body gets the connection the previous one left.
    b = PostgresBackend(postgres_url, table=pg_table, lock_timeout=0.2, max_idle=1)
    yield b
    b.close()


@pytest.fixture
def tenant(postgres_url: str, backend: PostgresBackend, pg_table: str) -> Iterator[str]:
    role = f"tenant_{uuid.uuid4().hex[:8]}"
    make_guard(backend).execute("create-the-table", lambda: None)
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f"CREATE ROLE {role} NOLOGIN")
        admin.execute(f'GRANT ALL ON "{pg_table}" TO {role}')
        admin.execute(f'GRANT ALL ON SEQUENCE "{pg_table}_fencing" TO {role}')
    yield role
    with psycopg.connect(postgres_url, autocommit=True) as admin:
        admin.execute(f'REVOKE ALL ON "{pg_table}" FROM {role}')
        admin.execute(f'REVOKE ALL ON SEQUENCE "{pg_table}_fencing" FROM {role}')
        admin.execute(f"DROP ROLE {role}")


# What a body leaves behind, and how the next body on the connection looks for it: each probe
# returns what it sees, and ``clean`` is what a fresh connection shows.
Leave = Callable[[str], None]
Probe = Callable[[], Any]

STATE: dict[str, tuple[Leave, Probe, Any]] = {
    "SET statement_timeout": (
        lambda role: conn().execute("SET statement_timeout = '50ms'"),
        lambda: one("SHOW statement_timeout"),
        "0",
    ),
    "SET ROLE": (
        lambda role: conn().execute(f"SET ROLE {role}"),
        lambda: one("SELECT current_user"),
        "postgres",
    ),
    "SET SESSION AUTHORIZATION": (
        lambda role: conn().execute(f"SET SESSION AUTHORIZATION {role}"),
        lambda: one("SELECT session_user"),
        "postgres",
    ),
    "search_path": (
        lambda role: conn().execute("SET search_path = public, tenant_schema"),
        lambda: one("SHOW search_path"),
        '"$user", public',
    ),
    "TimeZone": (
        lambda role: conn().execute("SET TimeZone = 'Asia/Tokyo'"),
        lambda: one("SHOW TimeZone"),
        None,  # the server's own default
    ),
    "temp table": (
        lambda role: conn().execute("CREATE TEMP TABLE scratch (x int)"),
        lambda: one("SELECT to_regclass('pg_temp.scratch') IS NOT NULL"),
        False,
    ),
    "advisory lock": (
        lambda role: conn().execute("SELECT pg_advisory_lock(4242)"),
        lambda: one(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = pg_backend_pid()"
        ),
        0,
    ),
    "prepared statement": (
        lambda role: conn().execute("PREPARE leftover AS SELECT 1"),
        lambda: one("SELECT count(*) FROM pg_prepared_statements WHERE name = 'leftover'"),
        0,
    ),
    "open cursor": (
        lambda role: conn().execute("DECLARE leftover CURSOR WITH HOLD FOR SELECT 1"),
        lambda: one("SELECT count(*) FROM pg_cursors WHERE name = 'leftover'"),
        0,
    ),
    "LISTEN": (
        lambda role: conn().execute("LISTEN leftover"),
        lambda: one("SELECT count(*) FROM pg_listening_channels()"),
        0,
    ),
}


@pytest.mark.parametrize("ending", ["commits", "raises"])
@pytest.mark.parametrize("what", list(STATE))
def test_the_next_body_gets_the_connection_as_it_came_out(
    backend: PostgresBackend, tenant: str, what: str, ending: str
) -> None:
    leave, probe, clean = STATE[what]
    guard = make_guard(backend)
    pids: list[int] = []
    fresh = guard.execute("before", lambda: (pids.append(conn().info.backend_pid), probe())[1])
    assert fresh == clean or clean is None
    left: list[Any] = []

    def body() -> str:
        pids.append(conn().info.backend_pid)
        leave(tenant)
        left.append(probe())
        if ending == "raises":
            raise KeyError("the body fails after leaving its state")
        return "done"

    if ending == "raises":
        with pytest.raises(KeyError):
            guard.execute("leaves", body)
    else:
        assert guard.execute("leaves", body) == "done"

    def after() -> Any:
        pids.append(conn().info.backend_pid)
        return probe()

    if what != "LISTEN":  # a LISTEN takes effect when the transaction commits
        assert left != [fresh], "the body did leave the state behind"
    assert guard.execute("after", after) == fresh
    assert len(set(pids)) == 1, "the same pooled connection each time (max_idle=1, LIFO)"


def test_a_bodys_statement_timeout_no_longer_cancels_the_next_claims(
    backend: PostgresBackend,
) -> None:
    """The review's case: ``SET statement_timeout = '50ms'`` committed with one body made the
    next three guarded calls on that connection fail with ``QueryCanceled``."""
    guard = make_guard(backend)
    guard.execute("bounded", lambda: conn().execute("SET statement_timeout = '50ms'") and None)
    for i in range(3):
        assert guard.execute(f"other-{i}", lambda: one("SELECT 1 FROM pg_sleep(0.1)")) == 1


def test_settings_given_at_connect_time_survive_the_reset(postgres_url: str, pg_table: str) -> None:
    url = f"{postgres_url}{'&' if '?' in postgres_url else '?'}options=-c%20work_mem%3D3MB"
    b = PostgresBackend(url, table=pg_table, max_idle=1)
    try:
        guard = make_guard(b)
        guard.execute("a", lambda: conn().execute("SET work_mem = '7MB'") and None)
        assert guard.execute("b", lambda: one("SHOW work_mem")) == "3MB"
        assert guard.execute("c", lambda: one("SHOW tcp_keepalives_idle")) == "10"
    finally:
        b.close()


# -- a body that ends the guard's transaction -------------------------------------------------


def _payments(url: str, table: str) -> str:
    name = f'"{table}_payments"'
    with psycopg.connect(url, autocommit=True) as c:
        c.execute(f"CREATE TABLE {name} (key text, step text)")
    return name


def _rows(url: str, sql: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as c:
        return list(c.execute(sql).fetchall())


ENDINGS = {
    "COMMIT; BEGIN": "COMMIT; BEGIN",
    "ROLLBACK; BEGIN": "ROLLBACK; BEGIN",
    "END; START TRANSACTION": "END; START TRANSACTION",
    "COMMIT": "COMMIT",
    "ROLLBACK": "ROLLBACK",
}


@pytest.mark.parametrize("sql", list(ENDINGS.values()), ids=list(ENDINGS))
def test_a_body_that_ends_the_transaction_has_its_commit_refused(
    backend: PostgresBackend, postgres_url: str, pg_table: str, sql: str
) -> None:
    payments = _payments(postgres_url, pg_table)
    guard = make_guard(backend)

    def body() -> str:
        conn().execute(f"INSERT INTO {payments} VALUES ('k', 'before')")
        conn().execute(sql)
        conn().execute(f"INSERT INTO {payments} VALUES ('k', 'after')")
        return "paid"

    with pytest.raises(LockLostError, match="ended the guard's transaction itself") as caught:
        guard.execute("k", body)
    assert caught.value.result == "paid"
    assert "the key is free" in str(caught.value)
    # Nothing recorded: the key runs again. What the body wrote before its COMMIT is committed
    # (that happened in the body); what it wrote after is not.
    assert backend.get(guard.record_key("k")) is None
    steps = [s for (s,) in _rows(postgres_url, f"SELECT step FROM {payments} ORDER BY step")]
    expected = {"COMMIT; BEGIN": ["before"], "END; START TRANSACTION": ["before"]}
    # A bare COMMIT leaves the session in autocommit: 'after' committed on its own.
    expected["COMMIT"] = ["after", "before"]
    expected["ROLLBACK"] = ["after"]
    assert steps == expected.get(sql, [])
    assert guard.execute("k", lambda: "again") == "again"
    assert backend.get(guard.record_key("k")) is not None


def test_a_body_that_carries_on_after_a_failed_statement_is_told(
    backend: PostgresBackend, postgres_url: str, pg_table: str
) -> None:
    guard = make_guard(backend)

    def body() -> str:
        # Swallowed: the guard's transaction is aborted all the same.
        with contextlib.suppress(psycopg.errors.DivisionByZero):
            conn().execute("SELECT 1 / 0")
        return "done?"

    with pytest.raises(LockLostError, match="aborted the guard's transaction"):
        guard.execute("k", body)
    assert guard.execute("k", lambda: "again") == "again"


def test_a_raw_commit_while_a_duplicate_waits(
    backend: PostgresBackend, postgres_url: str, pg_table: str
) -> None:
    """The review's case: ``COMMIT; BEGIN`` in the body released the row lock, a duplicate
    claimed the key and ran beside it, and the first was told only 'lease ran out or taken'.
    The lock is gone the moment the body commits (nothing can hold it back), so the duplicate
    still runs; the first body's commit is refused, saying what its body did, and the record
    is the duplicate's."""
    payments = _payments(postgres_url, pg_table)
    guard = make_guard(backend, retry_count=50)
    committed = threading.Event()
    duplicate_done = threading.Event()
    tokens: dict[str, int] = {}

    def first() -> str:
        tokens["first"] = current_lease().fencing_token  # type: ignore[union-attr]
        conn().execute(f"INSERT INTO {payments} VALUES ('k', 'first')")
        conn().execute("COMMIT; BEGIN")
        committed.set()
        assert duplicate_done.wait(10)
        return "first"

    def second() -> str:
        tokens["second"] = current_lease().fencing_token  # type: ignore[union-attr]
        conn().execute(f"INSERT INTO {payments} VALUES ('k', 'second')")
        return "second"

    errors: list[BaseException] = []

    def run_first() -> None:
        try:
            guard.execute("k", first)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=run_first)
    t.start()
    assert committed.wait(10)
    assert guard.execute("k", second) == "second"
    duplicate_done.set()
    t.join(10)
    assert len(errors) == 1
    assert isinstance(errors[0], LockLostError)
    assert "ended the guard's transaction itself" in str(errors[0])
    record = backend.get(guard.record_key("k"))
    assert record is not None
    assert record.fencing_token == tokens["second"]
    assert tokens["second"] > tokens["first"]


# -- key prefixes -------------------------------------------------------------------------------

PREFIXES = ["mylock:", "lock:", "a:lock:b:", "x:", "lock:lock:", "::"]
KEYS = ["k", "a{b}c", "lock:{k}", "}{"]


@pytest.mark.parametrize("prefix", PREFIXES)
def test_every_accepted_prefix_maps_lock_and_record_to_one_row(
    backend: PostgresBackend, postgres_url: str, pg_table: str, prefix: str
) -> None:
    assert check_key_prefix("key_prefix", prefix) == prefix
    guard = make_guard(backend, key_prefix=prefix, retry_count=0)
    for key in KEYS:
        lock, record = guard.lock_resource(key), guard.record_key(key)
        seen: dict[str, Any] = {}

        def body(lock: str = lock, seen: dict[str, Any] = seen) -> str:
            # On other connections of the pool, while the claim holds the key's row.
            seen["locked"] = backend.is_locked(lock)
            seen["acquired"] = backend.acquire(lock, 5)
            return "v"

        assert guard.execute(key, body) == "v"
        assert seen == {"locked": True, "acquired": None}, (prefix, key)
        stored = backend.get(record)
        assert stored is not None
        assert stored.result == "v"
        rows = _rows(postgres_url, f"SELECT key, state FROM \"{pg_table}\" WHERE key = '{record}'")
        assert rows == [(record, "completed")]
        assert not backend.is_locked(lock)
        lease = backend.acquire(lock, 5)
        assert lease is not None
        assert backend.release(lease)
    # One row per key: no lock row of its own anywhere.
    assert len(_rows(postgres_url, f'SELECT key FROM "{pg_table}"')) == len(KEYS)


@pytest.mark.parametrize("prefix", ["a{b", "a}b", "{x}:"])
def test_a_prefix_with_braces_is_refused_by_name(backend: PostgresBackend, prefix: str) -> None:
    with pytest.raises(ValueError, match="key_prefix"):
        check_key_prefix("key_prefix", prefix)
    with pytest.raises(ValueError, match="key_prefix"):
        make_guard(backend, key_prefix=prefix)


def test_a_reset_that_fails_after_the_commit_closes_the_session_and_keeps_the_record(
    backend: PostgresBackend, monkeypatch: Any
) -> None:
    from celery_idempotent.backends.postgres import connections

    guard = make_guard(backend)
    pids: list[int] = []
    guard.execute("warm", lambda: pids.append(conn().info.backend_pid))
    monkeypatch.setattr(connections, "SESSION_RESET", "SELECT 1 / 0")  # fails after COMMIT
    assert guard.execute("k", lambda: pids.append(conn().info.backend_pid) or "stored") == "stored"
    monkeypatch.undo()
    record = backend.get(guard.record_key("k"))
    assert record is not None
    assert record.result == "stored"
    guard.execute("next", lambda: pids.append(conn().info.backend_pid))
    assert pids[0] == pids[1] != pids[2], "the session whose reset failed was not pooled"


def test_django_bodies_that_end_the_transaction_are_refused_or_told(
    postgres_url: str, pg_table: str
) -> None:
    """``django://``: raw SQL through Django's cursor and the driver's own ``commit()`` end
    the transaction behind Django's back: the commit is refused, saying so. Django itself
    refuses ``transaction.commit()`` and ``set_autocommit(True)`` inside ``atomic()``: the
    body raises, and nothing is stored either way."""
    import json
    import subprocess
    import sys
    from pathlib import Path

    script = Path(__file__).with_name("pg_django_ended.py")
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.run(
        [sys.executable, str(script), postgres_url, pg_table],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    for way in ("raw_sql", "driver_commit"):
        assert out[way]["raised"].startswith("LockLostError"), out
        assert "ended the guard's transaction itself" in out[way]["raised"], out
    for way in ("django_commit", "autocommit_on"):
        assert out[way]["raised"].startswith("TransactionManagementError"), out
    assert not any(v["stored"] for k, v in out.items() if k != "after"), out
    assert out["after"] == "fine"
