"""The admin on the SQL backends, one test for both: ``celery idempotency sql / inspect /
forget / stats``, the task's admin methods and ``admin.forget_all``, run against PostgreSQL
(``tests/postgres/test_postgres_cli.py``) and MySQL / MariaDB (``tests/mysql/test_mysql_cli.py``).

Each of those modules imports the tests below and gives them an ``sqlcli`` fixture: a
:class:`SqlCli`, the database under test with the few steps that differ (its URL and table,
the backend class, the DDL's dialect and how to run it). The commands and the admin are one
code path on every backend (``core/admin.py``'s ``KeyAdmin``); what these tests see is the
same on both databases, and on Redis (``tests/cli``) but where a row lock differs from a
Redis lease (no ``--force`` takes a row from a live session).
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result

from celery_idempotent import (
    DistributedIdempotencyGuard,
    IdempotencyError,
    IdempotentTask,
    LockAcquisitionError,
)
from celery_idempotent.admin import forget_all
from celery_idempotent.celery.task import reset_backends
from celery_idempotent.cli import idempotency
from celery_idempotent.core.fingerprint import fingerprint_payload

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class SqlCli:
    """One SQL database under the shared admin tests."""

    #: a short name, the prefix of the test apps' task names
    name: str
    url: str
    table: str
    #: the backend class (``PostgresBackend``, ``MySQLBackend``)
    backend: type[Any]
    #: ``ddl(table)``: the dialect's DDL, as ``sql`` prints it
    ddl: Callable[[str], str]
    #: what ``sql`` needs to print this dialect's DDL (``--dialect mysql``)
    sql_args: tuple[str, ...]
    #: ``run_ddl(text)``: run printed DDL on the database
    run_ddl: Callable[[str], None]
    #: how the DDL quotes the table's name (``"t"``, ```t```)
    quoted: Callable[[str], str]
    #: a ``lock_timeout`` that refuses a held row (almost) at once
    short_wait: float

    @property
    def idempotency_url(self) -> str:
        return f"{self.url}{'&' if '?' in self.url else '?'}table={self.table}"


@pytest.fixture
def app(sqlcli: SqlCli) -> Iterator[Celery]:
    reset_backends()
    app = Celery(f"{sqlcli.name}cli", set_as_current=False)
    app.conf.update(broker_url="memory://", idempotency_url=sqlcli.idempotency_url)

    # Named explicitly: a new app also gets every shared task of the session (other suites
    # define a "charge" too), so lookups must not go by the function's name.
    @app.task(
        name=f"{sqlcli.name}cli.charge",
        base=IdempotentTask,
        idempotency_key="order:{order_id}",
        shared=False,
    )
    def charge(order_id: int, amount: int) -> dict[str, int]:
        return {"order": order_id, "amount": amount}

    @app.task(
        name=f"{sqlcli.name}cli.ship",
        base=IdempotentTask,
        idempotency_key="order:{order_id}",
        shared=False,
    )
    def ship(order_id: int) -> str:
        return f"shipped {order_id}"

    yield app
    reset_backends()


@pytest.fixture
def run(app: Celery) -> Callable[..., Result]:
    def invoke(*args: str, input: str | None = None) -> Result:
        obj = CLIContext(app=app, no_color=True, workdir=None)
        return CliRunner().invoke(idempotency, list(args), obj=obj, input=input)

    return invoke


def _task(app: Celery, short: str) -> Any:
    return app.tasks[f"{app.main}.{short}"]


def test_sql_prints_ddl_that_creates_a_working_table(
    sqlcli: SqlCli, run: Callable[..., Result]
) -> None:
    done = run("sql", "--table", sqlcli.table, *sqlcli.sql_args)
    assert done.exit_code == 0, done.output
    assert done.output == sqlcli.ddl(sqlcli.table)
    assert f"CREATE TABLE IF NOT EXISTS {sqlcli.quoted(sqlcli.table)}" in done.output
    # The URL's scheme says the dialect too.
    assert run("sql", "--table", sqlcli.table, "--url", sqlcli.url).output == done.output
    sqlcli.run_ddl(done.output)
    # A backend that may not run DDL works on the table the printed SQL made.
    backend = sqlcli.backend(sqlcli.url, table=sqlcli.table, create_table=False)
    lease = backend.acquire("p:lock:{k}", 5)
    assert lease is not None
    assert backend.release(lease)
    backend.close()
    bad = run("sql", "--table", "x; DROP TABLE y", *sqlcli.sql_args)
    assert bad.exit_code != 0
    assert "PostgreSQL identifier" in bad.output


def test_no_ddl_and_no_table_is_a_clear_error(sqlcli: SqlCli) -> None:
    backend = sqlcli.backend(sqlcli.url, table=sqlcli.table, create_table=False)
    guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)
    with pytest.raises(IdempotencyError, match="idempotency sql"):
        guard.execute("k", lambda: 1)


def test_sql_through_the_celery_program(sqlcli: SqlCli) -> None:
    done = subprocess.run(
        [
            sys.executable,
            *("-m", "celery", "idempotency", "sql", "--table", "payments_idem"),
            *sqlcli.sql_args,
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == sqlcli.ddl("payments_idem")


def test_inspect_forget_stats(app: Celery, run: Callable[..., Result], sqlcli: SqlCli) -> None:
    charge, ship = _task(app, "charge"), _task(app, "ship")
    for order in (1, 2, 3):
        charge.apply((order, 10 * order))
    ship.apply((1,))

    shown = run("inspect", "order:2", "--task", charge.name, "--json", "--show-result")
    assert shown.exit_code == 0, shown.output
    doc = json.loads(shown.output)
    assert doc["state"] == "completed"
    assert doc["result"] == {"order": 2, "amount": 20}
    assert doc["record"]["fencing_token"] > 0
    assert 0 < doc["record"]["ttl"] <= 86_400
    text = run("inspect", "order:2", "--task", charge.name)
    assert "completed" in text.output
    assert "fencing token" in text.output
    absent = json.loads(run("inspect", "order:9", "--task", charge.name, "--json").output)
    assert absent["state"] == "absent"

    # A running body's row: in progress, and kept by forget.
    backend = sqlcli.backend(sqlcli.url, table=sqlcli.table)
    held_row = doc["row"].replace("order:2", "order:3")
    lease = backend.acquire(held_row.replace("{", "lock:{", 1), 5)
    assert lease is not None
    first_run = backend.acquire(held_row.replace("order:3", "order:7").replace("{", "lock:{", 1), 5)
    assert first_run is not None
    try:
        # A key's first run (its row inserted, uncommitted) shows as in progress.
        running = json.loads(run("inspect", "order:7", "--task", charge.name, "--json").output)
        assert running["state"] == "in_progress"
        # A completed record whose row a transaction holds: completed, lock held.
        locked = json.loads(run("inspect", "order:3", "--task", charge.name, "--json").output)
        assert (locked["state"], locked["held"]) == ("completed", True)
        stats = json.loads(run("stats", "--json").output)
        assert stats["tasks"][charge.name] == {"completed": 2, "in_progress": 1}
        assert stats["tasks"][ship.name] == {"completed": 1, "in_progress": 0}
        table = run("stats")
        assert table.exit_code == 0, table.output
        assert f"table {sqlcli.table}" in table.output
        assert "IN PROGRESS" in table.output
        kept = run("forget", "order:3", "--task", charge.name, "--yes")
        assert kept.exit_code == 0, kept.output
        assert "in progress: nothing deleted" in kept.output
        dry = json.loads(run("forget", "--task", charge.name, "--dry-run", "--json").output)
        assert (dry["records"], dry["held_locks"]) == (2, 1)
        assert "deleted" not in dry  # a dry run deletes nothing
        gone = run("forget", "--task", charge.name, "--yes")
        assert gone.exit_code == 0, gone.output
        assert "deleted 2 record(s)" in gone.output
        assert "1 held lock(s) (bodies running now) are kept" in gone.output
        assert "--force" not in gone.output  # no force takes a row from a live session
    finally:
        backend.release(lease)
        backend.release(first_run)
        backend.close()
    assert (
        json.loads(run("inspect", "order:1", "--task", charge.name, "--json").output)["state"]
        == "absent"
    )
    # The kept record can go once its holder is done; the other task's records were untouched.
    would = run("forget", "order:3", "--task", charge.name, "--dry-run", "--json")
    assert json.loads(would.output)["would_delete"] == [held_row]
    freed = run("forget", "order:3", "--task", charge.name, "--yes")
    assert "deleted key" in freed.output, freed.output
    assert json.loads(run("stats", "--json").output)["tasks"][ship.name]["completed"] == 1
    assert run("forget", "order:1", "--task", ship.name, "--yes").exit_code == 0
    stats = json.loads(run("stats", "--json").output)
    assert stats["total"] == {"completed": 0, "in_progress": 0}
    # Forgotten keys run again, with a higher fencing token.
    before = doc["record"]["fencing_token"]
    charge.apply((2, 20))
    again = json.loads(run("inspect", "order:2", "--task", charge.name, "--json").output)
    assert again["record"]["fencing_token"] > before


def test_the_tasks_admin_methods_read_and_forget_records(app: Celery, sqlcli: SqlCli) -> None:
    charge = _task(app, "charge")
    assert charge.idempotency_status((5, 50)).state == "absent"
    charge.apply((5, 50))
    status = charge.idempotency_status((5, 50))
    assert status.state == "completed"
    assert status.fencing_token is not None
    assert status.fencing_token > 0
    assert status.ttl is not None
    assert 0 < status.ttl <= 86_400  # read from the row, as inspect reads it
    assert status.key == charge.idempotency_key_for((5, 50), {})
    assert status.fingerprint == fingerprint_payload({"order_id": 5, "amount": 50})
    forgotten = charge.idempotency_forget((5, 50))
    assert forgotten.state == "completed"
    assert len(forgotten.deleted) == 1
    assert charge.idempotency_status((5, 50)).state == "absent"
    assert charge.idempotency_forget((5, 50)).deleted == ()  # nothing left: nothing deleted
    assert charge.apply((5, 50)).get() == {"order": 5, "amount": 50}


@pytest.mark.parametrize("policy", ["raise", "ignore", "retry"])
def test_a_held_key_follows_idempotency_on_locked(app: Celery, sqlcli: SqlCli, policy: str) -> None:
    app.conf.update(
        idempotency_on_locked=policy, idempotency_retry_count=1, idempotency_retry_base_delay=0.01
    )
    charge = _task(app, "charge")
    charge.apply((1, 1))  # the backend and its table exist
    backend = sqlcli.backend(sqlcli.url, table=sqlcli.table, lock_timeout=sqlcli.short_wait)
    row = json.loads(
        CliRunner()
        .invoke(
            idempotency,
            ["inspect", "order:8", "--task", charge.name, "--json"],
            obj=CLIContext(app=app, no_color=True, workdir=None),
        )
        .output
    )["row"]
    lease = backend.acquire(row.replace("{", "lock:{", 1), 5)
    assert lease is not None
    try:
        if policy == "retry":
            # Eager mode waits in place between attempts: free the key meanwhile.
            timer = threading.Timer(0.5, backend.release, (lease,))
            timer.start()
            assert charge.apply((8, 80)).get() == {"order": 8, "amount": 80}
            timer.join()
            return
        result = charge.apply((8, 80))
        if policy == "raise":
            assert result.state == "FAILURE"
            assert isinstance(result.result, LockAcquisitionError)
            assert result.result.attempts == 2
        else:
            assert result.state == "IGNORED"
    finally:
        backend.release(lease)
        backend.close()
    assert charge.idempotency_status((8, 80)).state == "absent"


def test_forget_all(sqlcli: SqlCli) -> None:
    """``admin.forget_all(app)`` (``forget --all``, issue 24): every record of every
    idempotent task of the app goes, a row a running body holds stays."""
    name = f"{sqlcli.name}forget"
    app = Celery(name, broker="memory://", set_as_current=False)
    app.conf.idempotency_url = sqlcli.idempotency_url
    gate, inside = threading.Event(), threading.Event()

    @app.task(base=IdempotentTask, shared=False, name=f"{name}.a")
    def a(x: int) -> int:
        return x

    @app.task(base=IdempotentTask, shared=False, name=f"{name}.hold")
    def hold(tag: str) -> str:
        inside.set()
        gate.wait(10)
        return tag

    reset_backends()
    try:
        for x in range(3):
            a.apply((x,)).get()
        held = uuid.uuid4().hex
        holder = threading.Thread(target=lambda: hold.apply((held,)))
        holder.start()
        assert inside.wait(10)
        try:
            dry = forget_all(app, dry_run=True)
            by_task = {each.tasks: each for each in dry.namespaces}
            assert by_task[(f"{name}.a",)].records == 3
            assert by_task[(f"{name}.hold",)].records == 0  # its row is the body's, uncommitted
            done = forget_all(app)
            assert done.records == 3
            assert a.idempotency_status((0,)).state == "absent"
        finally:
            gate.set()
            holder.join(10)
        # The running body was not disturbed: its record committed after the forget.
        assert hold.idempotency_status((held,)).state == "completed"
        assert a.apply((0,)).get() == 0  # runs again
    finally:
        reset_backends()
        app.close()
