"""The Celery app of the soak (``python -m benchmarks.soak``): one plain and one idempotent task.

Configured from the environment: ``CI_SOAK_REDIS_URL`` (broker, result backend and idempotency
store: the soak's private server). Both tasks do the same (nothing but return their argument),
so what differs between their workers is what the library adds.
"""

from __future__ import annotations

import os

from celery import Celery

from celery_idempotent import IdempotentTask

URL = os.environ.get("CI_SOAK_REDIS_URL", "redis://127.0.0.1:6379/0")

app = Celery("cisoak", broker=URL, backend=URL)
app.conf.update(
    task_serializer="json",
    result_serializer="json",
    accept_content=["json"],
    # CI_SOAK_RESULTS=0: results not stored (Celery's default is to store them).
    task_ignore_result=os.environ.get("CI_SOAK_RESULTS", "1") == "0",
    broker_connection_retry_on_startup=True,
    worker_hijack_root_logger=False,
    worker_prefetch_multiplier=8,
    idempotency_url=URL,
    idempotency_key_prefix="soak:",
    idempotency_ttl=600,  # the server's memory stays small; the worker's is measured
    idempotency_lock_ttl=10,
)


@app.task(name="soak.plain")
def plain(i: int) -> int:
    return i


@app.task(base=IdempotentTask, name="soak.idempotent")
def idempotent(i: int) -> int:
    return i
