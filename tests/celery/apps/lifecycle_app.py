"""The app of the life-cycle matrix (issue 22, SPEC §8): one task per way a message can end.

Configured from the environment: ``LC_REDIS_URL`` (result backend, idempotency store),
``LC_BROKER_URL`` (Redis or RabbitMQ; default: the Redis), ``LC_PREFIX`` (every key of the
run), ``LC_QUEUE`` (the default queue), ``LC_ACKS``: ``early`` (Celery's default), ``late``
(``task_acks_late``) or ``late_reject`` (``task_acks_late`` + ``task_reject_on_worker_lost``).
Bodies count their runs in Redis (``INCR``), so the tests see how often each one really ran.
``LC_IDEM_URL``: the idempotency backend (default: the Redis; a ``postgresql://`` URL
runs the matrix on PostgreSQL). ``LC_VISIBILITY``: kombu's Redis ``visibility_timeout``
(3600 s unless set).
``lock_ttl`` is short (2 s) so that "free within lock_ttl" is quick to see.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Celery
from celery.exceptions import Ignore, MaxRetriesExceededError, Reject

from celery_idempotent import IdempotentTask

URL = os.environ.get("LC_REDIS_URL", "redis://127.0.0.1:6379/0")
BROKER = os.environ.get("LC_BROKER_URL") or URL
PREFIX = os.environ.get("LC_PREFIX", "test:lc:")
QUEUE = os.environ.get("LC_QUEUE", "lc")
ACKS = os.environ.get("LC_ACKS", "early")
LOCK_TTL = 2.0

app = Celery("lifecycle_app", set_as_current=False)
app.conf.update(
    broker_url=BROKER,
    result_backend=URL,
    task_default_queue=QUEUE,
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}celery:"},
    result_expires=600,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
    idempotency_url=os.environ.get("LC_IDEM_URL") or URL,
    idempotency_key_prefix=f"{PREFIX}idem:",
    idempotency_lock_ttl=LOCK_TTL,
    task_acks_late=ACKS in ("late", "late_reject"),
    task_reject_on_worker_lost=ACKS == "late_reject",
)
if BROKER.startswith("redis"):
    app.conf.broker_transport_options = {
        "global_keyprefix": f"{PREFIX}kombu:",
        "visibility_timeout": float(os.environ.get("LC_VISIBILITY") or 3600),
    }
    if os.environ.get("LC_VISIBILITY"):  # a short one: kombu's sweep every second, not 100 s
        app.conf.broker_transport_options.update(
            unacked_restore_interval=1, unacked_restore_throttle=1
        )

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


def _task(name: str, **options: Any) -> Any:
    return app.task(base=IdempotentTask, shared=False, name=f"lc.{name}", **options)


@_task("returns")
def returns(tag: str) -> str:
    return f"{tag}:{bump('returns', tag)}"


@_task("raises")
def raises(tag: str) -> None:
    bump("raises", tag)
    raise ValueError(f"{tag} failed")


@_task("stored_error", idempotency_store_errors=(KeyError,))
def stored_error(tag: str) -> None:
    bump("stored_error", tag)
    raise KeyError(tag)


@_task("retries", bind=True, max_retries=3)
def retries(self: Any, tag: str, countdown: float) -> str:
    """Retries itself once, ``countdown`` seconds later."""
    if bump("retries", tag) == 1:
        raise self.retry(countdown=countdown)
    return f"{tag} after {self.request.retries} retry"


@_task("retry_refused", bind=True, max_retries=0)
def retry_refused(self: Any, tag: str) -> str:
    """Celery's documented idiom: the retries used up, a fallback value."""
    bump("retry_refused", tag)
    try:
        raise self.retry(countdown=0)
    except MaxRetriesExceededError:
        return f"{tag}:fallback"


@_task("retry_refused_exc", bind=True, max_retries=0)
def retry_refused_exc(self: Any, tag: str) -> str:
    """A refused retry with ``exc=``: Celery raises ``exc`` (uncaught: the body fails)."""
    bump("retry_refused_exc", tag)
    raise self.retry(exc=ValueError(f"{tag} gave up"), countdown=0)


@_task("ignores")
def ignores(tag: str) -> None:
    bump("ignores", tag)
    raise Ignore()


@_task("rejects")
def rejects(tag: str) -> None:
    bump("rejects", tag)
    raise Reject("no", requeue=False)


@_task("rejects_requeue")
def rejects_requeue(tag: str) -> str:
    """Rejects its first delivery with ``requeue=True``, then returns."""
    if bump("rejects_requeue", tag) == 1:
        raise Reject("again", requeue=True)
    return f"{tag}:second"


@_task("sleeps")
def sleeps(tag: str, seconds: float) -> str:
    """Counts its start, sleeps (long enough to be revoked, timed out or killed), counts its end."""
    bump("sleeps", tag)
    client().set(PREFIX + "fx:pid:" + tag, os.getpid())
    time.sleep(seconds)
    bump("sleeps-done", tag)
    return f"{tag}:slept"


@_task("soft_limit", soft_time_limit=1)
def soft_limit(tag: str) -> str:
    """Does not catch ``SoftTimeLimitExceeded``: it escapes the body."""
    bump("soft_limit", tag)
    time.sleep(5)
    return "never"


@_task("hard_limit", time_limit=1)
def hard_limit(tag: str) -> str:
    bump("hard_limit", tag)
    time.sleep(5)
    return "never"


@_task("sleeps_once")
def sleeps_once(tag: str) -> str:
    """Sleeps a minute on its first run (to be killed there), returns at once on later ones."""
    run = bump("sleeps_once", tag)
    client().set(PREFIX + "fx:pid:" + tag, os.getpid())
    if run == 1:
        time.sleep(60)
    return f"{tag}:run {run}"
