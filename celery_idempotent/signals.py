"""Celery signals sent by :class:`~celery_idempotent.IdempotentTask`.

Each is sent with ``sender=<the task>`` and the keyword arguments ``task_id``, ``key`` (the
namespaced idempotency key), ``elapsed`` (seconds since the guard began) and
``fencing_token``; ``idempotency_contended`` also sends ``attempt``. A receiver's error is
logged by Celery and never breaks the task::

    from celery_idempotent.signals import idempotency_replayed

    @idempotency_replayed.connect
    def count_replay(sender, key, elapsed, **kwargs):
        statsd.incr(f"idempotency.replayed.{sender.name}")
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "idempotency_committed",
    "idempotency_contended",
    "idempotency_lease_lost",
    "idempotency_replayed",
]

#: A duplicate delivery got the stored result; the body did not run.
idempotency_replayed = Signal(name="idempotency_replayed")
#: A lock attempt found the key held by another delivery.
idempotency_contended = Signal(name="idempotency_contended")
#: The body ran and its result was committed.
idempotency_committed = Signal(name="idempotency_committed")
#: The body ran but its lease was lost: nothing was committed (``LockLostError`` follows).
idempotency_lease_lost = Signal(name="idempotency_lease_lost")
