"""A TCP proxy cut between a worker and its SQL database mid-body: rolled back; the next holder
runs once. Run against PostgreSQL (``tests/postgres/test_postgres_proxy_cut.py``) and MySQL /
MariaDB (``tests/mysql/test_mysql_proxy_cut.py``), whose conftests give the ``sql_side``
(``tests/support/sql_side.py``) and ``sql_table``.

Worker A reaches the database through a :class:`TcpProxy`; its body inserts payment rows
through ``current_connection()`` and stalls. The test cuts the proxy (every proxied connection
closed, new ones refused): the server sees the socket close and rolls A's transaction back,
rows and claim together. A duplicate delivered to worker B (direct connection) then claims the
key, runs the body once and commits. A's body, when it returns, finds its transaction gone and
commits nothing (``LockLostError``). Only B's rows are committed, once.
"""

from __future__ import annotations

import importlib
import os
import sys
import uuid

import pytest
import redis

from tests.support.proxy import TcpProxy
from tests.support.sql_side import SqlSide
from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

ROWS = 3


def test_cut_mid_body_rolls_back_and_the_next_holder_runs_once(
    sql_side: SqlSide, redis_url: str, sql_table: str
) -> None:
    table = sql_table
    sql_side.query(
        f"CREATE TABLE {sql_side.payments(table)} (order_id VARCHAR(64), n INT, pid INT)"
        + sql_side.table_options
    )
    queues = [f"qa-{uuid.uuid4().hex[:8]}", f"qb-{uuid.uuid4().hex[:8]}"]
    marks = redis.Redis.from_url(redis_url)
    order = f"o-{uuid.uuid4().hex[:6]}"
    with TcpProxy(sql_side.url) as proxy:
        env_a = sql_side.app_env(redis_url, proxy.url, table, queues[0])
        env_b = sql_side.app_env(redis_url, sql_side.url, table, queues[1])
        os.environ.update(env_b)
        sys.path.insert(0, str(sql_side.app_dir))
        worker_app = importlib.reload(importlib.import_module(sql_side.app))
        worker_a = CeleryWorker(
            sql_side.app, pool="prefork", concurrency=1, queues=[queues[0]], env=env_a,
            pythonpath=[sql_side.app_dir],
        )  # fmt: skip
        worker_b = CeleryWorker(
            sql_side.app, pool="prefork", concurrency=1, queues=[queues[1]], env=env_b,
            pythonpath=[sql_side.app_dir],
        )  # fmt: skip
        with worker_a, worker_b:
            worker_a.start(wait=False)
            worker_b.start(wait=False)
            worker_a.wait_ready()
            worker_b.wait_ready()
            first = worker_app.pay.apply_async((order, ROWS, 4.0), queue=queues[0])
            pid_a = int(wait_for(lambda: marks.get(f"{table}:inserted:{order}:1"), 30, what="A"))
            proxy.cut()
            # A duplicate message, as a broker redelivery would bring it (the publish side
            # would otherwise hand back the first call's result: it is still queued).
            second = worker_app.pay.apply_async(
                (order, ROWS, 4.0), queue=queues[1], idempotency_on_duplicate_publish="publish"
            )
            value = second.get(timeout=60)
            assert value == {"order": order, "run": 2}
            with pytest.raises(Exception) as caught:
                first.get(timeout=60)
            assert type(caught.value).__name__ in {"LockLostError", "CommitUnknownError"}
            proxy.resume()
            # Every later delivery replays B's result, through either worker.
            again = worker_app.pay.apply_async((order, ROWS, 4.0), queue=queues[0])
            assert again.get(timeout=60) == value
    rows = sql_side.paid(table, order)
    assert pid_a not in rows
    assert sum(rows.values()) == ROWS
    assert int(marks.get(f"{table}:runs:{order}") or 0) == 2  # A's (rolled back) and B's
