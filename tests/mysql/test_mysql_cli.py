"""``celery idempotency sql / inspect / forget / stats`` and the task's admin methods on the
MySQL / MariaDB backend (the same test as ``tests/postgres/test_postgres_cli.py``)."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from click.testing import CliRunner, Result
from mysql_support import connect

from celery_idempotent import IdempotentTask, MySQLBackend
from celery_idempotent.backends.mysql import ddl
from celery_idempotent.celery.task import reset_backends
from celery_idempotent.cli import idempotency

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def app(mysql_url: str, my_table: str) -> Iterator[Celery]:
    reset_backends()
    app = Celery("mycli", set_as_current=False)
    app.conf.update(
        broker_url="memory://",
        idempotency_url=f"{mysql_url}{'&' if '?' in mysql_url else '?'}table={my_table}",
    )

    # Named explicitly: a new app also gets every shared task of the session (other suites
    # define a "charge" too), so lookups must not go by the function's name.
    @app.task(
        name="mycli.charge", base=IdempotentTask, idempotency_key="order:{order_id}", shared=False
    )
    def charge(order_id: int, amount: int) -> dict[str, int]:
        return {"order": order_id, "amount": amount}

    @app.task(
        name="mycli.ship", base=IdempotentTask, idempotency_key="order:{order_id}", shared=False
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
    return app.tasks[f"mycli.{short}"]


def test_sql_prints_ddl_that_creates_a_working_table(
    mysql_url: str, my_table: str, run: Callable[..., Result]
) -> None:
    done = run("sql", "--table", my_table, "--dialect", "mysql")
    assert done.exit_code == 0, done.output
    assert done.output == ddl(my_table)
    assert f"CREATE TABLE IF NOT EXISTS `{my_table}`" in done.output
    assert run("sql", "--table", my_table, "--url", mysql_url).output == done.output
    conn = connect(mysql_url)
    try:
        with conn.cursor() as cur:
            for statement in done.output.split(";\n"):
                if statement.strip():
                    cur.execute(statement)
    finally:
        conn.close()
    # A backend that may not run DDL works on the table the printed SQL made.
    backend = MySQLBackend(mysql_url, table=my_table, create_table=False)
    lease = backend.acquire("p:lock:{k}", 5)
    assert lease is not None
    assert backend.release(lease)
    backend.close()
    bad = run("sql", "--table", "x; DROP TABLE y", "--dialect", "mysql")
    assert bad.exit_code != 0
    assert "PostgreSQL identifier" in bad.output


def test_no_ddl_and_no_table_is_a_clear_error(mysql_url: str, my_table: str) -> None:
    from celery_idempotent import DistributedIdempotencyGuard, IdempotencyError

    backend = MySQLBackend(mysql_url, table=my_table, create_table=False)
    guard = DistributedIdempotencyGuard(store=backend, lock_provider=backend)
    with pytest.raises(IdempotencyError, match="idempotency sql"):
        guard.execute("k", lambda: 1)


def test_sql_through_the_celery_program() -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "celery",
            "idempotency",
            "sql",
            "--table",
            "payments_idem",
            "--dialect",
            "mysql",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout == ddl("payments_idem")


def test_inspect_forget_stats(
    app: Celery, run: Callable[..., Result], mysql_url: str, my_table: str
) -> None:
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
    backend = MySQLBackend(mysql_url, table=my_table)
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
        kept = run("forget", "order:3", "--task", charge.name, "--yes")
        assert kept.exit_code == 0, kept.output
        assert "in progress: nothing deleted" in kept.output
        dry = json.loads(run("forget", "--task", charge.name, "--dry-run", "--json").output)
        assert (dry["records"], dry["held"], dry["deleted"]) == (2, 1, 0)
        gone = run("forget", "--task", charge.name, "--yes")
        assert gone.exit_code == 0, gone.output
        assert "deleted 2 record(s)" in gone.output
        assert "1 row(s) held by running bodies are kept" in gone.output
    finally:
        backend.release(lease)
        backend.release(first_run)
        backend.close()
    assert (
        json.loads(run("inspect", "order:1", "--task", charge.name, "--json").output)["state"]
        == "absent"
    )
    # The kept record can go once its holder is done; the other task's records were untouched.
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


def test_the_tasks_admin_methods_read_and_forget_mysql_records(
    app: Celery, mysql_url: str, my_table: str
) -> None:
    charge = _task(app, "charge")
    assert charge.idempotency_status((5, 50)).state == "absent"
    charge.apply((5, 50))
    status = charge.idempotency_status((5, 50))
    assert status.state == "completed"
    assert status.fencing_token is not None
    assert status.fencing_token > 0
    forgotten = charge.idempotency_forget((5, 50))
    assert forgotten.state == "completed"
    assert charge.idempotency_status((5, 50)).state == "absent"
    assert charge.apply((5, 50)).get() == {"order": 5, "amount": 50}


@pytest.mark.parametrize("policy", ["raise", "ignore", "retry"])
def test_a_held_key_follows_idempotency_on_locked(
    app: Celery, mysql_url: str, my_table: str, policy: str
) -> None:
    import threading

    from celery_idempotent import LockAcquisitionError

    app.conf.update(
        idempotency_on_locked=policy, idempotency_retry_count=1, idempotency_retry_base_delay=0.01
    )
    charge = _task(app, "charge")
    charge.apply((1, 1))  # the backend and its table exist
    backend = MySQLBackend(mysql_url, table=my_table, lock_timeout=0)
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
