"""The Celery app that the end-to-end benchmark's worker runs (``celery -A benchmarks.e2e_app``).

Configured from the environment: ``CI_BENCH_REDIS_URL`` (broker, result backend and
idempotency store: one server), ``CI_BENCH_QUEUE`` and ``CI_BENCH_PREFIX`` (this run's queue and
key prefix, so that a shared server is not disturbed).
"""

from __future__ import annotations

import os
from typing import Any

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
    from celery_idempotent.celery.task import IdempotentTask
except ImportError:  # the task module is not there yet: the end-to-end case is skipped
    IdempotentTask = None

if IdempotentTask is not None:

    @app.task(base=IdempotentTask, name="cibench.idempotent")
    def idempotent(i: int) -> int:
        return i


# The floor of a guarded task's cost (``python -m benchmarks.e2e_cpu``): a plain task that makes
# the round trips a duplicate (one) and a first execution (two) make, as no-op scripts through a
# redis-py client of the worker process, and nothing else.
_floor_client: Any = None


def _noop_script() -> Any:
    global _floor_client  # noqa: PLW0603 - one client per worker process, made on first use
    if _floor_client is None:
        import redis

        _floor_client = redis.Redis.from_url(URL)
        _floor_client.noop = _floor_client.register_script("return 0")
    return _floor_client.noop


_FLOOR_KEYS = [f"{PREFIX}floor:lock", f"{PREFIX}floor:record", f"{PREFIX}floor:fence"]


@app.task(name="cibench.plain_1_script")
def plain_1_script(i: int) -> int:
    _noop_script()(keys=_FLOOR_KEYS, args=["token", 10_000])
    return i


@app.task(name="cibench.plain_2_scripts")
def plain_2_scripts(i: int) -> int:
    noop = _noop_script()
    noop(keys=_FLOOR_KEYS, args=["token", 10_000])
    noop(keys=_FLOOR_KEYS, args=["token", 86_400_000, "v" * 60, 1])
    return i
