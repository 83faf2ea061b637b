"""The app of the Prometheus recipe's test: the recipe's metrics module as a user writes it,
under prefork with prometheus-client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR`` is set
in the worker's environment by the test). Configured from ``PROM_*`` environment variables."""

from __future__ import annotations

import os
import time

from celery import Celery
from celery import signals as celery_signals

from celery_idempotent import IdempotentTask
from celery_idempotent.contrib import prometheus

URL = os.environ.get("PROM_REDIS_URL", "redis://127.0.0.1:6379/0")
PREFIX = os.environ.get("PROM_PREFIX", "test:prom:")

app = Celery("prom_app", set_as_current=False)
app.conf.update(
    broker_url=URL,
    result_backend=URL,
    task_default_queue=os.environ.get("PROM_QUEUE", "prom"),
    broker_transport_options={"global_keyprefix": f"{PREFIX}kombu:"},
    result_backend_transport_options={"global_keyprefix": f"{PREFIX}celery:"},
    idempotency_key_prefix=f"{PREFIX}idem:",
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    broker_connection_retry_on_startup=True,
)

prometheus.install()


@celery_signals.worker_ready.connect
def serve_metrics(**_: object) -> None:
    prometheus.serve(int(os.environ.get("PROM_PORT", "9100")), addr="127.0.0.1")


@app.task(base=IdempotentTask, shared=False, name="prom.charge", idempotency_key="order:{order}")
def charge(order: str, amount: int) -> list[int]:
    time.sleep(0.2)  # long enough for both pool children to take work
    return [amount, os.getpid()]
