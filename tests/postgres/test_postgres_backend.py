"""What the PostgreSQL backend adds to the contract: one transaction for body and record."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyError,
    LockLostError,
    PostgresBackend,
    current_connection,
    current_lease,
)

ROOT = Path(__file__).resolve().parents[2]


def make_guard(backend: PostgresBackend, **options: Any) -> DistributedIdempotencyGuard:
    options.setdefault("retry_base_delay", 0.01)
    return DistributedIdempotencyGuard(store=backend, lock_provider=backend, **options)


@pytest.fixture
def payments(postgres_url: str, pg_table: str) -> str:
    name = f'"{pg_table}_payments"'
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {name} (key text, fence bigint)")
    return name


def _count(url: str, sql: str, *params: Any) -> int:
    with psycopg.connect(url, autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
    assert row is not None
    return int(row[0])


def test_body_writes_and_record_become_visible_together(
    pg_backend: PostgresBackend, postgres_url: str, pg_table: str, payments: str
) -> None:
    guard = make_guard(pg_backend)
    seen_inside: list[tuple[int, int]] = []
    records = f"SELECT count(*) FROM \"{pg_table}\" WHERE state = 'completed'"

    def body() -> str:
        conn = current_connection()
        assert isinstance(conn, psycopg.Connection)
        conn.execute(f"INSERT INTO {payments} VALUES ('k', %s)", (current_lease().fencing_token,))  # type: ignore[union-attr]
        # From another connection: neither the row nor the record exists yet.
        seen_inside.append(
            (
                _count(postgres_url, f"SELECT count(*) FROM {payments}"),
                _count(postgres_url, records),
            )
        )
        return "paid"

    assert guard.execute("k", body) == "paid"
    assert seen_inside == [(0, 0)]
    assert _count(postgres_url, f"SELECT count(*) FROM {payments}") == 1
    assert _count(postgres_url, records) == 1
    assert current_connection() is None  # outside a body


def test_a_failing_body_rolls_back_its_writes(
    pg_backend: PostgresBackend, postgres_url: str, payments: str
) -> None:
    guard = make_guard(pg_backend)

    def body() -> None:
        current_connection().execute(f"INSERT INTO {payments} VALUES ('k', 1)")  # type: ignore[union-attr]
        raise KeyError("declined")

    with pytest.raises(KeyError):
        guard.execute("k", body)
    assert _count(postgres_url, f"SELECT count(*) FROM {payments}") == 0
    assert guard.execute("k", lambda: "second") == "second"


def test_the_body_cannot_end_the_guards_transaction(
    pg_backend: PostgresBackend, postgres_url: str, payments: str
) -> None:
    guard = make_guard(pg_backend)

    def commits() -> None:
        conn = current_connection()
        conn.execute(f"INSERT INTO {payments} VALUES ('k', 1)")
        conn.commit()

    with pytest.raises(psycopg.ProgrammingError, match="commit"):
        guard.execute("k", commits)
    assert _count(postgres_url, f"SELECT count(*) FROM {payments}") == 0

    def nested() -> str:
        conn = current_connection()
        conn.execute(f"INSERT INTO {payments} VALUES ('kept', 1)")
        try:
            with conn.transaction():  # a savepoint inside the guard's transaction
                conn.execute(f"INSERT INTO {payments} VALUES ('undone', 1)")
                raise ValueError
        except ValueError:
            pass
        return "ok"

    assert guard.execute("k2", nested) == "ok"
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        keys = [k for (k,) in conn.execute(f"SELECT key FROM {payments}")]
    assert keys == ["kept"]

    def raw_commit() -> str:
        current_connection().execute("COMMIT")
        return "sneaky"

    with pytest.raises(LockLostError):
        guard.execute("k3", raw_commit)


def test_fencing_tokens_increase_across_rollbacks_and_record_expiry(
    pg_backend: PostgresBackend,
) -> None:
    guard = make_guard(pg_backend, ttl=0.2)
    tokens: list[int] = []

    def failing() -> None:
        tokens.append(current_lease().fencing_token)  # type: ignore[union-attr]
        raise RuntimeError

    for _ in range(3):
        with pytest.raises(RuntimeError):
            guard.execute("k", failing)
    first = guard.run("k", lambda: "v")
    assert first.fencing_token is not None
    tokens.append(first.fencing_token)
    time.sleep(0.3)  # the record expires
    second = guard.run("k", lambda: "w")
    assert not second.replayed
    assert second.fencing_token is not None
    tokens.append(second.fencing_token)
    assert tokens == sorted(tokens)
    assert len(set(tokens)) == len(tokens)


def test_a_duplicate_waits_on_the_row_lock_and_replays(pg_backend: PostgresBackend) -> None:
    pg_backend.lock_timeout = 5.0
    guard = make_guard(pg_backend, retry_count=0)
    running = threading.Event()
    results: list[Any] = []

    def slow() -> str:
        running.set()
        time.sleep(0.3)
        return "first"

    holder = threading.Thread(target=lambda: results.append(guard.run("k", slow)))
    holder.start()
    assert running.wait(5)
    duplicate = guard.run("k", lambda: "second")  # one attempt: it waits for the commit
    holder.join()
    assert duplicate.replayed
    assert duplicate.value == "first"
    assert duplicate.attempts == 1
    assert results[0].value == "first"


def test_a_claim_that_times_out_leaves_its_connection_usable(
    postgres_url: str, pg_table: str
) -> None:
    """A claim that waits past ``lock_timeout`` aborts its pipeline. psycopg prepares a
    statement on the server at its fifth use (``prepare_threshold``); when that use is in a
    pipeline that aborts, psycopg still records the statement as prepared, and every later
    claim on the pooled connection failed with ``prepared statement "_pg3_N" does not exist``
    (seen under eventlet, where claims time out often). Whichever claim times out, the
    connection must stay usable."""
    holder = PostgresBackend(postgres_url, table=pg_table, lock_timeout=0.05)
    held = holder.claim("r", "hot", 10)
    assert held.lease is not None
    try:
        for warm in range(8):  # the contended claim is the connection's 1st ... 9th
            backend = PostgresBackend(postgres_url, table=pg_table, lock_timeout=0.05, max_idle=1)
            try:
                for index in range(warm):
                    claim = backend.claim("r", f"warm-{warm}-{index}", 10)
                    assert claim.lease is not None
                    backend.release(claim.lease)
                assert backend.claim("r", "hot", 10) == (None, None)  # timed out: held
                for index in range(6):
                    claim = backend.claim("r", f"after-{warm}-{index}", 10)
                    assert claim.lease is not None, (warm, index)
                    backend.release(claim.lease)
            finally:
                backend.close()
    finally:
        holder.release(held.lease)
        holder.close()


def test_cleanup_deletes_expired_rows_in_bounded_batches(
    pg_backend: PostgresBackend, postgres_url: str, pg_table: str
) -> None:
    guard = make_guard(pg_backend, ttl=0.1)
    for index in range(7):
        guard.execute(f"k{index}", lambda: 1)
    lease = pg_backend.acquire("p:lock:{held}", 5)  # an uncommitted row: never swept
    time.sleep(0.2)
    assert pg_backend.cleanup(limit=5) == 5
    assert pg_backend.cleanup(limit=5) == 2
    assert pg_backend.cleanup(limit=5) == 0
    assert lease is not None
    assert pg_backend.release(lease)
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        plan = "\n".join(
            row[0]
            for row in conn.execute(
                f'EXPLAIN SELECT ctid FROM "{pg_table}" WHERE expires_at < now() '
                "ORDER BY expires_at LIMIT 500"
            )
        )
        conn.execute("SET enable_seqscan = off")  # tiny table: ask whether the index serves
        indexed = "\n".join(
            row[0]
            for row in conn.execute(
                f'EXPLAIN SELECT ctid FROM "{pg_table}" WHERE expires_at < now() '
                "ORDER BY expires_at LIMIT 500"
            )
        )
    assert plan
    assert f"{pg_table}_expires_at" in indexed


def test_a_connection_lost_mid_body_commits_nothing(
    pg_backend: PostgresBackend, postgres_url: str, payments: str
) -> None:
    guard = make_guard(pg_backend)

    def body() -> str:
        conn = current_connection()
        conn.execute(f"INSERT INTO {payments} VALUES ('k', 1)")
        with psycopg.connect(postgres_url, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s)", (conn.info.backend_pid,))
        time.sleep(0.2)
        return "lost"

    with pytest.raises(LockLostError) as caught:
        guard.execute("k", body)
    assert caught.value.result == "lost"
    assert _count(postgres_url, f"SELECT count(*) FROM {payments}") == 0
    assert guard.execute("k", lambda: "again") == "again"


def test_round_trips_match_a_plain_transaction(
    postgres_url: str, pg_table: str, payments: str
) -> None:
    import sys

    sys.path.insert(0, str(ROOT))
    from urllib.parse import urlsplit

    from benchmarks.pg import FlightCounter

    parts = urlsplit(postgres_url)
    # Replies held 50 ms: a pipelined flight is sent whole long before, even on a busy machine.
    relay = FlightCounter(parts.hostname or "127.0.0.1", parts.port or 5432, delay=0.05)
    try:
        url = relay.url(postgres_url)
        backend = PostgresBackend(url, table=pg_table)
        guard = make_guard(backend)
        plain = psycopg.connect(url, autocommit=True)
        guard.execute("warm", lambda: None)

        def flights(fn: Any) -> int:
            before = relay.flights
            fn()
            time.sleep(0.05)
            return relay.flights - before

        def plain_tx() -> None:
            with plain.transaction():
                plain.execute(f"INSERT INTO {payments} VALUES ('p', 0)")

        def body() -> None:
            current_connection().execute(f"INSERT INTO {payments} VALUES ('g', 0)")

        assert flights(plain_tx) == 3  # BEGIN, INSERT, COMMIT
        assert flights(lambda: guard.execute("k", body)) == 3  # claim, INSERT, commit
        assert flights(lambda: guard.execute("k", body)) == 2  # claim, ROLLBACK: a replay
        plain.close()
        backend.close()
    finally:
        relay.close()


def test_bad_configuration_names_the_option(postgres_url: str) -> None:
    with pytest.raises(ValueError, match="table"):
        PostgresBackend(postgres_url, table="bad name")
    with pytest.raises(ValueError, match="lock_timeout"):
        PostgresBackend(postgres_url, lock_timeout=0)
    with pytest.raises(ValueError, match="lock_timeout"):
        PostgresBackend(postgres_url + "?lock_timeout=soon")
    with pytest.raises(IdempotencyError):
        make_guard(PostgresBackend("postgresql://postgres@127.0.0.1:1/none")).execute(
            "k", lambda: 1
        )


def _is_commit_flight(statements: Any) -> bool:
    """The guard's commit (its statement, COMMIT, the session reset): not a flight that opens
    a transaction (a claim, whose flight may also carry the queued marker's own short
    transaction, or an autocommit step)."""
    return any(sql == "COMMIT" for sql, _ in statements) and statements[0][0] != "BEGIN"


def test_a_lost_commit_reply_is_answered_from_the_database(
    pg_backend: PostgresBackend, postgres_url: str, payments: str, monkeypatch: Any
) -> None:
    """The COMMIT reached the server, its reply did not: the guard asks again on a new
    connection and finds this lease's record (and the body's row) committed."""
    guard = make_guard(pg_backend)
    real = PostgresBackend._flight
    lost: list[bool] = []

    def flight(conn: Any, statements: Any, cursors: Any = None) -> Any:
        results = real(conn, statements, cursors)
        if _is_commit_flight(statements) and not lost:
            lost.append(True)
            conn.close()  # the reply "never arrived": the connection is gone
            raise ConnectionError("reply lost")
        return results

    monkeypatch.setattr(PostgresBackend, "_flight", staticmethod(flight))

    def body() -> str:
        current_connection().execute(f"INSERT INTO {payments} VALUES ('k', 1)")
        return "paid"

    outcome = guard.run("k", body)
    assert lost == [True]
    assert (outcome.value, outcome.replayed) == ("paid", False)
    assert _count(postgres_url, f"SELECT count(*) FROM {payments}") == 1
    assert guard.run("k", lambda: "again").replayed


def test_a_commit_that_never_left_is_reported_not_stored(
    pg_backend: PostgresBackend, postgres_url: str, payments: str, monkeypatch: Any
) -> None:
    """The connection died before the COMMIT was sent: the server rolled back, the check on a
    new connection finds no record and no session, and LockLostError says nothing was stored."""
    guard = make_guard(pg_backend)
    real = PostgresBackend._flight
    cut: list[bool] = []

    def flight(conn: Any, statements: Any, cursors: Any = None) -> Any:
        if _is_commit_flight(statements) and not cut:
            cut.append(True)
            pid = conn.info.backend_pid
            conn.close()
            with psycopg.connect(postgres_url, autocommit=True) as admin:  # wait for the end
                while admin.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE pid = %s", (pid,)
                ).fetchone() != (0,):
                    time.sleep(0.01)
            raise ConnectionError("connection lost before the commit")
        return real(conn, statements, cursors)

    monkeypatch.setattr(PostgresBackend, "_flight", staticmethod(flight))

    def body() -> str:
        current_connection().execute(f"INSERT INTO {payments} VALUES ('k', 1)")
        return "paid"

    with pytest.raises(LockLostError) as caught:
        guard.run("k", body)
    assert type(caught.value) is LockLostError  # known not stored: not CommitUnknownError
    assert caught.value.result == "paid"
    monkeypatch.setattr(PostgresBackend, "_flight", staticmethod(real))
    assert _count(postgres_url, f"SELECT count(*) FROM {payments}") == 0
    assert guard.execute("k", lambda: "again") == "again"


def test_a_forked_child_never_touches_the_parents_connections(pg_backend: PostgresBackend) -> None:
    import os

    guard = make_guard(pg_backend)
    assert guard.execute("before", lambda: 1) == 1
    parents = list(pg_backend._idle)
    assert parents
    child = os.fork()
    if child == 0:  # pragma: no cover - the child reports through its exit status
        code = 1
        try:
            code = 0 if guard.execute("child", lambda: 2) == 2 else 1
        finally:
            os._exit(code)
    _, status = os.waitpid(child, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    for conn in parents:  # still the parent's, still open (no Terminate sent by the child)
        assert conn.execute("SELECT 1").fetchone() == (1,)
    assert guard.execute("child", lambda: 3) == 2  # the child's commit is there


def test_keepalives_are_set_on_both_ends_of_the_bodys_connection(
    pg_backend: PostgresBackend,
) -> None:
    guard = make_guard(pg_backend)

    def body() -> dict[str, Any]:
        conn = current_connection()
        server = {
            name: conn.execute(f"SHOW tcp_keepalives_{name}").fetchone()[0]
            for name in ("idle", "interval", "count")
        }
        client = {k: v for k, v in conn.info.get_parameters().items() if k.startswith("keep")}
        return {"server": server, "client": client}

    found = guard.execute("k", body)
    # The server, which holds the row lock, probes a silent worker: 10 s, then 3 x 5 s.
    assert found["server"] == {"idle": "10", "interval": "5", "count": "3"}
    assert found["client"] == {
        "keepalives": "1",
        "keepalives_idle": "10",
        "keepalives_interval": "5",
        "keepalives_count": "3",
    }
