"""What the clients send: the orders, and the copies of each message that make the duplicates."""

from __future__ import annotations

import dataclasses
import random
import uuid
from typing import Any

__all__ = ["Message", "Order", "burst", "make_orders"]

CITIES = ("Lyon", "Leeds", "Linz", "Lund")


@dataclasses.dataclass(frozen=True)
class Order:
    order_id: str
    customer_id: str
    items: list[dict[str, Any]]
    email: str
    address: str

    @property
    def amount_cents(self) -> int:
        return sum(item["price_cents"] * item["quantity"] for item in self.items)


@dataclasses.dataclass(frozen=True)
class Message:
    """One publish: ``task`` with ``args`` under ``task_id`` (and an explicit key if given)."""

    task: str
    args: tuple[Any, ...]
    task_id: str
    key: str  # the business identity the message stands for, e.g. "charge:ord-0001"
    headers: dict[str, str] | None = None


def make_orders(count: int, rng: random.Random) -> list[Order]:
    catalogue = [("mug", 1200), ("t-shirt", 2500), ("poster", 900), ("sticker", 300)]
    orders = []
    for i in range(count):
        picks = rng.sample(catalogue, rng.randint(1, 3))
        items = [
            {"sku": sku, "price_cents": price, "quantity": rng.randint(1, 3)}
            for sku, price in picks
        ]
        orders.append(
            Order(
                order_id=f"ord-{i + 1:05d}",
                customer_id=f"cust-{rng.randrange(1, 500):03d}",
                items=items,
                email=f"customer{i + 1}@example.com",
                address=f"{rng.randint(1, 200)} High Street, {rng.choice(CITIES)}",
            )
        )
    return orders


def burst(order: Order, duplicates: int) -> list[list[Message]]:
    """The messages each of ``duplicates`` clients sends for ``order`` (one list per client)."""
    charge_id = str(uuid.uuid4())
    email_id = str(uuid.uuid4())
    clients = []
    for copy in range(duplicates):
        clients.append(
            [
                # A double-click: a new task per click, one Idempotency-Key from the browser.
                Message(
                    "create_order",
                    (order.order_id, order.customer_id, order.items),
                    str(uuid.uuid4()),
                    f"order:{order.order_id}",
                    {"idempotency_key": f"checkout-{order.order_id}"},
                ),
                # Even copies re-send one task id (a redelivery), odd ones are new tasks.
                Message(
                    "charge_payment",
                    (order.order_id, order.amount_cents, "EUR"),
                    charge_id if copy % 2 == 0 else str(uuid.uuid4()),
                    f"charge:{order.order_id}",
                ),
                # Keyed by the task id: only a re-sent id is a duplicate.
                Message(
                    "send_receipt_email",
                    (order.order_id, order.email),
                    email_id,
                    f"email:{email_id}",
                ),
                # Keyed by the arguments: same order, same address, new task ids.
                Message(
                    "ship_order",
                    (order.order_id, order.address),
                    str(uuid.uuid4()),
                    f"shipment:{order.order_id}",
                ),
            ]
        )
    return clients
