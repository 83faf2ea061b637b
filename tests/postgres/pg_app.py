"""The Celery app of the PostgreSQL worker tests, configured from the environment.

``PG_BROKER_URL`` (Redis: broker and result backend), ``PG_IDEMPOTENCY_URL`` (a
``postgresql://`` URL, or a ``redis://`` one for the comparison), ``PG_DATA_URL`` (where the
payments table lives), ``PG_TABLE`` (the idempotency table; payments go to
``<PG_TABLE>_payments``).
"""

from __future__ import annotations

import os
import time
from typing import Any

import psycopg
import redis
from celery import Celery

from celery_idempotent import IdempotentTask, current_connection

BROKER = os.environ["PG_BROKER_URL"]
TABLE = os.environ["PG_TABLE"]
PAYMENTS = f'"{TABLE}_payments"'

app = Celery("pg_app", broker=BROKER, backend=BROKER)
app.conf.update(
    idempotency_url=os.environ["PG_IDEMPOTENCY_URL"],
    idempotency_lock_ttl=2,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    task_default_queue=os.environ.get("PG_QUEUE", "celery"),
)


def _marks() -> Any:
    return redis.Redis.from_url(BROKER)


@app.task(base=IdempotentTask, idempotency_key="order:{order_id}", shared=False)
def pay(order_id: str, rows: int, stall: float) -> dict[str, Any]:
    """Insert ``rows`` payment rows for the order, then (first run only) stall ``stall`` s.

    Under the PostgreSQL backend the rows go through ``current_connection()``; under any other
    backend through a connection of the body's own, committed at once (what a body does today).
    """
    marks = _marks()
    run = marks.incr(f"{TABLE}:runs:{order_id}")
    conn = current_connection()
    own = None
    if conn is None:
        own = conn = psycopg.connect(os.environ["PG_DATA_URL"], autocommit=True)
    try:
        for index in range(rows):
            conn.execute(
                f"INSERT INTO {PAYMENTS} (order_id, n, pid) VALUES (%s, %s, %s)",
                (order_id, index, os.getpid()),
            )
    finally:
        if own is not None:
            own.close()
    marks.set(f"{TABLE}:inserted:{order_id}:{run}", os.getpid())
    if run == 1:
        time.sleep(stall)  # killed here by the test
    return {"order": order_id, "run": run}
