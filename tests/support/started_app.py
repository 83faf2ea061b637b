"""The app of the real-worker tests of ``idempotency_publish_until="started"`` on the SQL
backends (``tests/support/sql_started_workers.py``).

Configured from the environment: ``ST_REDIS_URL`` (broker, result backend, the bodies' side
effects), ``ST_IDEMPOTENCY_URL`` (the PostgreSQL or MySQL store under test, its table in the
URL), ``ST_PREFIX`` (every Redis name of the session), ``ST_QUEUE`` (the default queue). Bodies
count their runs in Redis (``INCR``) and log when they ran (``RPUSH`` of ``start|end``), so a
test sees how often and whether two ever overlapped.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_idempotent import IdempotentTask

app = Celery("started_app", set_as_current=False)
PREFIX = os.environ.get("ST_PREFIX", "test:st:")
URL = os.environ.get("ST_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("ST_QUEUE", "st")

app.conf.update(
    broker_url=URL,
    result_backend=URL,
    task_default_queue=QUEUE,
    broker_transport_options={"global_keyprefix": f"{PREFIX}kombu:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}celery:"},
    result_expires=600,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    idempotency_url=os.environ.get("ST_IDEMPOTENCY_URL", ""),
    idempotency_key_prefix=f"{PREFIX}idem:",
    # A duplicate delivery re-queued while the first runs comes back soon.
    idempotency_retry_count=1,
    idempotency_retry_base_delay=0.05,
)

_clients: dict[int, redis.Redis] = {}


def client() -> redis.Redis:
    found = _clients.get(os.getpid())
    if found is None:
        found = _clients[os.getpid()] = redis.Redis.from_url(URL)
    return found


def fx(*parts: Any) -> str:
    return PREFIX + "fx:" + ":".join(map(str, parts))


def count(*parts: Any) -> int:
    return int(client().get(fx(*parts)) or 0)


def runs(*parts: Any) -> list[tuple[float, float]]:
    """``(start, end)`` of every run of the body ``parts`` names, in the order they ended."""
    got = client().lrange(fx("log", *parts), 0, -1)
    return [(float(a), float(b)) for a, b in (item.decode().split("|") for item in got)]


def _body(parts: tuple[Any, ...], hold: float) -> int:
    start = time.time()
    run = int(client().incr(fx(*parts)))
    time.sleep(hold)
    client().rpush(fx("log", *parts), f"{start:.6f}|{time.time():.6f}")
    return run


@app.task(
    base=IdempotentTask,
    shared=False,
    name="st.once_at_a_time",
    idempotency_ttl=0,
    idempotency_publish_until="started",
)
def once_at_a_time(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """One call running and at most one more queued; nothing remembered afterwards."""
    return {"tag": tag, "run": _body(("ubr", tag), hold)}


@app.task(
    base=IdempotentTask,
    shared=False,
    name="st.remembers",
    idempotency_publish_until="started",
)
def remembers(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """``idempotency_publish_until="started"`` with the default ``idempotency_ttl``."""
    return {"tag": tag, "run": _body(("sr", tag), hold)}


@app.task(
    base=IdempotentTask,
    shared=False,
    name="st.windowed",
    idempotency_ttl=0,
    idempotency_publish_until="started",
    idempotency_window=600,
)
def windowed(tag: str, hold: float = 0.0) -> dict[str, Any]:
    """The mode with a schedule slot: the slot is part of the key."""
    return {"tag": tag, "run": _body(("win", tag), hold)}
