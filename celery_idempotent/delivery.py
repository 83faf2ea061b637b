"""One delivery through the guard: the body run at most once per key, a held key handled as
``idempotency_on_locked`` says, the outcome handed back to Celery as a worker hands it on."""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from celery.exceptions import Ignore, Reject, Retry

from celery_idempotent.exceptions import (
    IdempotencyConnectionError,
    LockAcquisitionError,
    LockLostError,
)
from celery_idempotent.guard import ABSENT, DistributedIdempotencyGuard
from celery_idempotent.keys import key_digest
from celery_idempotent.publish import drop_queued_marker
from celery_idempotent.requeue import on_locked, requeue
from celery_idempotent.results import (
    as_delivered,
    failure_envelope,
    failure_from,
    is_failure_envelope,
)
from celery_idempotent.settings import never_stored

if TYPE_CHECKING:
    from celery_idempotent.settings import IdempotencySettings
    from celery_idempotent.task import IdempotentTask
    from celery_idempotent.task_keys import PreparedCall

__all__ = ["run", "running_guard"]

log = logging.getLogger("celery_idempotent")

# (guard, task name, task id) of the guarded body running in this context: retry() releases
# the lease only when it is called by that very delivery, not by a task called directly inside.
_running: contextvars.ContextVar[tuple[DistributedIdempotencyGuard, str, Any] | None] = (
    contextvars.ContextVar("celery_idempotent_guard", default=None)
)

#: Exceptions that are Celery's control flow, not a body failing.
_CONTROL_FLOW = (Retry, Ignore, Reject)


def running_guard(task: IdempotentTask) -> DistributedIdempotencyGuard | None:
    """The guard of ``task``'s delivery whose body runs in this context, else ``None`` (also
    for another task, or this task called directly inside that body)."""
    running = _running.get()
    if running is None or running[1:] != (task.name, task.request.id):
        return None
    return running[0]


def run(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    guard: DistributedIdempotencyGuard,
    prepared: PreparedCall,
    call_body: Callable[[], Any],
    *,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Any:
    """Run the delivery in ``task.request`` through ``guard``: ``call_body()`` runs the
    task's body, at most once per key; the outcome as Celery hands it on (a stored failure
    raised again, an eager caller's value as a replay gets it). A held key follows
    ``idempotency_on_locked``: a re-queue (which raises ``Retry``), an error, or, eagerly,
    another attempt after a wait."""
    request = task.request
    key, payload, fingerprint = prepared
    started: list[bool] = []
    failed: list[BaseException] = []
    store_errors = cfg.idempotency_store_errors

    def body() -> Any:
        started.append(True)
        if not store_errors:
            return call_body()
        try:
            return call_body()
        except store_errors as exc:
            if isinstance(exc, never_stored()):
                raise
            failed.append(exc)
            return failure_envelope(task, exc)

    token = _running.set((guard, task.name, request.id))
    try:
        while True:
            try:
                outcome = guard.run(
                    key,
                    body,
                    input=payload if fingerprint is not None else ABSENT,
                    fingerprint=fingerprint,
                    task_id=None if request.id is None else str(request.id),
                )
            except LockAcquisitionError as exc:
                on_locked(task, cfg, key, exc, args=args, kwargs=kwargs)
            except IdempotencyConnectionError as exc:
                # Redis unreachable before the body ran: nothing happened, so a re-queue
                # is safe. After the body ran the error stands (the result is not stored).
                # In eager mode there is no queue to come back through: waiting in place
                # for a Redis that may never answer (a wrong URL) would hang the caller.
                if started or cfg.idempotency_on_locked != "retry" or request.is_eager:
                    raise
                log.warning(
                    "idempotency backend unreachable for %s[%s]; re-queueing: %s",
                    task.name,
                    request.id,
                    exc,
                )
                requeue(task, cfg, exc, args, kwargs)
            except LockLostError as exc:
                if failed:  # the failure was not stored: it stands as it is
                    raise failed[0] from exc
                raise
            else:
                break
    except _CONTROL_FLOW:
        raise
    except BaseException:
        if started:  # the body failed for good: its queued marker ends with it
            drop_queued_marker(task, guard, key)
        raise
    finally:
        _running.reset(token)
    if is_failure_envelope(outcome.value):
        if failed and not outcome.replayed:
            raise failed[0]
        stored = failure_from(task, outcome.value)
        log.info(
            "replayed stored failure %s for %s[%s] key=%s",
            type(stored).__name__,
            task.name,
            request.id,
            key_digest(key),
        )
        raise stored
    if not outcome.replayed and request.is_eager and not cfg.in_memory:
        # A worker hands the body's value to the caller, links and chains through the
        # result serializer; eagerly Celery hands over the object itself. Give the first
        # eager caller what its replays will get (JSON: a tuple arrives as a list).
        return as_delivered(task.app.conf, outcome.value)
    if outcome.replayed and log.isEnabledFor(logging.INFO):
        log.info(
            "replayed stored result for %s[%s] key=%s (fencing token %s)",
            task.name,
            request.id,
            key_digest(key),
            outcome.fencing_token,
        )
    return outcome.value
