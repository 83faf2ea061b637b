"""The shop's task, as the worker container imports it (pytest-celery copies this file)."""

from celery import shared_task

from celery_idempotent import IdempotentTask


@shared_task(base=IdempotentTask, name="shop.charge", idempotency_key="order:{order_id}")
def charge(order_id, cents):
    return {"order": order_id, "charged": cents}
