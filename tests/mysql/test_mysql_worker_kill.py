"""A real worker SIGKILLed after its body inserted rows: MySQL vs Redis, side by side.

The body inserts 3 payment rows, then stalls on its first run; the test SIGKILLs the prefork
child right then. ``task_acks_late`` + ``task_reject_on_worker_lost`` redeliver the message and
the body runs again. With the MySQL backend the rows went through
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

import pytest
import redis
from mysql_support import query

from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

HERE = Path(__file__).resolve().parent
ROWS = 3

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


@pytest.mark.parametrize("backend", ["mysql", "redis"])
def test_sigkill_after_insert(backend: str, mysql_url: str, redis_url: str, my_table: str) -> None:
    query(mysql_url, f"CREATE TABLE `{my_table}_payments` (order_id VARCHAR(64), n INT, pid INT)")
    queue = f"q-{uuid.uuid4().hex[:8]}"
    idem_url = mysql_url if backend == "mysql" else redis_url
    env = {
        "MY_BROKER_URL": redis_url,
        "MY_IDEMPOTENCY_URL": idem_url,
        "MY_DATA_URL": mysql_url,
        "MY_TABLE": my_table,
        "MY_QUEUE": queue,
    }
    os.environ.update(env)  # the test process loads the same app as the worker
    sys.path.insert(0, str(HERE))
    import my_app

    importlib.reload(my_app)
    marks = redis.Redis.from_url(redis_url)
    order = f"o-{uuid.uuid4().hex[:6]}"
    with CeleryWorker(
        "my_app", pool="prefork", concurrency=1, queues=[queue], env=env, pythonpath=[HERE]
    ) as worker:
        worker.start()
        result = my_app.pay.apply_async((order, ROWS, 60.0), queue=queue)
        victim = int(
            wait_for(lambda: marks.get(f"{my_table}:inserted:{order}:1"), 30, what="insert")
        )
        assert victim in worker.child_pids()
        worker.kill_child(victim)
        value = result.get(timeout=60)
        assert value == {"order": order, "run": 2}
        # a duplicate delivery replays the stored result
        assert my_app.pay.apply_async((order, ROWS, 60.0), queue=queue).get(timeout=30) == value
    rows = query(
        mysql_url,
        f"SELECT pid, count(*) FROM `{my_table}_payments` WHERE order_id = %s GROUP BY pid",
        order,
    )
    by_pid = dict(rows)
    if backend == "mysql":
        # one committed set of rows, from the run that completed; none from the killed child
        assert sum(by_pid.values()) == ROWS
        assert victim not in by_pid
    else:
        # the killed run's rows stayed, and the rerun wrote its own: the duplicate
        assert sum(by_pid.values()) == 2 * ROWS
        assert by_pid[victim] == ROWS
