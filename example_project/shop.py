"""The shop's outside world: a payment gateway, a mail server and a warehouse, simulated in Redis.

Every call that changes the world is recorded atomically (one MULTI/EXEC) at the end of the call,
the way a gateway either charged a card or did not. Per business identity (``charge:<order>``,
``email:<task id>``...) the world keeps:

- ``effects``: how many times the world really changed. Above 1 is a double execution, whatever
  the task results say.
- ``busy``: how many calls are in progress right now. Above 1 means two bodies of one key ran at
  the same time (an ``overlaps`` count), which the lock must prevent.

The demo reads these figures; nothing is inferred from logs. Keys live under
``<NAMESPACE>:world:`` (see :mod:`example_project.settings`).
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import redis

from example_project import settings

__all__ = ["CHAOS_HANG", "MailServerUnavailable", "World", "world"]

#: Seconds a chaos victim's gateway call hangs, waiting to be killed.
CHAOS_HANG = 30.0


class MailServerUnavailable(ConnectionError):
    """The simulated mail server refused a connection (a transient error worth a retry)."""


class World:
    """The simulated systems, talking to the ledger Redis at ``url`` under ``namespace``."""

    def __init__(self, url: str, namespace: str, latency: float) -> None:
        self.client: redis.Redis = redis.Redis.from_url(url, decode_responses=True)
        self.prefix = f"{namespace}:world:"
        self.latency = latency

    def key(self, name: str) -> str:
        return self.prefix + name

    # -- what the tasks call -----------------------------------------------------------------

    def save_order(
        self, order_id: str, customer_id: str, items: list[dict[str, Any]]
    ) -> dict[str, Any]:
        with self._call(f"order:{order_id}"):
            total = sum(int(item["price_cents"]) * int(item["quantity"]) for item in items)
            order = {"order_id": order_id, "customer_id": customer_id, "total_cents": total}
            self._record(f"order:{order_id}", "orders", order)
            return order

    def charge(self, order_id: str, amount_cents: int, currency: str) -> dict[str, Any]:
        entered = time.time()
        with self._call(f"charge:{order_id}"):
            # A chaos victim's first call hangs (a slow gateway) so that the demo can kill the
            # process before the card is charged.
            if self.client.srem(self.key("slow_once"), order_id):
                info = {
                    "order_id": order_id,
                    "pid": os.getpid(),
                    "ppid": os.getppid(),
                    "entered": entered,
                }
                self.client.rpush(self.key("inflight"), json.dumps({**info, "at": time.time()}))
                time.sleep(CHAOS_HANG)
            charge = {
                "charge_id": f"ch_{uuid.uuid4().hex[:16]}",
                "order_id": order_id,
                "amount_cents": amount_cents,
                "currency": currency,
            }
            self._record(f"charge:{order_id}", "charges", charge)
            return charge

    def send_mail(self, message_id: str, to: str, subject: str) -> dict[str, Any]:
        with self._call(f"email:{message_id}"):
            if self.client.srem(self.key("mail_flaky"), to):
                raise MailServerUnavailable(f"mail server refused the connection for {to}")
            mail = {"message_id": message_id, "to": to, "subject": subject}
            self._record(f"email:{message_id}", "emails", mail)
            return mail

    def ship(self, order_id: str, address: str) -> dict[str, Any]:
        with self._call(f"shipment:{order_id}"):
            shipment = {
                "tracking": f"TRK{uuid.uuid4().int % 10**10:010d}",
                "order_id": order_id,
                "address": address,
            }
            self._record(f"shipment:{order_id}", "shipments", shipment)
            return shipment

    def count(self, field: str, amount: int = 1) -> None:
        """Add to one of the demo's counters (``<ns>:world:stats``)."""
        self.client.hincrby(self.key("stats"), field, amount)

    def leave(self, identity: str) -> None:
        """Mark a call of ``identity`` as over (the demo calls it for a process it killed)."""
        self.client.hincrby(self.key("busy"), identity, -1)

    # -- internals ---------------------------------------------------------------------------

    @contextlib.contextmanager
    def _call(self, identity: str) -> Iterator[None]:
        if self.client.hincrby(self.key("busy"), identity, 1) > 1:
            self.count("overlaps")
        try:
            if self.latency > 0:
                time.sleep(self.latency)
            yield
        finally:
            self.leave(identity)

    def _record(self, identity: str, ledger: str, entry: dict[str, Any]) -> None:
        pipe = self.client.pipeline(transaction=True)
        pipe.hincrby(self.key("effects"), identity, 1)
        pipe.rpush(self.key(f"ledger:{ledger}"), json.dumps(entry, sort_keys=True))
        pipe.execute()


_worlds: dict[int, World] = {}
_worlds_lock = threading.Lock()


def world() -> World:
    """This process's :class:`World` (a client made before a fork is not reused after it)."""
    pid = os.getpid()
    with _worlds_lock:
        found = _worlds.get(pid)
        if found is None:
            found = World(settings.LEDGER_URL, settings.NAMESPACE, settings.LATENCY)
            _worlds.clear()
            _worlds[pid] = found
        return found
