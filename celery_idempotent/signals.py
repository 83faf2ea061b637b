"""Celery signals sent by :class:`~celery_idempotent.IdempotentTask`.

Each is sent with ``sender=<the task>`` and the keyword arguments ``task_id``, ``key`` (the
namespaced idempotency key), ``elapsed`` (seconds since the guard began, by the guard's clock)
and ``fencing_token``; ``idempotency_contended`` also sends ``attempt`` (1 for the first lock
attempt). A receiver's error is logged by Celery and never breaks the task.

==========================  ======================================  ===========================
signal                      sent when                               ``elapsed`` covers
==========================  ======================================  ===========================
``idempotency_committed``   the body ran and its result was stored  lock + body + commit
``idempotency_replayed``    a duplicate got the stored result       lock attempts + lookup
``idempotency_contended``   a lock attempt found the key held       the attempts so far
``idempotency_lease_lost``  the body ran but its lease was lost     lock + body (+ commit)
==========================  ======================================  ===========================

``idempotency_publish_stopped`` is sent in the *publishing* process when ``apply_async`` or
``delay`` published nothing because the key was already completed, queued or running: with
``sender=<the task>``, ``task_id`` (the first call's task id, ``None`` when unknown), ``key``
and ``state`` (``"completed"`` or ``"queued"``, which covers running).

Two more cover what a dashboard alerts on, sent in the worker (``where="worker"``) and in the
publishing process (``where="publish"``), with ``sender=<the task>``, ``task_id`` and ``key``:

- ``idempotency_mismatch_refused``: a call was refused because its key is stored (or queued)
  with another payload's fingerprint (``IdempotencyMismatchError`` follows);
- ``idempotency_backend_unreachable``: the idempotency backend (Redis, PostgreSQL) did not
  answer; also ``error`` (the ``IdempotencyConnectionError``). In the worker the delivery
  fails or is re-queued; at publish the message is published unchecked.

Receivers run in the worker process that ran the task, on the task's thread, before the task
returns: keep them as cheap as a statsd UDP packet. Celery keeps receivers by weak reference:
connect module-level functions (as below) or pass ``weak=False``, and connect them in a module
the worker imports (the one that defines the app, say). Name metrics by task, never by key:
keys are unbounded. Feeding a statsd-like client (``incr`` counts, ``timing`` takes ms)::

    import statsd

    from celery_idempotent import signals

    metrics = statsd.StatsClient("localhost", 8125, prefix="celery.idempotency")


    @signals.idempotency_committed.connect
    def on_committed(sender, elapsed, **kwargs):
        metrics.incr(f"committed.{sender.name}")
        metrics.timing(f"committed.{sender.name}", elapsed * 1000)


    @signals.idempotency_replayed.connect
    def on_replayed(sender, elapsed, **kwargs):
        metrics.incr(f"replayed.{sender.name}")  # duplicates that did not run the body
        metrics.timing(f"replayed.{sender.name}", elapsed * 1000)


    @signals.idempotency_contended.connect
    def on_contended(sender, attempt, **kwargs):
        metrics.incr(f"contended.{sender.name}")  # one per lock attempt that found it held


    @signals.idempotency_lease_lost.connect
    def on_lease_lost(sender, **kwargs):
        metrics.incr(f"lease_lost.{sender.name}")  # worth an alert: a result was not stored

A client that keeps a background thread or a connection (a Prometheus push gateway, a buffered
DogStatsd) must be made per worker process: create it in a ``worker_process_init`` receiver
rather than at import, which runs in the parent before the pool forks.
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

__all__ = [
    "idempotency_backend_unreachable",
    "idempotency_committed",
    "idempotency_contended",
    "idempotency_lease_lost",
    "idempotency_mismatch_refused",
    "idempotency_publish_stopped",
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
#: ``apply_async``/``delay`` published nothing: the key was completed, queued or running.
idempotency_publish_stopped = Signal(name="idempotency_publish_stopped")
#: A call was refused: its key holds another payload's fingerprint (``where``: worker or
#: publish).
idempotency_mismatch_refused = Signal(name="idempotency_mismatch_refused")
#: The idempotency backend did not answer (``where``: worker or publish; ``error``).
idempotency_backend_unreachable = Signal(name="idempotency_backend_unreachable")
