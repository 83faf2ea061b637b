"""A delivery whose key is held by another: ``idempotency_on_locked`` (re-queue with a growing
countdown, raise, ignore or reject), the re-queue itself, and an eager call's wait in place."""

from __future__ import annotations

import random
import time
from typing import TYPE_CHECKING, Any, NoReturn

from celery.exceptions import Ignore, Reject, Retry

from celery_idempotent.core.backoff import ExponentialJitterBackoff
from celery_idempotent.core.fingerprint import key_digest

if TYPE_CHECKING:
    from celery_idempotent.celery.task import IdempotentTask
    from celery_idempotent.core.exceptions import LockAcquisitionError
    from celery_idempotent.settings import IdempotencySettings

__all__ = [
    "MAX_REQUEUE_COUNTDOWN",
    "MAX_REQUEUE_DELAY",
    "REQUEUE_HEADER",
    "DuplicateRejected",
    "on_locked",
    "requeue",
    "requeue_countdown",
    "wait_in_place",
]

#: How many times a duplicate was re-queued because its key was held (drives the countdown).
REQUEUE_HEADER = "idempotency_requeues"

#: The longest wait between two lock attempts of one delivery (the guard's back-off), and
#: between re-tries of an eager ``apply()`` whose key is held: the caller is blocked meanwhile.
MAX_REQUEUE_DELAY = 5.0
#: The longest countdown of a re-queued duplicate that found its key held. The countdown
#: doubles from ``idempotency_retry_base_delay`` up to this, so a duplicate waits at most
#: about as long again as it has waited (never more than this) after the key is released,
#: and a duplicate waiting on a body that runs for an hour is re-published about 90 times,
#: not about 960 times as with a 5 s cap (the fault suite measures both).
MAX_REQUEUE_COUNTDOWN = 60.0

#: RabbitMQ's dead-lettering headers. Celery drops them when it re-publishes a retry: a message
#: re-published with them looks like a dead-letter cycle to RabbitMQ, which then drops it.
#: (``celery.app.task.X_DEATH_HEADERS``, absent from older Celery versions.)
_X_DEATH_HEADERS = frozenset(
    {
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    }
)


class DuplicateRejected(Reject):  # type: ignore[misc]
    """``Reject(requeue=False)`` of a delivery whose key another delivery holds
    (``idempotency_on_locked="reject"``): the broker drops or dead-letters the message, and
    the worker records nothing under the delivery's task id (``IdempotentRequest``), as
    Celery 5.5 and 5.6 do for any ``Reject``. Celery 5.7 would record a FAILURE, and a
    redelivery of the message whose body still runs has that body's task id: its FAILURE
    would be read by the caller as the outcome of a call that then succeeds."""


def requeue_countdown(requeues: int, base: float, rand: float, cap: float) -> float:
    """Seconds before a duplicate re-queued ``requeues`` times so far is delivered again:
    ``base * 2**requeues`` capped at ``cap``, times a jitter of ``0.5 + rand / 2`` (``rand``
    in [0, 1)) so that the duplicates of one key do not arrive in lockstep."""
    backoff = ExponentialJitterBackoff(max(base, 0.05), cap, lambda: rand, jitter="equal")
    return backoff.delay(requeues)


def on_locked(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    key: str,
    exc: LockAcquisitionError,
    *,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> NoReturn:
    """End a delivery that found its key held, as ``idempotency_on_locked`` says: raise
    ``exc`` (``"raise"``), ``Ignore``, ``Reject``, or re-queue it (``"retry"``, raising
    ``Retry``). Not for an eager ``"retry"``: that call waits in place (:func:`wait_in_place`)."""
    policy = cfg.idempotency_on_locked
    if policy == "raise":
        raise exc
    if policy == "ignore":
        raise Ignore(f"idempotency key held by another delivery: {key_digest(key)}")
    if policy == "reject":
        raise DuplicateRejected(
            f"idempotency key held by another delivery: {key_digest(key)}", requeue=False
        )
    requeue(task, cfg, exc, args, kwargs)


def requeue(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    exc: Exception,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> NoReturn:
    """Re-publish this delivery with a growing countdown, without counting a retry, and end
    it with ``Retry``.

    ``Task.retry`` would count against ``max_retries``: a duplicate of a body that runs
    for minutes would end in ``MaxRetriesExceededError`` instead of the stored result.
    """
    request = task.request
    headers, countdown = _next_attempt(request, cfg, MAX_REQUEUE_COUNTDOWN)
    sig = task.signature_from_request(
        request, args, kwargs, countdown=countdown, retries=request.retries, headers=headers
    )
    sig.apply_async()
    raise Retry(exc=exc, when=countdown, sig=sig)


def wait_in_place(task: IdempotentTask, cfg: IdempotencySettings) -> None:
    """An eager call (``apply()``) has no queue to come back through: wait, as a re-queue's
    countdown would, before the caller tries the key again. The caller is blocked meanwhile:
    no broker messages to save, so the wait is capped shorter (:data:`MAX_REQUEUE_DELAY`)."""
    request = task.request
    headers, countdown = _next_attempt(request, cfg, MAX_REQUEUE_DELAY)
    time.sleep(countdown)
    request.headers = headers


def _next_attempt(
    request: Any, cfg: IdempotencySettings, cap: float
) -> tuple[dict[str, Any], float]:
    """The headers of the delivery's next attempt (one more re-queue counted, RabbitMQ's
    dead-lettering headers dropped) and the countdown before it."""
    headers = {
        name: value
        for name, value in (getattr(request, "headers", None) or {}).items()
        if name not in _X_DEATH_HEADERS
    }
    requeues = int(headers.get(REQUEUE_HEADER) or 0)
    countdown = requeue_countdown(
        requeues,
        cfg.idempotency_retry_base_delay,
        random.random(),  # noqa: S311 - jitter, not security
        cap,
    )
    headers[REQUEUE_HEADER] = requeues + 1
    return headers, countdown
