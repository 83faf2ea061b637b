"""The shop's Celery app. Production reads its URLs from the environment."""

import os

from celery import Celery

app = Celery("shop", include=["shop.tasks"])
app.conf.update(
    broker_url=os.environ.get("SHOP_BROKER_URL", "redis://localhost:6379/0"),
    result_backend=os.environ.get("SHOP_RESULT_BACKEND", "redis://localhost:6379/1"),
    idempotency_url=os.environ.get("SHOP_IDEMPOTENCY_URL", "redis://localhost:6379/2"),
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    worker_prefetch_multiplier=1,
    result_serializer="json",
    accept_content=["json"],
)
