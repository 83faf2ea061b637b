"""The worker-side request of an idempotent task (Celery's ``Task.Request``).

``idempotency_on_locked="reject"`` ends a duplicate of a running key with
:class:`~celery_idempotent.celery.requeue.DuplicateRejected` (a ``Reject(requeue=False)``).
What that records under the duplicate's task id is decided here, the same on every Celery
this release supports: **nothing**. The message is rejected without requeue (dropped, or
dead-lettered where the queue has a dead-letter exchange), a ``task-rejected`` event is sent
and the result stays ``PENDING``, as Celery 5.5 and 5.6 leave any rejected task.

Celery 5.7 records a ``FAILURE`` for a ``Reject(requeue=False)`` (and fails the chain and
calls the errbacks). For this rejection that would be wrong: a redelivery of the message whose
body is still running (a visibility timeout, a broker's redelivery) carries the running call's
task id, so its FAILURE would be what ``AsyncResult(id).get()`` sees while the body goes on to
succeed. The key's state says where the running call is (``Task.idempotency_status``).
Imported by the worker only (``Task.Request`` is resolved by name).
"""

from __future__ import annotations

from typing import Any

from billiard.einfo import ExceptionWithTraceback
from celery.worker import state
from celery.worker.request import Request

from celery_idempotent.celery.requeue import DuplicateRejected

__all__ = ["IdempotentRequest"]


class IdempotentRequest(Request):  # type: ignore[misc]
    """Celery's ``Request``, except for a rejected duplicate (see the module docstring)."""

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        exc = exc_info.exception
        if isinstance(exc, ExceptionWithTraceback):
            exc = exc.exc
        if isinstance(exc, DuplicateRejected):
            state.task_ready(self)
            return self.reject(requeue=False)
        return super().on_failure(
            exc_info, send_failed_event=send_failed_event, return_ok=return_ok
        )
