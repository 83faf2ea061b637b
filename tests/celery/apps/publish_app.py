"""The app of the publish-side tests (issue 12): a Redis broker whose queue the tests can count.

Configured from the environment, like ``cidem_app``: ``PUB_REDIS_URL`` (broker, result backend,
idempotency store), ``PUB_PREFIX`` (every key of the session: kombu's, the results', ours),
``PUB_QUEUE`` (the default queue). ``PUB_BEAT`` set: a ``beat_schedule`` of ``pub.tick`` every
``PUB_BEAT`` seconds (with ``idempotency_window`` = that period unless ``PUB_NO_WINDOW``).
Bodies count their runs in Redis (``INCR``), so the tests see how often each one really ran.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery

from celery_idempotent import IdempotentTask

app = Celery("publish_app", set_as_current=False)
PREFIX = os.environ.get("PUB_PREFIX", "test:pub:")
URL = os.environ.get("PUB_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("PUB_QUEUE", "pub")
BEAT = float(os.environ.get("PUB_BEAT") or 0)
WINDOW = None if os.environ.get("PUB_NO_WINDOW") else (BEAT or None)

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
    idempotency_key_prefix=f"{PREFIX}idem:",
    beat_schedule_filename=os.environ.get("PUB_BEAT_FILE", f"/tmp/{PREFIX.strip(':')}-beat"),
)
if BEAT:
    app.conf.beat_schedule = {"tick": {"task": "pub.tick", "schedule": BEAT}}

_clients: dict[int, redis.Redis] = {}


def client() -> redis.Redis:
    found = _clients.get(os.getpid())
    if found is None:
        found = _clients[os.getpid()] = redis.Redis.from_url(URL)
    return found


def bump(*parts: Any) -> int:
    return int(client().incr(PREFIX + "fx:" + ":".join(map(str, parts))))


def count(*parts: Any) -> int:
    return int(client().get(PREFIX + "fx:" + ":".join(map(str, parts))) or 0)


@app.task(base=IdempotentTask, shared=False, name="pub.charge")
def charge(tag: str, amount: int) -> dict[str, Any]:
    """Keyed by its arguments."""
    return {"tag": tag, "amount": amount, "run": bump("charge", tag)}


@app.task(base=IdempotentTask, shared=False, name="pub.ship", idempotency_key="order:{order_id}")
def ship(order_id: str, address: str, hold: float = 0.0) -> str:
    """Keyed by the order: the same order to another address is a mismatch."""
    bump("ship", order_id)
    time.sleep(hold)
    return f"{order_id} to {address}"


@app.task(base=IdempotentTask, shared=False, name="pub.flaky", bind=True, max_retries=3)
def flaky(self: Any, tag: str) -> str:
    """Retries itself once (``self.retry()`` republishes with its own task id)."""
    if bump("flaky", tag) == 1:
        raise self.retry(countdown=0.2)
    return f"{tag} after {self.request.retries} retry"


@app.task(base=IdempotentTask, shared=False, name="pub.fails")
def fails(tag: str) -> None:
    """Fails for good: its queued marker ends with it."""
    bump("fails", tag)
    raise ValueError(f"{tag} failed")


@app.task(base=IdempotentTask, shared=False, name="pub.add")
def add(x: int, y: int) -> int:
    bump("add", x, y)
    return x + y


@app.task(base=IdempotentTask, shared=False, name="pub.total")
def total(values: list[int]) -> int:
    return sum(values)


@app.task(
    base=IdempotentTask,
    shared=False,
    name="pub.tick",
    idempotency_window=WINDOW,
    idempotency_ttl=120,
)
def tick() -> str:
    """The periodic task: records the slot of each run."""
    from celery_idempotent.celery.task import SLOT_HEADER

    request = tick.request
    headers = getattr(request, "headers", None) or {}
    slot = headers.get(SLOT_HEADER) or getattr(request, SLOT_HEADER, None) or "none"
    client().rpush(PREFIX + "fx:ticks", f"{slot}|{time.time():.3f}")
    return str(slot)


@app.task(shared=False, name="pub.fan_out")
def fan_out(tag: str, n: int, queue: str, rounds: int = 3) -> list[list[str]]:
    """Publishes, from inside a running task, ``charge((tag, 0))`` (the same call in every
    ``fan_out``) and ``charge((f"{tag}-{n}-{i}", 0))`` (its own calls), sleeping between them
    so that concurrent greenlets or threads interleave; returns ``[args tag, task id]`` pairs."""
    got: list[list[str]] = []
    for i in range(rounds):
        for own in (tag, f"{tag}-{n}-{i}"):
            got.append([own, charge.apply_async((own, 0), queue=queue).id])
            time.sleep(0.005)
    return got
