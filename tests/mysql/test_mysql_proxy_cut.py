"""A TCP proxy cut between a worker and MySQL mid-body: rolled back; the next holder runs once.

Worker A reaches MySQL through a :class:`TcpProxy`; its body inserts payment rows through
``current_connection()`` and stalls. The test cuts the proxy (every proxied connection closed,
new ones refused): the server sees the socket close and rolls A's transaction back, rows and
claim together. A duplicate delivered to worker B (direct connection) then claims the key,
runs the body once and commits. A's body, when it returns, finds its transaction gone and
commits nothing (``LockLostError``). Only B's rows are committed, once.
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

from tests.support.proxy import TcpProxy
from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker

HERE = Path(__file__).resolve().parent
ROWS = 3

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.slow]


def test_cut_mid_body_rolls_back_and_the_next_holder_runs_once(
    mysql_url: str, redis_url: str, my_table: str
) -> None:
    query(mysql_url, f"CREATE TABLE `{my_table}_payments` (order_id VARCHAR(64), n INT, pid INT)")
    queues = [f"qa-{uuid.uuid4().hex[:8]}", f"qb-{uuid.uuid4().hex[:8]}"]
    base = {"MY_BROKER_URL": redis_url, "MY_DATA_URL": mysql_url, "MY_TABLE": my_table}
    marks = redis.Redis.from_url(redis_url)
    order = f"o-{uuid.uuid4().hex[:6]}"
    with TcpProxy(mysql_url) as proxy:
        env_a = {**base, "MY_IDEMPOTENCY_URL": proxy.url, "MY_QUEUE": queues[0]}
        env_b = {**base, "MY_IDEMPOTENCY_URL": mysql_url, "MY_QUEUE": queues[1]}
        os.environ.update(env_b)
        sys.path.insert(0, str(HERE))
        import my_app

        importlib.reload(my_app)
        worker_a = CeleryWorker(
            "my_app", pool="prefork", concurrency=1, queues=[queues[0]], env=env_a,
            pythonpath=[HERE],
        )  # fmt: skip
        worker_b = CeleryWorker(
            "my_app", pool="prefork", concurrency=1, queues=[queues[1]], env=env_b,
            pythonpath=[HERE],
        )  # fmt: skip
        with worker_a, worker_b:
            worker_a.start(wait=False)
            worker_b.start(wait=False)
            worker_a.wait_ready()
            worker_b.wait_ready()
            first = my_app.pay.apply_async((order, ROWS, 4.0), queue=queues[0])
            pid_a = int(wait_for(lambda: marks.get(f"{my_table}:inserted:{order}:1"), 30, what="A"))
            proxy.cut()
            # A duplicate message, as a broker redelivery would bring it (the publish side
            # would otherwise hand back the first call's result: it is still queued).
            second = my_app.pay.apply_async(
                (order, ROWS, 4.0), queue=queues[1], idempotency_on_duplicate_publish="publish"
            )
            value = second.get(timeout=60)
            assert value == {"order": order, "run": 2}
            with pytest.raises(Exception) as caught:
                first.get(timeout=60)
            assert type(caught.value).__name__ in {"LockLostError", "CommitUnknownError"}
            proxy.resume()
            # Every later delivery replays B's result, through either worker.
            again = my_app.pay.apply_async((order, ROWS, 4.0), queue=queues[0])
            assert again.get(timeout=60) == value
    rows = dict(
        query(
            mysql_url,
            f"SELECT pid, count(*) FROM `{my_table}_payments` WHERE order_id = %s GROUP BY pid",
            order,
        )
    )
    assert pid_a not in rows
    assert sum(rows.values()) == ROWS
    assert int(marks.get(f"{my_table}:runs:{order}") or 0) == 2  # A's (rolled back) and B's
