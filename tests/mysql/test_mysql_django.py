"""The PostgreSQL suite's minimal Django project (``tests/postgres/django_project``: settings,
one model, a real worker) on ``django://default``, with the database on MySQL / MariaDB.

Django's engine tested: ``django.db.backends.mysql`` on PyMySQL (``install_as_MySQLdb``). The
worker runs ``celery -A djworker worker`` with the project's settings; the body creates
``Payment`` rows through the ORM. Checked from outside through a separate connection: while the
body runs, neither its rows nor its record are visible; a SIGKILL of the worker's child leaves no
partial rows, and after redelivery exactly one set of rows is committed, with the record;
a body that raises leaves neither rows nor record.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from mysql_support import query

from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

PROJECT = Path(__file__).resolve().parents[1] / "postgres" / "django_project"
ROWS = 3

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.fixture(scope="module")
def django_setup(mysql_url: str, redis_url: str) -> Iterator[dict[str, Any]]:
    table = f"dj_{uuid.uuid4().hex[:10]}"
    env = {
        "DJANGO_SETTINGS_MODULE": "dj_settings",
        "DJ_DATABASE_URL": mysql_url,
        "DJ_BROKER_URL": redis_url,
        "DJ_TABLE": table,
        "DJ_PAYMENTS": f"{table}_payments",
        "DJ_QUEUE": f"q-{uuid.uuid4().hex[:8]}",
    }
    # What "manage.py migrate" would create for the model.
    query(
        mysql_url,
        f"CREATE TABLE `{table}_payments` (id BIGINT AUTO_INCREMENT PRIMARY KEY, "
        "order_id VARCHAR(64) NOT NULL, n INT NOT NULL, pid INT NOT NULL) ENGINE=InnoDB",
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
        for name in (table, f"{table}_payments", f"{table}_fencing"):
            query(mysql_url, f"DROP TABLE IF EXISTS `{name}`")


def _rows(url: str, table: str, order: str) -> dict[int, int]:
    rows = query(
        url, f"SELECT pid, count(*) FROM `{table}_payments` WHERE order_id = %s GROUP BY pid", order
    )
    return {int(pid): int(n) for pid, n in rows}


def _record(url: str, table: str, order: str) -> list[tuple[Any, ...]]:
    if not query(url, "SHOW TABLES LIKE %s", table):
        return []
    return query(
        url, f"SELECT state, fencing_token FROM `{table}` WHERE `key` LIKE %s", f"%order:{order}%"
    )


def test_orm_writes_commit_with_the_record_and_a_kill_leaves_no_partial_rows(
    django_setup: dict[str, Any], mysql_url: str, redis_url: str
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
    assert _rows(mysql_url, table, order) == {}
    assert _record(mysql_url, table, order) == []
    assert victim in worker.child_pids()
    worker.kill_child(victim)
    value = result.get(timeout=60)
    # The rerun saw only its own rows: the killed run's were rolled back with its claim.
    assert value == {"order": order, "run": 2, "seen": ROWS}
    rows = _rows(mysql_url, table, order)
    assert sum(rows.values()) == ROWS
    assert victim not in rows
    assert [state for state, _ in _record(mysql_url, table, order)] == ["completed"]
    duplicate = app.send_task("djworker.charge", (order, ROWS, 60.0), queue=queue)
    assert duplicate.get(timeout=30) == value
    assert sum(_rows(mysql_url, table, order).values()) == ROWS


def test_a_body_that_raises_leaves_neither_rows_nor_record(
    django_setup: dict[str, Any], mysql_url: str
) -> None:
    table, app = django_setup["table"], django_setup["app"]
    queue = django_setup["env"]["DJ_QUEUE"]
    order = f"f-{uuid.uuid4().hex[:6]}"
    result = app.send_task("djworker.charge", (order, ROWS, 0.0, True), queue=queue)
    with pytest.raises(Exception, match="card declined") as caught:
        result.get(timeout=60)
    assert type(caught.value).__name__ == "ValueError"
    assert _rows(mysql_url, table, order) == {}
    assert _record(mysql_url, table, order) == []
