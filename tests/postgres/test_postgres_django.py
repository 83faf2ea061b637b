"""A minimal Django project (settings, one model, a real worker) on ``django://default``.

Django's engine tested: ``django.db.backends.postgresql`` (psycopg 3). The worker runs
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

import psycopg
import pytest
import redis
from celery import Celery

from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

PROJECT = Path(__file__).resolve().parent / "django_project"
ROWS = 3

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def django_setup(postgres_url: str, redis_url: str) -> Iterator[dict[str, Any]]:
    table = f"dj_{uuid.uuid4().hex[:10]}"
    env = {
        "DJANGO_SETTINGS_MODULE": "dj_settings",
        "DJ_DATABASE_URL": postgres_url,
        "DJ_BROKER_URL": redis_url,
        "DJ_TABLE": table,
        "DJ_PAYMENTS": f"{table}_payments",
        "DJ_QUEUE": f"q-{uuid.uuid4().hex[:8]}",
    }
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        # What "manage.py migrate" would create for the model.
        conn.execute(
            f'CREATE TABLE "{table}_payments" (id bigserial PRIMARY KEY, '
            "order_id varchar(64) NOT NULL, n integer NOT NULL, pid integer NOT NULL)"
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
        with psycopg.connect(postgres_url, autocommit=True) as conn:
            for name in (table, f"{table}_payments"):
                conn.execute(f'DROP TABLE IF EXISTS "{name}"')
            conn.execute(f'DROP SEQUENCE IF EXISTS "{table}_fencing"')


def _rows(url: str, table: str, order: str) -> dict[int, int]:
    with psycopg.connect(url, autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT pid, count(*) FROM "{table}_payments" WHERE order_id = %s GROUP BY pid',
            (order,),
        ).fetchall()
    return dict(rows)


def _record(url: str, table: str, order: str) -> list[tuple[Any, ...]]:
    with psycopg.connect(url, autocommit=True) as conn:
        exists = conn.execute("SELECT to_regclass(%s)", (table,)).fetchone()
        if not exists or exists[0] is None:
            return []
        return conn.execute(
            f'SELECT state, fencing_token FROM "{table}" WHERE key LIKE %s',
            (f"%order:{order}%",),
        ).fetchall()


def test_orm_writes_commit_with_the_record_and_a_kill_leaves_no_partial_rows(
    django_setup: dict[str, Any], postgres_url: str, redis_url: str
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
    assert _rows(postgres_url, table, order) == {}
    assert _record(postgres_url, table, order) == []
    assert victim in worker.child_pids()
    worker.kill_child(victim)
    value = result.get(timeout=60)
    # The rerun saw only its own rows: the killed run's were rolled back with its claim.
    assert value == {"order": order, "run": 2, "seen": ROWS}
    rows = _rows(postgres_url, table, order)
    assert sum(rows.values()) == ROWS
    assert victim not in rows
    assert [state for state, _ in _record(postgres_url, table, order)] == ["completed"]
    duplicate = app.send_task("djworker.charge", (order, ROWS, 60.0), queue=queue)
    assert duplicate.get(timeout=30) == value
    assert sum(_rows(postgres_url, table, order).values()) == ROWS


def test_a_body_that_raises_leaves_neither_rows_nor_record(
    django_setup: dict[str, Any], postgres_url: str
) -> None:
    table, app = django_setup["table"], django_setup["app"]
    queue = django_setup["env"]["DJ_QUEUE"]
    order = f"f-{uuid.uuid4().hex[:6]}"
    result = app.send_task("djworker.charge", (order, ROWS, 0.0, True), queue=queue)
    with pytest.raises(Exception, match="card declined") as caught:
        result.get(timeout=60)
    assert type(caught.value).__name__ == "ValueError"
    assert _rows(postgres_url, table, order) == {}
    assert _record(postgres_url, table, order) == []


def test_non_postgresql_engine_is_refused_with_the_engine_named() -> None:
    # In a fresh interpreter: configuring Django here would leak into other tests.
    code = (
        "import django; from django.conf import settings;"
        "settings.configure(DATABASES={'default': {'ENGINE': 'django.db.backends.sqlite3',"
        " 'NAME': ':memory:'}}); django.setup();"
        "from celery_idempotent import DjangoBackend;"
        "DjangoBackend('default').get('k')"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode != 0
    assert "ValueError: django://default: the database's engine is 'sqlite'" in done.stderr
