"""The shop's tasks: each returns a fresh id, so a body that ran twice shows in its result."""

import uuid

from celery_idempotent import IdempotentTask, current_lease

from shop.celery import app


@app.task(base=IdempotentTask, idempotency_key="payment:{order_id}")
def charge(order_id: int, amount_cents: int) -> dict:
    """Charge an order once; another amount for the same order is refused."""
    lease = current_lease()
    return {
        "order_id": order_id,
        "amount_cents": amount_cents,
        "charge_id": uuid.uuid4().hex,
        "fencing_token": lease.fencing_token if lease else None,
    }


@app.task(base=IdempotentTask, idempotency_key="task_id")
def send_receipt(order_id: int) -> str:
    """Send one receipt per message: a redelivered message does not send it again."""
    return f"receipt {order_id} {uuid.uuid4().hex}"


@app.task(base=IdempotentTask)
def reserve_stock(sku: str, quantity: int = 1) -> str:
    """Reserve stock; the key is the arguments, so reserve_stock("a") is reserve_stock("a", 1)."""
    return f"reservation {sku} x{quantity} {uuid.uuid4().hex}"
