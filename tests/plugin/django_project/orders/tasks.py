from celery import shared_task
from celery_idempotent import IdempotentTask

from orders.models import Order, Payment


@shared_task(base=IdempotentTask, idempotency_key="order:{order_id}")
def charge(order_id, amount):
    """One payment per order: the row commits with the idempotency record, or not at all."""
    order = Order.objects.get(pk=order_id)
    payment = Payment.objects.create(order=order, amount=amount)
    return payment.pk
