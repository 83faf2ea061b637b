"""The Celery app that the end-to-end benchmark's worker runs (``celery -A benchmarks.e2e_app``).

Configured from the environment: ``CI_BENCH_REDIS_URL`` (broker, result backend and
idempotency store: one server), ``CI_BENCH_QUEUE`` and ``CI_BENCH_PREFIX`` (this run's queue and
key prefix, so that a shared server is not disturbed).
"""

from __future__ import annotations

import os

from celery import Celery

URL = os.environ.get("CI_BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
QUEUE = os.environ.get("CI_BENCH_QUEUE", "cibench")
PREFIX = os.environ.get("CI_BENCH_PREFIX", "cibench:")

app = Celery("cibench", broker=URL, backend=URL)
app.conf.update(
    task_default_queue=QUEUE,
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    result_expires=600,
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    idempotency_url=URL,
    idempotency_key_prefix=PREFIX,
)


@app.task(name="cibench.plain")
def plain(i: int) -> int:
    return i


try:
    from celery_idempotent.task import IdempotentTask
except ImportError:  # the task module is not there yet: the end-to-end case is skipped
    IdempotentTask = None

if IdempotentTask is not None:

    @app.task(base=IdempotentTask, name="cibench.idempotent")
    def idempotent(i: int) -> int:
        return i
