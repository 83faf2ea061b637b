"""The Celery app of ``test_postgres_every_pool.py``, configured from the environment.

``PG_BROKER_URL`` (Redis: broker, result backend and the test's marks), ``PG_IDEMPOTENCY_URL``
(a ``postgresql://`` URL with its ``table`` and ``lock_timeout``), ``PG_DATA_URL`` (the same
database, for a body's side connection), ``PG_TABLE`` (payments go to ``<PG_TABLE>_payments``).

Every body inserts its payment row through ``current_connection()`` and marks, in Redis, how
often it ran, how many bodies of its worker ran at once, and whether another running body held
the same PostgreSQL session (``pg_backend_pid()``) at the same time.
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

app = Celery("pg_pool_app", broker=BROKER, backend=BROKER)
app.conf.update(
    idempotency_url=os.environ["PG_IDEMPOTENCY_URL"],
    idempotency_lock_ttl=2,
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)

_marks: Any = None


def marks() -> Any:
    global _marks  # noqa: PLW0603 - one client per worker process
    if _marks is None:
        _marks = redis.Redis.from_url(BROKER)
    return _marks


def _mark(kind: str, tag: str, x: Any) -> str:
    return f"{TABLE}:{kind}:{tag}:{x}"


def _body(kind: str, tag: str, x: Any, stall: float) -> dict[str, Any]:
    """Count the run, insert the payment row through the guard's connection, stall."""
    m = marks()
    run = int(m.incr(_mark(kind, "runs", f"{tag}:{x}")))
    conn = current_connection()
    assert conn is not None, "no current_connection() in a body guarded by PostgreSQL"
    backend = conn.execute(
        f"INSERT INTO {PAYMENTS} (tag, kind, x, run, pid, backend) "
        "VALUES (%s, %s, %s, %s, %s, pg_backend_pid()) RETURNING backend",
        (tag, kind, str(x), run, os.getpid()),
    ).fetchone()[0]
    # One PostgreSQL session per running body: a session already in the set is shared.
    active = f"{TABLE}:active:{tag}"
    if not m.sadd(active, backend):
        m.incr(f"{TABLE}:shared:{tag}")
    now = int(m.incr(f"{TABLE}:running:{tag}"))
    m.eval(
        "if tonumber(redis.call('get', KEYS[1]) or '0') < tonumber(ARGV[1]) then "
        "redis.call('set', KEYS[1], ARGV[1]) end",
        1,
        f"{TABLE}:most:{tag}",
        now,
    )
    try:
        time.sleep(stall)
    finally:
        m.decr(f"{TABLE}:running:{tag}")
        m.srem(active, backend)
    return {"kind": kind, "x": x, "run": run, "pid": os.getpid(), "backend": backend}


@app.task(base=IdempotentTask, shared=False)
def pay(tag: str, x: int, stall: float) -> dict[str, Any]:
    """Key from the arguments."""
    return _body("pay", tag, x, stall)


@app.task(base=IdempotentTask, idempotency_key="task_id", shared=False)
def pay_by_id(tag: str, x: int, stall: float) -> dict[str, Any]:
    """Key from the task id."""
    return _body("pay_by_id", tag, x, stall)


@app.task(base=IdempotentTask, shared=False)
def hold(tag: str, patience: float) -> dict[str, Any]:
    """Hold the key's row until a duplicate's claim waits on it (seen from the server), at
    most ``patience`` seconds.

    The duplicate's claim blocks in a psycopg wait until this transaction ends. Under gevent
    or eventlet this body can see that wait only if the wait yields to the event loop: a wait
    that blocks the loop (a C ``poll``) freezes this body until the claim gives up after
    ``lock_timeout``, and by then nobody waits any more.
    """
    m = marks()
    run = int(m.incr(_mark("hold", "runs", tag)))
    conn = current_connection()
    assert conn is not None
    me = conn.execute(
        f"INSERT INTO {PAYMENTS} (tag, kind, x, run, pid, backend) "
        "VALUES (%s, 'hold', '0', %s, %s, pg_backend_pid()) RETURNING backend",
        (tag, run, os.getpid()),
    ).fetchone()[0]
    m.set(_mark("hold", "started", tag), me)
    seen = False
    with psycopg.connect(os.environ["PG_DATA_URL"], autocommit=True) as side:
        deadline = time.monotonic() + patience
        while time.monotonic() < deadline:
            row = side.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE %s = ANY(pg_blocking_pids(pid))",
                (me,),
            ).fetchone()
            if row is not None and row[0] > 0:
                seen = True
                break
            time.sleep(0.01)
    return {"kind": "hold", "run": run, "pid": os.getpid(), "saw_waiter": seen}
