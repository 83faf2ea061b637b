"""The app of ``test_task_controls_workers.py``: issue 14's controls in real workers.

Configured like ``cidem_app`` (same environment variables, same session prefix and counters).
``CONTROLS_DLQ`` dead-letters the default queue into that queue (RabbitMQ).
``CONTROLS_VERSION`` names the billing task ``controls.charge_v<version>``: two workers with
different versions are one app before and after a rename. Every version also has two tasks that
share a namespace by accident, for the start-up check.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Mapping
from typing import Any

from celery import Celery
from cidem_app import bump, ckey, client, configure  # noqa: F401 - count() uses them

from celery_idempotent import IdempotentTask

app = Celery("controls_app", set_as_current=False)


def configure_controls(target: Celery, env: Mapping[str, str]) -> None:
    """``cidem_app.configure``, and with ``CONTROLS_DLQ`` the default queue dead-letters
    into that queue (RabbitMQ: ``x-dead-letter-exchange`` on the default exchange)."""
    configure(target, env)
    dlq = env.get("CONTROLS_DLQ")
    if dlq:
        from kombu import Queue

        queue = target.conf.task_default_queue
        target.conf.task_queues = [
            Queue(
                queue,
                routing_key=queue,
                queue_arguments={
                    "x-dead-letter-exchange": "",
                    "x-dead-letter-routing-key": dlq,
                },
            )
        ]


configure_controls(app, os.environ)

VERSION = os.environ.get("CONTROLS_VERSION", "1")


class CardDeclinedError(Exception):
    """A terminal failure: stored, so that no duplicate charges again."""

    def __init__(self, order_id: int, reason: str) -> None:
        super().__init__(order_id, reason)
        self.order_id = order_id
        self.reason = reason


def token() -> str:
    return uuid.uuid4().hex


# --------------------------------------------------------------------------- fingerprint


@app.task(
    shared=False,
    base=IdempotentTask,
    name="controls.order",
    idempotency_key="order:{tag}:{order_id}",
    idempotency_fingerprint=("order_id", "amount"),
)
def order(tag: str, order_id: int, amount: int, requested_at: str) -> dict[str, Any]:
    n = bump("order", tag)
    return {"amount": amount, "requested_at": requested_at, "run": n, "token": token()}


@app.task(
    shared=False,
    base=IdempotentTask,
    name="controls.order_strict",
    idempotency_key="order:{tag}:{order_id}",
)
def order_strict(tag: str, order_id: int, amount: int, requested_at: str) -> dict[str, Any]:
    n = bump("order_strict", tag)
    return {"amount": amount, "requested_at": requested_at, "run": n, "token": token()}


# --------------------------------------------------------------------------- missing keys


@app.task(
    shared=False,
    base=IdempotentTask,
    name="controls.welcome",
    idempotency_key="user:{tag}:{user_id}",
)
def welcome(tag: str, user_id: int | None) -> int:
    return bump("welcome", tag)


@app.task(
    shared=False,
    base=IdempotentTask,
    name="controls.welcome_run",
    idempotency_key="user:{tag}:{user_id}",
    idempotency_missing_key="run",
)
def welcome_run(tag: str, user_id: int | None) -> int:
    return bump("welcome_run", tag)


# --------------------------------------------------------------------------- stored failures


@app.task(
    shared=False,
    base=IdempotentTask,
    name="controls.pay",
    idempotency_key="pay:{tag}:{order_id}",
    idempotency_store_errors=(CardDeclinedError,),
)
def pay(tag: str, order_id: int, error: str) -> str:
    bump("pay", tag)
    time.sleep(0.2)  # duplicates arrive while it runs, and after
    if error == "declined":
        raise CardDeclinedError(order_id, "insufficient funds")
    raise ValueError(order_id, "a bug, not an answer")


# --------------------------------------------------------------------------- namespace


@app.task(
    shared=False,
    base=IdempotentTask,
    name=f"controls.charge_v{VERSION}",
    idempotency_namespace="billing.charge",
)
def charge(tag: str, order_id: int) -> dict[str, Any]:
    n = bump("charge", tag)
    return {"version": VERSION, "run": n, "token": token()}


@app.task(shared=False, base=IdempotentTask, name="controls.audit")
def audit(tag: str) -> str:
    return token()


@app.task(
    shared=False,
    base=IdempotentTask,
    name="controls.audit_copy",
    idempotency_namespace="controls.audit",
)
def audit_copy(tag: str) -> str:  # pasted from audit, namespace and all: an accident
    return token()


# --------------------------------------------------------------------------- on_locked


@app.task(
    shared=False,
    base=IdempotentTask,
    name="controls.slow",
    acks_late=True,
    idempotency_on_locked="reject",
    idempotency_retry_count=0,
    idempotency_lock_ttl=5,
)
def slow(tag: str, duration: float) -> str:
    bump("slow", tag)
    time.sleep(duration)
    return token()
