"""The Celery app of the MySQL worker tests, configured from the environment.

``MY_BROKER_URL`` (Redis: broker and result backend), ``MY_IDEMPOTENCY_URL`` (a ``mysql://``
URL, or a ``redis://`` one for the comparison), ``MY_DATA_URL`` (where the payments table
lives), ``MY_TABLE`` (the idempotency table; payments go to ``<MY_TABLE>_payments``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import pymysql
import redis
from celery import Celery

from celery_idempotent import IdempotentTask, current_connection
from celery_idempotent.backends.mysql.connections import connect_args

BROKER = os.environ["MY_BROKER_URL"]
TABLE = os.environ["MY_TABLE"]
PAYMENTS = f"`{TABLE}_payments`"

app = Celery("my_app", broker=BROKER, backend=BROKER)
app.conf.update(
    idempotency_url=os.environ["MY_IDEMPOTENCY_URL"],
    idempotency_lock_ttl=2,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("MY_QUEUE", "celery"),
)


@app.task(base=IdempotentTask, idempotency_key="order:{order_id}", shared=False)
def pay(order_id: str, rows: int, stall: float) -> dict[str, Any]:
    """Insert ``rows`` payment rows for the order, then (first run only) stall ``stall`` s.

    Under the MySQL backend the rows go through ``current_connection()``; under any other
    backend through a connection of the body's own, committed at once.
    """
    marks = redis.Redis.from_url(BROKER)
    run = marks.incr(f"{TABLE}:runs:{order_id}")
    conn = current_connection()
    own = None
    if conn is None:
        own = conn = pymysql.connect(**connect_args(os.environ["MY_DATA_URL"]), autocommit=True)
    try:
        with conn.cursor() as cur:
            for index in range(rows):
                cur.execute(
                    f"INSERT INTO {PAYMENTS} (order_id, n, pid) VALUES (%s, %s, %s)",
                    (order_id, index, os.getpid()),
                )
    finally:
        if own is not None:
            own.close()
    marks.set(f"{TABLE}:inserted:{order_id}:{run}", os.getpid())
    if run == 1:
        time.sleep(stall)  # killed (or cut off) here by the test
    return {"order": order_id, "run": run}
