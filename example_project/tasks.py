# Celery ships no type hints: its decorators are untyped.
# mypy: disable-error-code="untyped-decorator"
"""The shop's tasks: each one changes the outside world, so each one must run once per intent.

Four ways to say what "the same request" means, one per task:

- ``create_order``: the client's own idempotency key, sent as the ``idempotency_key`` header (the
  web handler copies the HTTP ``Idempotency-Key`` header). A double-click enqueues the task twice,
  under two task ids, with one key.
- ``charge_payment``: a format string over the arguments, ``"payment:{order_id}"``. One charge
  per order, however often it is requested; a request to charge the same order another amount is
  refused with ``IdempotencyMismatchError`` instead of charging twice.
- ``send_receipt_email``: the task id. Every *new* task is a new email on purpose (a customer may
  ask for their receipt again); a redelivered message, or one published twice with the same id,
  is not.
- ``ship_order``: the arguments (the default ``"args"``). The same order to the same address is
  one shipment.
"""

from __future__ import annotations

from typing import Any

from celery_idempotent import IdempotentTask, current_lease
from example_project import settings
from example_project.celery import app
from example_project.shop import MailServerUnavailable, world

__all__ = ["charge_payment", "create_order", "send_receipt_email", "ship_order"]


@app.task(base=IdempotentTask)
def create_order(order_id: str, customer_id: str, items: list[dict[str, Any]]) -> dict[str, Any]:
    """Store the order. Keyed by the client's ``idempotency_key`` header (see the module doc)."""
    world().count("bodies")
    return world().save_order(order_id, customer_id, items)


@app.task(base=IdempotentTask, idempotency_key="payment:{order_id}")
def charge_payment(order_id: str, amount_cents: int, currency: str = "EUR") -> dict[str, Any]:
    """Charge the customer once per order; another amount for the same order is refused."""
    world().count("bodies")
    # The lease's fencing token grows with every acquisition of this key: a real gateway that
    # stores the highest token per order can refuse a writer whose lease has since expired.
    lease = current_lease()
    charge = world().charge(order_id, amount_cents, currency)
    return {**charge, "fencing_token": lease.fencing_token if lease else None}


@app.task(base=IdempotentTask, idempotency_key="task_id", bind=True, max_retries=5)
def send_receipt_email(self: Any, order_id: str, email: str) -> dict[str, Any]:
    """Mail the receipt; one email per task id. Retries a mail server that is down."""
    world().count("bodies")
    try:
        return world().send_mail(self.request.id, email, f"Your receipt for order {order_id}")
    except MailServerUnavailable as exc:
        world().count("mail_retries")
        # IdempotentTask.retry releases the key's lock before Celery re-publishes the task, so
        # the retry (same task id, same key) is not blocked by this very delivery.
        countdown = min(
            settings.MAIL_RETRY_BASE * 2**self.request.retries, settings.LONGEST_COUNTDOWN
        )
        raise self.retry(exc=exc, countdown=countdown) from exc


@app.task(base=IdempotentTask)
def ship_order(order_id: str, address: str) -> dict[str, Any]:
    """Hand the order to the warehouse. Keyed by the arguments."""
    world().count("bodies")
    return world().ship(order_id, address)
