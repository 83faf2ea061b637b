"""The payment task of ``python -m example_project --backend postgres|mysql`` (``celery -A``).

Configured from the environment (``PGSHOP_*``) by :mod:`example_project.demo.postgres`. The body
inserts one payment row, then waits ``PGSHOP_LATENCY`` seconds (the card network), during which
the demo may SIGKILL the pool process.

- On the PostgreSQL or MySQL backend the row goes through ``current_connection()``: it commits
  with the idempotency record, or is rolled back with it. ``PGSHOP_DATA_URL`` says which
  database holds the payments (``postgresql://`` or ``mysql://``).
- On the Redis backend the body writes through a connection of its own, committed at once: what
  a body does today without this backend. A killed run's row stays, and the rerun adds another.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_idempotent import IdempotentTask, current_connection

BROKER = os.environ.get("PGSHOP_BROKER_URL", "redis://127.0.0.1:6379/0")
PAYMENTS = os.environ.get("PGSHOP_PAYMENTS", "payments")
DATA_URL = os.environ.get("PGSHOP_DATA_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
LATENCY = float(os.environ.get("PGSHOP_LATENCY", "0.3"))

app = Celery("pgshop", broker=BROKER, backend=os.environ.get("PGSHOP_RESULT_BACKEND", BROKER))
app.conf.update(
    idempotency_url=os.environ.get("PGSHOP_IDEMPOTENCY_URL", DATA_URL),
    idempotency_key_prefix=os.environ.get("PGSHOP_PREFIX", "idempotency:"),
    # A killed pool process's Redis lease runs out after this; a PostgreSQL claim ends at once.
    idempotency_lock_ttl=2,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    task_default_queue=os.environ.get("PGSHOP_QUEUE", "pgshop"),
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
)

_own: dict[int, Any] = {}

MYSQL = DATA_URL.startswith("mysql://")
if not MYSQL:
    import psycopg


def _connection() -> Any:
    """The body's transaction (a SQL backend), else this process's own autocommit one."""
    conn = current_connection()
    if conn is not None:
        return conn
    pid = os.getpid()
    if pid not in _own:
        if MYSQL:
            import pymysql

            from celery_idempotent.backends.mysql.connections import connect_args

            _own[pid] = pymysql.connect(**connect_args(DATA_URL), autocommit=True)
        else:
            _own[pid] = psycopg.connect(DATA_URL, autocommit=True)
    return _own[pid]


@app.task(base=IdempotentTask, idempotency_key="payment:{order_id}")
def charge(order_id: int, amount: int) -> dict[str, Any]:
    """Charge an order once: one payment row per order is the goal."""
    row = (order_id, amount, os.getpid())
    if MYSQL:
        with _connection().cursor() as cur:
            cur.execute(
                f"INSERT INTO `{PAYMENTS}` (order_id, amount, pid) VALUES (%s, %s, %s)",  # noqa: S608
                row,
            )
    else:
        _connection().execute(
            f'INSERT INTO "{PAYMENTS}" (order_id, amount, pid) VALUES (%s, %s, %s)',  # noqa: S608
            row,
        )
    # Tell the demo this pool process is mid-body (its row written, not yet committed).
    redis.Redis.from_url(BROKER).rpush(f"{PAYMENTS}:charging", f"{os.getpid()}:{order_id}")
    time.sleep(LATENCY)
    return {"order": order_id, "amount": amount, "charged_by": os.getpid()}
