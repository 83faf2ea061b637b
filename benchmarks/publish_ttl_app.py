"""The Celery app of ``python -m benchmarks.publish_ttl``: what a queued marker has to outlive.

Configured from the environment: ``PT_REDIS_URL`` (result backend and idempotency store: the
run's private server), ``PT_BROKER_URL`` (Redis or RabbitMQ; default: the Redis),
``PT_VISIBILITY`` (kombu's Redis ``visibility_timeout``, seconds) and ``PT_ACKS_LATE``
(``1``: ``task_acks_late``). Bodies note when each run started (``time.time()`` in a Redis
list per tag), so the script sees a message's queue time and redelivery delay from outside.
"""

from __future__ import annotations

import os
import time

import redis
from celery import Celery

from celery_idempotent import IdempotentTask

URL = os.environ.get("PT_REDIS_URL", "redis://127.0.0.1:6379/0")
BROKER = os.environ.get("PT_BROKER_URL") or URL
PREFIX = "pt:"

app = Celery("publish_ttl_app", broker=BROKER, backend=URL, set_as_current=False)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=1,
    task_acks_late=os.environ.get("PT_ACKS_LATE") == "1",
    task_reject_on_worker_lost=os.environ.get("PT_ACKS_LATE") == "1",
    idempotency_url=URL,
    idempotency_key_prefix=f"{PREFIX}idem:",
    idempotency_lock_ttl=2,
)
if BROKER.startswith("redis"):
    app.conf.broker_transport_options = {
        "visibility_timeout": float(os.environ.get("PT_VISIBILITY", "3600")),
        # kombu scans for messages past their visibility timeout every interval x throttle
        # seconds (10 x 10 by default): every second here, so the figure is the timeout's.
        "unacked_restore_interval": 1,
        "unacked_restore_throttle": 1,
    }

_client: redis.Redis | None = None


def client() -> redis.Redis:
    global _client  # noqa: PLW0603 - one client per process
    if _client is None:
        _client = redis.Redis.from_url(URL)
    return _client


def started(tag: str) -> list[float]:
    """When each run of ``tag`` started (``time.time()``), in order."""
    return [float(x) for x in client().lrange(PREFIX + "start:" + tag, 0, -1)]


@app.task(base=IdempotentTask, shared=False, name="pt.noop")
def noop(tag: str) -> str:
    client().rpush(PREFIX + "start:" + tag, time.time())
    return tag


@app.task(base=IdempotentTask, shared=False, name="pt.sleeps_once")
def sleeps_once(tag: str) -> str:
    """Sleeps a minute on its first run (to be killed there), returns at once on later ones."""
    run = client().rpush(PREFIX + "start:" + tag, time.time())
    if run == 1:
        time.sleep(60)
    return f"{tag}:run {run}"
