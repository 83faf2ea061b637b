"""The project's Celery app, as the Django recipe writes it."""

from __future__ import annotations

import os

from celery import Celery

os.environ.setdefault("DJANGO_SETTINGS_MODULE", "appproj.settings")

import django

django.setup()

from celery_idempotent import IdempotentTask  # noqa: E402

app = Celery("appproj")
app.config_from_object("django.conf:settings", namespace="CELERY")


@app.task(base=IdempotentTask, idempotency_key="order:{order_id}")
def charge(order_id: str) -> str:
    return f"charged {order_id}"


@app.task(base=IdempotentTask, idempotency_key="invoice:{invoice_id}")
def send_invoice(invoice_id: str) -> str:
    return f"sent {invoice_id}"
