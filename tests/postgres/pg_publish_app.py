"""The app of the PostgreSQL publish-side worker test: a Redis broker (``PGP_BROKER_URL``)
whose queue (``PGP_QUEUE``) the test counts, keys in PostgreSQL (``PGP_IDEMPOTENCY_URL``);
bodies count their runs in Redis."""

from __future__ import annotations

import os

import redis
from celery import Celery

from celery_idempotent import IdempotentTask

BROKER = os.environ["PGP_BROKER_URL"]
QUEUE = os.environ["PGP_QUEUE"]

app = Celery("pg_publish_app", broker=BROKER, backend=BROKER, set_as_current=False)
app.conf.update(
    idempotency_url=os.environ["PGP_IDEMPOTENCY_URL"],
    task_default_queue=QUEUE,
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)


def bump(*parts: str) -> int:
    client = redis.Redis.from_url(BROKER)
    try:
        return int(client.incr(f"{QUEUE}:runs:" + ":".join(parts)))
    finally:
        client.close()


@app.task(base=IdempotentTask, shared=False, name="pgp.charge", idempotency_key="order:{order}")
def charge(order: str, amount: int) -> dict[str, object]:
    return {"order": order, "amount": amount, "run": bump("charge", order)}


@app.task(base=IdempotentTask, shared=False, name="pgp.fails")
def fails(tag: str) -> None:
    bump("fails", tag)
    raise ValueError(f"{tag} failed")
