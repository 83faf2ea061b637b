"""A minimal Django project (settings, one model, a real worker) on ``django://default``, run
against PostgreSQL (``tests/postgres/test_postgres_django.py``) and MySQL / MariaDB
(``tests/mysql/test_mysql_django.py``), whose modules import these tests and the
``django_setup`` fixture; their conftests give the ``sql_side`` (``tests/support/sql_side.py``).

Django's engines tested: ``django.db.backends.postgresql`` (psycopg 3) and
``django.db.backends.mysql`` on PyMySQL (``install_as_MySQLdb``), picked by the project's
settings (``tests/postgres/django_project``) from the URL. The worker runs
``celery -A djworker worker`` with the project's settings; the body creates ``Payment`` rows
through the ORM. Checked from outside through a separate connection: while the body runs,
neither its rows nor its record are visible; a SIGKILL of the worker's child leaves no
partial rows, and after redelivery exactly one set of rows is committed, with the record;
a body that raises leaves neither rows nor record.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from tests.support.sql_side import SqlSide
from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

PROJECT = Path(__file__).resolve().parents[1] / "postgres" / "django_project"
ROWS = 3


@pytest.fixture(scope="module")
def django_setup(sql_side: SqlSide, redis_url: str) -> Iterator[dict[str, Any]]:
    table = f"dj_{uuid.uuid4().hex[:10]}"
    env = {
        "DJANGO_SETTINGS_MODULE": "dj_settings",
        "DJ_DATABASE_URL": sql_side.url,
        "DJ_BROKER_URL": redis_url,
        "DJ_TABLE": table,
        "DJ_PAYMENTS": f"{table}_payments",
        "DJ_QUEUE": f"q-{uuid.uuid4().hex[:8]}",
    }
    # What "manage.py migrate" would create for the model.
    sql_side.query(
        f"CREATE TABLE {sql_side.payments(table)} (id {sql_side.serial_key} PRIMARY KEY, "
        f"order_id VARCHAR(64) NOT NULL, n INT NOT NULL, pid INT NOT NULL){sql_side.table_options}"
    )
    worker = CeleryWorker(
        "djworker",
        pool="prefork",
        concurrency=1,
        queues=[env["DJ_QUEUE"]],
        env=env,
        pythonpath=[PROJECT],
        cwd=PROJECT,
    )
    worker.start()
    # The test side publishes by name and reads results; it does not load Django.
    app = Celery("djclient", broker=redis_url, backend=redis_url)
    try:
        yield {"env": env, "table": table, "worker": worker, "app": app}
    finally:
        worker.stop()
        app.close()
        sql_side.drop(table)


def _record(sql_side: SqlSide, table: str, order: str) -> list[tuple[Any, ...]]:
    if not sql_side.exists(table):
        return []
    return [
        tuple(row)
        for row in sql_side.query(
            f"SELECT state, fencing_token FROM {sql_side.quote(table)} "
            f"WHERE {sql_side.quote('key')} LIKE %s",
            f"%order:{order}%",
        )
    ]


def test_orm_writes_commit_with_the_record_and_a_kill_leaves_no_partial_rows(
    django_setup: dict[str, Any], sql_side: SqlSide, redis_url: str
) -> None:
    table, worker, app = django_setup["table"], django_setup["worker"], django_setup["app"]
    queue = django_setup["env"]["DJ_QUEUE"]
    marks = redis.Redis.from_url(redis_url)
    order = f"o-{uuid.uuid4().hex[:6]}"
    result = app.send_task("djworker.charge", (order, ROWS, 60.0), queue=queue)
    victim = int(
        wait_for(lambda: marks.get(f"{table}:inserted:{order}:1"), 60, what="first insert")
    )
    # The body has created its rows: nobody else sees them, nor a record, until it commits.
    assert sql_side.paid(table, order) == {}
    assert _record(sql_side, table, order) == []
    assert victim in worker.child_pids()
    worker.kill_child(victim)
    value = result.get(timeout=60)
    # The rerun saw only its own rows: the killed run's were rolled back with its claim.
    assert value == {"order": order, "run": 2, "seen": ROWS}
    rows = sql_side.paid(table, order)
    assert sum(rows.values()) == ROWS
    assert victim not in rows
    assert [state for state, _ in _record(sql_side, table, order)] == ["completed"]
    duplicate = app.send_task("djworker.charge", (order, ROWS, 60.0), queue=queue)
    assert duplicate.get(timeout=30) == value
    assert sum(sql_side.paid(table, order).values()) == ROWS


def test_a_body_that_raises_leaves_neither_rows_nor_record(
    django_setup: dict[str, Any], sql_side: SqlSide
) -> None:
    table, app = django_setup["table"], django_setup["app"]
    queue = django_setup["env"]["DJ_QUEUE"]
    order = f"f-{uuid.uuid4().hex[:6]}"
    result = app.send_task("djworker.charge", (order, ROWS, 0.0, True), queue=queue)
    with pytest.raises(Exception, match="card declined") as caught:
        result.get(timeout=60)
    assert type(caught.value).__name__ == "ValueError"
    assert sql_side.paid(table, order) == {}
    assert _record(sql_side, table, order) == []


def test_another_engine_is_refused_with_the_engine_named(sql_side: SqlSide) -> None:
    # In a fresh interpreter: configuring Django here would leak into other tests.
    module, name = sql_side.django_backend.split(":")
    code = (
        "import django; from django.conf import settings;"
        "settings.configure(DATABASES={'default': {'ENGINE': 'django.db.backends.sqlite3',"
        " 'NAME': ':memory:'}}); django.setup();"
        f"from {module} import {name};"
        f"{name}('default').get('k')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert "ValueError: django://default: the database's engine is 'sqlite'" in done.stderr
