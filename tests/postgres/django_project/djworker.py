"""The Celery app of the Django project, as a Django user writes it (``celery -A djworker``).

``idempotency_url = "django://default"`` (``CELERY_IDEMPOTENCY_URL`` in the settings): the
guard runs each body inside ``transaction.atomic()`` on Django's connection, so the ORM
writes below commit together with the idempotency record, or not at all.
"""

from __future__ import annotations

import os
import time
from typing import Any

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "dj_settings")

import django
import redis
from celery import Celery

django.setup()

from shop.models import Payment  # noqa: E402

from celery_idempotent import IdempotentTask  # noqa: E402

app = Celery("djworker")
app.config_from_object("django.conf:settings", namespace="CELERY")
MARKS = os.environ["DJ_BROKER_URL"]
TABLE = os.environ["DJ_TABLE"]


def _marks() -> Any:
    return redis.Redis.from_url(MARKS)


@app.task(base=IdempotentTask, idempotency_key="order:{order_id}", shared=False)
def charge(order_id: str, rows: int, stall: float, fail: bool = False) -> dict[str, Any]:
    """Create ``rows`` payments through the ORM; stall on the first run; fail when asked."""
    marks = _marks()
    run = int(marks.incr(f"{TABLE}:runs:{order_id}"))
    for index in range(rows):
        Payment.objects.create(order_id=order_id, n=index, pid=os.getpid())
    seen = Payment.objects.filter(order_id=order_id).count()  # its own, uncommitted rows
    marks.set(f"{TABLE}:inserted:{order_id}:{run}", os.getpid())
    if fail:
        raise ValueError(f"card declined for {order_id}")
    if run == 1:
        time.sleep(stall)  # the test kills the worker's child here
    return {"order": order_id, "run": run, "seen": seen}
