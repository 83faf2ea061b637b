"""One delivery through the guard: the body run at most once per key, a held key handled as
``idempotency_on_locked`` says, the outcome handed back to Celery as a worker hands it on."""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from celery import signals as celery_signals
from celery.exceptions import Ignore, Reject, Retry

from celery_idempotent import signals
from celery_idempotent.celery import keys as task_keys
from celery_idempotent.celery.factory import factory
from celery_idempotent.celery.publish import drop_queued_marker, requeue_marker
from celery_idempotent.celery.requeue import on_locked, requeue, wait_in_place
from celery_idempotent.celery.results import (
    as_delivered,
    failure_envelope,
    failure_from,
    is_failure_envelope,
)
from celery_idempotent.core.exceptions import (
    IdempotencyConnectionError,
    IdempotencyKeyMissingError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
)
from celery_idempotent.core.fingerprint import key_digest
from celery_idempotent.core.guard import (
    ABSENT,
    DistributedIdempotencyGuard,
    Outcome,
    current_lease,
)
from celery_idempotent.core.protocols import EndsMarkerAtClaim
from celery_idempotent.core.two_step import TwoStepBackend
from celery_idempotent.settings import never_stored

if TYPE_CHECKING:
    from celery_idempotent.celery.keys import PreparedCall
    from celery_idempotent.celery.task import IdempotentTask
    from celery_idempotent.settings import IdempotencySettings

__all__ = ["hand_over", "on_revoked", "run", "running_guard"]

log = logging.getLogger("celery_idempotent")


class _Running(NamedTuple):
    """The guarded body running in a context: its guard, task name, task id, key and settings.
    ``retry()`` hands the lease over only when called by that very delivery, not by a task
    called directly inside it."""

    guard: DistributedIdempotencyGuard
    name: str
    task_id: Any
    key: str
    cfg: IdempotencySettings


_running: contextvars.ContextVar[_Running | None] = contextvars.ContextVar(
    "celery_idempotent_guard", default=None
)


def running_guard(task: IdempotentTask) -> DistributedIdempotencyGuard | None:
    """The guard of ``task``'s delivery whose body runs in this context, else ``None`` (also
    for another task, or this task called directly inside that body)."""
    running = _running_of(task)
    return None if running is None else running.guard


def _running_of(task: IdempotentTask) -> _Running | None:
    running = _running.get()
    if running is None or (running.name, running.task_id) != (task.name, task.request.id):
        return None
    return running


def hand_over(task: IdempotentTask) -> None:
    """Celery has published this delivery's retry message (same task id): put its queued
    marker back to queued (it names the retry now, for ``idempotency_publish_ttl``), then give
    up the lease, so that the retry can claim the key. Called from ``apply_async`` of the retry
    (SPEC §8: the lease is kept until then; a refused retry publishes nothing and keeps it)."""
    running = _running_of(task)
    lease = current_lease()
    if running is None or lease is None:
        return
    requeue_marker(task, running.guard, running.key, running.cfg)
    try:
        running.guard.lock_provider.release(lease)
    except Exception as exc:  # the lease expires by itself within lock_ttl
        log.warning("could not release the lock after the retry of %s: %r", task.name, exc)


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
    task's body, at most once per key. Returns (or raises) what Celery hands on: the value,
    a stored failure raised again, for an eager caller the value as a replay gets it. A held
    key follows ``idempotency_on_locked`` (a re-queue raises ``Retry``)."""
    body = _Body(call_body, task, cfg, guard, prepared.key)
    started_ends = cfg.idempotency_publish_until == "started" and task.request.id is not None
    claims: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
    if started_ends and isinstance(guard.backend, EndsMarkerAtClaim):
        # The claim that takes the lock ends this call's queued marker in the same step.
        claims = guard.backend.ending_marker(str(task.request.id))
    elif started_ends and apart(guard):
        # A lock and store that claim apart: the marker ends as the body starts.
        body.on_start = lambda: drop_queued_marker(task, guard, prepared.key)
    slots = _started_slots(guard) if started_ends else None
    if slots is not None:
        # The SQL backends: the body's transaction holds the key's row, which no publish
        # waits for; the marker table's queued slot ends (and the running slot names this
        # call) in a statement of its own as the body starts, before it runs.
        body.on_start = lambda: _start_slots(task, cfg, guard, prepared.key, slots)
    token = _running.set(_Running(guard, task.name, task.request.id, prepared.key, cfg))
    outcome = None
    try:
        with claims:
            outcome = _outcome(task, cfg, guard, prepared, body, args=args, kwargs=kwargs)
    except Retry:
        raise
    except (Ignore, Reject) as exc:
        # Ignore, Reject(requeue=False) from the body: the message will not run, its marker
        # ends now (SPEC §8). Reject(requeue=True) put the marker back to queued (in _Body).
        if body.started and not _requeued(task, exc):
            drop_queued_marker(task, guard, prepared.key)
        raise
    except BaseException as exc:
        _signal_failure(task, prepared.key, exc, where="worker")
        if body.started:  # the body failed for good: its queued marker ends with it
            drop_queued_marker(task, guard, prepared.key)
        raise
    finally:
        _running.reset(token)
        if slots is not None and (body.started or (outcome is not None and outcome.replayed)):
            _end_slots(task, guard, prepared.key, slots)
    if not cfg.idempotency_ttl and not outcome.replayed and apart(guard):
        # idempotency_ttl=0 through a lock and store that commit apart: no record replaced
        # the queued marker, and no script ended it with the lease: end it here.
        drop_queued_marker(task, guard, prepared.key)
    return _handed_on(task, cfg, prepared.key, outcome, body.failed)


def _started_slots(guard: DistributedIdempotencyGuard) -> Any:
    """``guard``'s store when its markers of ``idempotency_publish_until="started"`` are
    slots apart from the key (the SQL backends' marker table, ``start_marker``), else
    ``None``."""
    store = guard.store
    if getattr(store, "publishes_until_started", False) and callable(
        getattr(store, "start_marker", None)
    ):
        return store
    return None


def _start_slots(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    guard: DistributedIdempotencyGuard,
    key: str,
    store: Any,
) -> None:
    """The body starts: its queued marker ends, the running slot names it (at most the
    publish TTL, read only while the key's row is held). A failure leaves the marker to
    expire after ``idempotency_publish_ttl`` (publishes meanwhile see the call queued)."""
    try:
        store.start_marker(guard.record_key(key), str(task.request.id), cfg.idempotency_publish_ttl)
    except Exception as exc:
        log.warning(
            "could not end the queued marker of %s[%s]: %r", task.name, task.request.id, exc
        )


def _end_slots(
    task: IdempotentTask, guard: DistributedIdempotencyGuard, key: str, store: Any
) -> None:
    """The delivery ended after its body started, or replayed: its slots end."""
    try:
        store.end_marker(guard.record_key(key), str(task.request.id))
    except Exception as exc:  # they expire; the running slot is read only while held
        log.warning("could not end the markers of %s[%s]: %r", task.name, task.request.id, exc)


def apart(guard: DistributedIdempotencyGuard) -> bool:
    """Whether ``guard``'s lock provider and store claim and commit apart (a
    ``TwoStepBackend``): a queued marker is then ended by the delivery, not by the backend's
    own claim or commit (Redis: ``CLAIM``/``END``; PostgreSQL: the row the claim locks)."""
    return isinstance(guard.backend, TwoStepBackend)


def _signal_failure(task: Any, key: str, exc: BaseException, *, where: str) -> None:
    """``idempotency_mismatch_refused`` / ``idempotency_backend_unreachable`` for ``exc``."""
    if isinstance(exc, IdempotencyMismatchError):
        signals.idempotency_mismatch_refused.send(
            sender=task, task_id=task.request.id, key=key, where=where
        )
    elif isinstance(exc, IdempotencyConnectionError):
        signals.idempotency_backend_unreachable.send(
            sender=task, task_id=task.request.id, key=key, where=where, error=exc
        )


class _Body:
    """The body as the guard calls it: notes that it started, and turns a failure listed in
    ``idempotency_store_errors`` into the envelope that is stored (noting the failure)."""

    def __init__(
        self,
        call_body: Callable[[], Any],
        task: IdempotentTask,
        cfg: IdempotencySettings,
        guard: DistributedIdempotencyGuard,
        key: str,
    ) -> None:
        self.call_body = call_body
        self.task = task
        self.cfg = cfg
        self.guard = guard
        self.key = key
        self.store_errors = cfg.idempotency_store_errors
        self.started = False
        self.failed: BaseException | None = None
        #: Called as the body starts (before it runs).
        self.on_start: Callable[[], None] | None = None

    def __call__(self) -> Any:
        self.started = True
        if self.on_start is not None:
            self.on_start()
        try:
            if not self.store_errors:
                return self.call_body()
            try:
                return self.call_body()
            except self.store_errors as exc:
                if isinstance(exc, never_stored()):
                    raise
                self.failed = exc
                return failure_envelope(self.task, exc)
        except Reject as exc:
            if _requeued(self.task, exc):
                # The message goes back to the queue: its marker is queued again, set while
                # this delivery still holds the lease (no publish sees it dead in between).
                requeue_marker(self.task, self.guard, self.key, self.cfg)
            raise


def _requeued(task: IdempotentTask, exc: BaseException) -> bool:
    """Whether ``exc`` sends the delivery's message back to the queue: ``Reject(requeue=True)``
    of a late-acked task. (Acked early, the message is acknowledged already: Celery's reject
    does nothing and the message is gone, so its marker ends like an ``Ignore``'s.)"""
    return isinstance(exc, Reject) and bool(exc.requeue) and bool(getattr(task, "acks_late", False))


def _outcome(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    guard: DistributedIdempotencyGuard,
    prepared: PreparedCall,
    body: _Body,
    *,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
) -> Outcome[Any]:
    """The guard's outcome for this delivery. A key held by another delivery, or a backend
    unreachable before the body ran, ends the delivery (re-queued, an error, ignored or
    rejected), except in an eager call that retries: that one waits here and tries again."""
    request = task.request
    key, payload, fingerprint = prepared
    while True:
        try:
            return guard.run(
                key,
                body,
                input=payload if fingerprint is not None else ABSENT,
                fingerprint=fingerprint,
                task_id=None if request.id is None else str(request.id),
                ttl=None if cfg.idempotency_ttl == guard.ttl else cfg.idempotency_ttl,
            )
        except LockAcquisitionError as exc:
            log.info(
                "key held by another delivery for %s[%s] key=%s after %d attempt(s): %s",
                task.name,
                request.id,
                key_digest(key),
                exc.attempts,
                cfg.idempotency_on_locked,
            )
            if request.is_eager and cfg.idempotency_on_locked == "retry":
                wait_in_place(task, cfg)  # no queue to come back through: try again here
                continue
            on_locked(task, cfg, key, exc, args=args, kwargs=kwargs)  # ends the delivery
        except IdempotencyConnectionError as exc:
            # Redis unreachable before the body ran: nothing happened, so a re-queue is safe.
            # After the body ran the error stands (the result is not stored). In eager mode
            # there is no queue to come back through: waiting in place for a Redis that may
            # never answer (a wrong URL) would hang the caller.
            if body.started or cfg.idempotency_on_locked != "retry" or request.is_eager:
                raise
            _signal_failure(task, key, exc, where="worker")  # re-queued: the signal still says so
            log.warning(
                "idempotency backend unreachable for %s[%s]; re-queueing: %s",
                task.name,
                request.id,
                exc,
            )
            requeue(task, cfg, exc, args, kwargs)
        except LockLostError as exc:
            if body.failed is not None:  # the failure was not stored: it stands as it is
                raise body.failed from exc
            raise


def _handed_on(
    task: IdempotentTask,
    cfg: IdempotencySettings,
    key: str,
    outcome: Outcome[Any],
    failed: BaseException | None,
) -> Any:
    """The outcome as Celery hands it on: a stored failure raised again, an eager first run's
    value as its replays will get it."""
    request = task.request
    if is_failure_envelope(outcome.value):
        if failed is not None and not outcome.replayed:
            raise failed
        stored = failure_from(task, outcome.value, cfg.idempotency_store_errors)
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


def on_revoked(
    sender: Any = None,
    request: Any = None,
    terminated: bool = False,
    expired: bool = False,
    **_: Any,
) -> None:
    """Celery's ``task_revoked``: a worker discarded a message (revoked, or past its
    ``expires``) or terminated its body. The message will not run: its queued marker ends
    now, unless a delivery that claimed it still holds a valid lease (a terminated body's
    lease runs out within ``lock_ttl``, and the marker with it). SPEC §8."""
    from celery_idempotent.celery.task import IdempotentTask  # noqa: PLC0415 - a cycle

    if not isinstance(sender, IdempotentTask) or request is None:
        return
    task_id = getattr(request, "id", None)
    if task_id is None:
        return
    try:
        cfg = sender.idempotency_settings()
        if not cfg.idempotency_enabled or cfg.in_memory:
            return
        prepared = _prepared_of(sender, cfg, request)
        if prepared is None:
            return
        guard = factory.guard(sender, cfg)
        drop_queued_marker(sender, guard, prepared.key, task_id, unless_running=True)
    except Exception as exc:  # a claimed marker ends with its lease; else publish_ttl
        log.warning(
            "could not end the queued marker of revoked %s[%s]: %r", sender.name, task_id, exc
        )
    else:
        log.debug(
            "%s[%s] %s: its queued marker ended",
            sender.name,
            task_id,
            "terminated" if terminated else "expired" if expired else "revoked",
        )


def _prepared_of(task: IdempotentTask, cfg: IdempotencySettings, request: Any) -> Any:
    """The key of the call in a worker's ``request`` (a Celery ``Context``), as its delivery
    would derive it: from the arguments it carries, the request pushed for the headers."""
    args = tuple(getattr(request, "args", None) or ())
    kwargs = dict(getattr(request, "kwargs", None) or {})
    task.push_request(dict(vars(request), is_eager=False))
    try:
        return task_keys.prepare_call(task, cfg, args, kwargs)
    except (TypeError, ValueError, IdempotencyKeyMissingError):
        return None
    finally:
        task.pop_request()


celery_signals.task_revoked.connect(
    on_revoked, weak=False, dispatch_uid="celery_idempotent.on_revoked"
)
