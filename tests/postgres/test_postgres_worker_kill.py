"""A real worker SIGKILLed after its body inserted rows: PostgreSQL vs Redis, side by side.

The body inserts 3 payment rows, then stalls on its first run; the test SIGKILLs the prefork
child right then. ``task_acks_late`` + ``task_reject_on_worker_lost`` redeliver the message and
the body runs again. With the PostgreSQL backend the rows went through
``current_connection()``: the kill rolled them back with the claim, so exactly one set of rows
is committed. With the Redis backend the same body writes through its own connection: the
killed run's rows stay, and the rerun adds another set (the duplicate this backend fixes).
"""

from __future__ import annotations

import importlib
import os
import sys
import uuid
from pathlib import Path

import psycopg
import pytest
import redis

from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

HERE = Path(__file__).resolve().parent
ROWS = 3

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.mark.parametrize("backend", ["postgres", "redis"])
def test_sigkill_after_insert(
    backend: str, postgres_url: str, redis_url: str, pg_table: str
) -> None:
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        conn.execute(f'CREATE TABLE "{pg_table}_payments" (order_id text, n int, pid int)')
    queue = f"q-{uuid.uuid4().hex[:8]}"
    idem_url = postgres_url if backend == "postgres" else redis_url
    env = {
        "PG_BROKER_URL": redis_url,
        "PG_IDEMPOTENCY_URL": idem_url,
        "PG_DATA_URL": postgres_url,
        "PG_TABLE": pg_table,
        "PG_QUEUE": queue,
    }
    os.environ.update(env)  # the test process loads the same app as the worker
    sys.path.insert(0, str(HERE))
    import pg_app

    importlib.reload(pg_app)
    marks = redis.Redis.from_url(redis_url)
    order = f"o-{uuid.uuid4().hex[:6]}"
    with CeleryWorker(
        "pg_app", pool="prefork", concurrency=1, queues=[queue], env=env, pythonpath=[HERE]
    ) as worker:
        worker.start()
        result = pg_app.pay.apply_async((order, ROWS, 60.0), queue=queue)
        victim = int(
            wait_for(lambda: marks.get(f"{pg_table}:inserted:{order}:1"), 30, what="insert")
        )
        assert victim in worker.child_pids()
        worker.kill_child(victim)
        value = result.get(timeout=60)
        assert value == {"order": order, "run": 2}
        # a duplicate delivery replays the stored result
        assert pg_app.pay.apply_async((order, ROWS, 60.0), queue=queue).get(timeout=30) == value
    with psycopg.connect(postgres_url, autocommit=True) as conn:
        rows = conn.execute(
            f'SELECT pid, count(*) FROM "{pg_table}_payments" WHERE order_id = %s GROUP BY pid',
            (order,),
        ).fetchall()
    by_pid = dict(rows)
    if backend == "postgres":
        # one committed set of rows, from the run that completed; none from the killed child
        assert sum(by_pid.values()) == ROWS
        assert victim not in by_pid
    else:
        # the killed run's rows stayed, and the rerun wrote its own: the duplicate
        assert sum(by_pid.values()) == 2 * ROWS
        assert by_pid[victim] == ROWS
