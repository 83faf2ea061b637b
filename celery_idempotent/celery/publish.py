"""The publish side: duplicates stopped at ``apply_async``, in one round trip.

:func:`publish` is what ``IdempotentTask.apply_async`` does: it computes the key as the
worker will, asks the store (``check_publish``, the
:class:`~celery_idempotent.core.protocols.ChecksPublishes` capability: Redis and
PostgreSQL) whether the key is completed, queued or running, and either returns a result
object without publishing or sets a "queued" marker and publishes (removing the marker if
the publish fails). With kombu's Redis transport the check runs where kombu pushes the
message (:mod:`celery_idempotent.backends.redis.publish`): on the store's own Redis, the
check, the marker and the push are one script, one round trip. The schedule slot
(``idempotency_window``) is stamped into the message's headers here. The worker ends the
marker of a body that failed for good with :func:`drop_queued_marker`.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from celery import states
from celery.result import EagerResult
from celery.utils import uuid

from celery_idempotent import keyspace, signals
from celery_idempotent.backends.redis import layout as redis_layout
from celery_idempotent.backends.redis import publish as publish_redis
from celery_idempotent.celery import call_options
from celery_idempotent.celery.checks import _checked as checked_apps
from celery_idempotent.celery.checks import at_first_publish
from celery_idempotent.celery.factory import factory
from celery_idempotent.celery.keys import SLOT_HEADER, eta_seconds, prepare_call, received_or_none
from celery_idempotent.celery.requeue import REQUEUE_HEADER
from celery_idempotent.celery.results import failure_from, is_failure_envelope
from celery_idempotent.core.exceptions import (
    DuplicatePublishError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyKeyMissingError,
    IdempotencyMismatchError,
)
from celery_idempotent.core.fingerprint import key_digest
from celery_idempotent.core.protocols import (
    ChecksPublishes,
    ChecksPublishesUntil,
    KeepsClaimedMarkers,
    PublishDecision,
)
from celery_idempotent.core.states import KeyState

if TYPE_CHECKING:
    from celery_idempotent.celery.task import IdempotentTask
    from celery_idempotent.core.guard import DistributedIdempotencyGuard
    from celery_idempotent.settings import IdempotencySettings

__all__ = ["drop_queued_marker", "publish", "publish_checker", "requeue_marker"]

log = logging.getLogger("celery_idempotent")

#: Publish options that make a message part of a canvas: such a message is published as it
#: is (a deduplicated chord header would hang the chord); the run-time guard replays it.
_CANVAS_OPTIONS = ("chain", "group_id", "chord", "group_index")

#: Sends the message: ``send(task_id, options, producer)`` is Celery's own ``apply_async`` of
#: the call (``producer``: the caller's, or ``None`` for one from the app's pool).
Send = Callable[[Any, dict[str, Any], Any], Any]


class _Check(NamedTuple):
    """The publish-side check of one call, not made yet."""

    store: ChecksPublishes
    record: str
    lock: str
    key: str
    fingerprint: str | None
    publish_ttl: float
    policy: str
    until: str = "completed"
    #: ``idempotency_store_errors`` of the call (a stored failure is rebuilt from it).
    store_errors: tuple[type[BaseException], ...] = ()


class _PublishPlan(NamedTuple):
    """What ``apply_async`` does: return ``result`` (no message), or publish as ``task_id``,
    after ``check`` when there is one (see :func:`_checked_publish`)."""

    result: Any = None
    task_id: str | None = None
    check: _Check | None = None


def publish(
    task: IdempotentTask,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    *,
    link: Any,
    link_error: Any,
    options: dict[str, Any],
    send: Send,
    producer: Any = None,
) -> Any:
    """Publish a call of ``task`` unless it is a duplicate (see ``IdempotentTask.apply_async``):
    ``send(task_id, options, producer)`` publishes it (``producer``: the caller's or ``None``)."""
    if task.app not in checked_apps:
        at_first_publish(task.app)
    options = dict(options)
    # Every idempotency_* option of this call: taken (checked) or a TypeError naming it.
    call = call_options.take(task.name, options)
    sent = call_options.carried(call)
    if sent:  # the worker uses the same values (and retries and redeliveries keep them)
        headers = dict(options.get("headers") or {})
        headers[call_options.CALL_OPTIONS_HEADER] = sent
        options["headers"] = headers
    plan = _plan_publish(
        task, args, kwargs, task_id, link=link, link_error=link_error, options=options, call=call
    )
    if plan.result is not None:
        return plan.result
    if plan.check is None or plan.task_id is None:
        return send(plan.task_id or task_id, options, producer)
    if (
        publish_redis.travels_with_push(plan.check.store)
        and _through_redis_broker(task.app, options, producer)
        and publish_redis.install()
    ):
        return _checked_publish(
            task, plan.task_id, plan.check, options, send=send, producer=producer
        )
    decision = _check(task, plan.task_id, plan.check)
    if decision is not None and not publish_redis.goes_through(decision, plan.task_id):
        return _duplicate_publish(task, plan.check, decision)
    try:
        return send(plan.task_id, options, producer)
    except BaseException:
        if decision is not None:
            _drop_marker(task, plan.task_id, plan.check, decision)
        raise


def _checked_publish(
    task: IdempotentTask,
    task_id: str,
    check: _Check,
    options: dict[str, Any],
    *,
    send: Send,
    producer: Any,
) -> Any:
    """Publish through kombu's Redis transport with the check where kombu pushes the message
    (``publish_redis``): one round trip for both when the broker is the store's Redis."""
    pending = publish_redis.pending_for(
        check.store,
        check.record,
        check.lock,
        task_id,
        fingerprint=check.fingerprint,
        publish_ttl=check.publish_ttl,
        until=check.until,
    )
    token = publish_redis.arm(pending)
    stopped = False
    try:
        # The producer is taken from the pool here rather than in Celery's send_task: a
        # duplicate is stopped by an exception out of kombu's publish, and a pooled producer
        # that sees an exception is replaced (its connection closed, the fanout queues its
        # channel declared unbound), which a stopped duplicate must not cost.
        with task.app.producer_or_acquire(producer) as acquired:
            try:
                result = send(task_id, options, acquired)
            except publish_redis.Stopped:
                stopped = True
    except BaseException:
        # The publish failed before its message reached the broker: remove the marker the
        # check set, or may have set (a script that failed after its marker, at the push, or
        # whose reply was lost: the marker names this call's task id, so no other call's
        # marker is touched). Failed after the push (a task-sent event, say): the marker
        # stays, it names a queued message.
        if pending.pushed:
            pass
        elif pending.decision is not None:
            _drop_marker(task, task_id, check, pending.decision)
        elif pending.taken:
            _drop_marker(task, task_id, check, PublishDecision("publish"))
        raise
    finally:
        publish_redis.disarm(token)
    if stopped:
        decision = pending.decision
        if decision is None:  # pragma: no cover - Stopped always carries its decision
            raise IdempotencyBackendError(check.key, "a stopped publish without its decision")
        _forget_result_subscription(task, task_id)
        return _duplicate_publish(task, check, decision)
    if not pending.taken:
        # kombu pushes every message of its Redis transport through the hooked _put or
        # _put_fanout (a channel that does not is checked first): not seen, kombu routed it
        # to no queue (an exchange nothing is bound to) and nothing was published or marked.
        log.debug("%s[%s]: kombu routed the message to no queue", task.name, task_id)
    return result


def _check(task: IdempotentTask, task_id: str, check: _Check) -> PublishDecision | None:
    """The store's decision (one round trip); ``None``: backend unreachable, publish unchecked."""
    store = check.store
    try:
        if check.until != "completed" and isinstance(store, ChecksPublishesUntil):
            return store.check_publish_until(
                check.record,
                check.lock,
                task_id,
                check.fingerprint,
                check.publish_ttl,
                until=check.until,
            )
        return store.check_publish(
            check.record, check.lock, task_id, check.fingerprint, check.publish_ttl
        )
    except IdempotencyConnectionError as exc:
        signals.idempotency_backend_unreachable.send(
            sender=task, task_id=task_id, key=check.key, where="publish", error=exc
        )
        # Publishing without the check is safe: the worker's guard still decides.
        log.warning("publish-side check of %s skipped, backend unreachable: %s", task.name, exc)
        return None


def _drop_marker(
    task: IdempotentTask, task_id: str, check: _Check, decision: PublishDecision
) -> None:
    """Remove the queued marker that ``decision`` set, after the publish failed."""
    if decision.action != "publish" or decision.unchecked:
        return
    try:
        check.store.drop_queued(check.record, task_id)
    except Exception as exc:  # it expires after idempotency_publish_ttl
        log.warning("could not remove the queued marker of %s: %r", task.name, exc)


def _forget_result_subscription(task: IdempotentTask, task_id: str) -> None:
    """Celery's Redis result backend subscribed to ``task_id``'s result before the message
    was stopped: unsubscribe, as the result object of a published call does when dropped."""
    consumer = getattr(task.backend, "result_consumer", None)
    cancel = getattr(consumer, "cancel_for", None)
    if callable(cancel):
        try:
            cancel(task_id)
        except Exception as exc:  # pragma: no cover - a stale subscription costs nothing else
            log.debug("could not unsubscribe from %s: %r", task_id, exc)


#: app -> whether its broker is kombu's Redis transport (read at its first checked publish, as
#: Celery builds the app's producer pool once).
_redis_brokers: weakref.WeakKeyDictionary[Any, bool] = weakref.WeakKeyDictionary()


def _through_redis_broker(app: Any, options: dict[str, Any], producer: Any) -> bool:
    """Whether this publish goes through kombu's Redis transport (where the check can travel
    with the push); the broker is not connected to find out."""
    if options.get("connection") is not None:
        return False  # published on another connection than the app's
    if producer is not None:
        return publish_redis.is_redis_transport(type(producer.connection.transport))
    found = _redis_brokers.get(app)
    if found is None:
        found = False
        if app.conf.get("task_protocol") != 1:  # protocol 1: the task id is not in the headers
            connection = app.connection_for_write()
            try:
                found = publish_redis.is_redis_transport(connection.get_transport_cls())
            finally:
                connection.release()
        _redis_brokers[app] = found
    return found


def _plan_publish(
    task: IdempotentTask,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    *,
    link: Any,
    link_error: Any,
    options: dict[str, Any],
    call: dict[str, Any] | None = None,
) -> _PublishPlan:
    """Decide a publish: publish (with or without a marker) or return a result object.
    Fills ``options['headers']`` with the schedule slot when there is a window. ``call``: the
    call's own ``idempotency_*`` options (checked)."""
    try:
        base = task.idempotency_settings()
    except (TypeError, ValueError):  # reported at worker start and when the task runs
        return _PublishPlan()
    cfg = call_options.with_call_options(base, call or {})
    if not cfg.idempotency_enabled:
        return _PublishPlan()
    headers = dict(options.get("headers") or {})
    if cfg.idempotency_window is not None and SLOT_HEADER not in headers:
        headers[SLOT_HEADER] = keyspace.slot_for(time.time(), cfg.idempotency_window)
        options["headers"] = headers
    policy = cfg.idempotency_on_duplicate_publish
    if (
        policy == "publish"
        or cfg.in_memory
        or task.app.conf.get("task_always_eager")
        or link
        or link_error
        or any(options.get(name) is not None for name in _CANVAS_OPTIONS)
        or REQUEUE_HEADER in headers
    ):
        return _PublishPlan()
    task_id = str(task_id) if task_id else uuid()
    if not redis_layout.can_mark(task_id):
        return _PublishPlan()
    if task.request_stack is None:  # a task class Celery bound as already bound
        from celery.utils.threads import LocalStack  # noqa: PLC0415 - as Task.bind does

        type(task).request_stack = LocalStack()
    # The key as the worker will compute it: from the arguments as the message delivers them.
    received = received_or_none(task, args, kwargs, serializer=options.get("serializer"))
    if received is None:  # no message can carry them: Celery's publish raises its error
        return _PublishPlan(task_id=task_id)
    task.push_request(id=task_id, headers=headers, eta=options.get("eta"))
    try:
        prepared = prepare_call(task, cfg, *received)
    except (TypeError, ValueError, IdempotencyKeyMissingError):
        prepared = None  # the worker reports it when the task runs
    finally:
        task.pop_request()
    if prepared is None:
        return _PublishPlan(task_id=task_id)
    key, _, fingerprint = prepared
    guard = factory.guard(task, base)
    if cfg.idempotency_publish_until == "started" and not isinstance(
        guard.store, ChecksPublishesUntil
    ):
        # Only a store with that capability ends a call's marker as its delivery starts
        # (the Redis store, the SQL backends' marker table).
        raise ValueError(
            f"idempotency_publish_until='started' of task {task.name} needs a store whose "
            f"publish side ends a call's queued marker when it starts (ChecksPublishesUntil: "
            f"a Redis, PostgreSQL or MySQL/MariaDB idempotency_url); its store is a "
            f"{type(guard.store).__name__}"
        )
    store = publish_checker(guard.store)
    if store is None:  # the run-time guard decides alone
        return _PublishPlan(task_id=task_id)
    check = _Check(
        store,
        guard.record_key(key),
        guard.lock_resource(key),
        key,
        fingerprint,
        # A message with a countdown or ETA is delivered that much later: its marker waits
        # for it as long as for a message delivered at once.
        cfg.idempotency_publish_ttl + _delay_of(options),
        policy,
        cfg.idempotency_publish_until,
        cfg.idempotency_store_errors,
    )
    return _PublishPlan(task_id=task_id, check=check)


def _delay_of(options: dict[str, Any]) -> float:
    """Seconds until a message published with ``options`` is due (countdown, ETA), or 0."""
    countdown = options.get("countdown")
    if isinstance(countdown, (int, float)) and not isinstance(countdown, bool) and countdown > 0:
        return float(countdown)
    eta = eta_seconds(options.get("eta"))
    return max(0.0, eta - time.time()) if eta is not None else 0.0


def publish_checker(store: Any) -> ChecksPublishes | None:
    """``store`` when it has the :class:`ChecksPublishes` capability (and, when it says
    whether it can with ``checks_publishes()``, says yes), else ``None``."""
    if not isinstance(store, ChecksPublishes):
        return None
    able = getattr(store, "checks_publishes", None)
    if callable(able) and not able():
        return None
    return store


def _duplicate_publish(task: IdempotentTask, check: _Check, found: PublishDecision) -> Any:
    """The result object for a publish of a key that is completed, queued or running, or
    :class:`IdempotencyMismatchError` / :class:`DuplicatePublishError`."""
    key, fingerprint, policy = check.key, check.fingerprint, check.policy
    stored = found.stored_fingerprint
    if fingerprint is not None and stored is not None and stored != fingerprint:
        signals.idempotency_mismatch_refused.send(
            sender=task, task_id=found.task_id, key=key, where="publish"
        )
        raise IdempotencyMismatchError(key, stored, fingerprint)
    first = found.task_id
    signals.idempotency_publish_stopped.send(
        sender=task, task_id=first, key=key, state=found.action
    )
    state = found.state or (KeyState.COMPLETED if found.action == "completed" else KeyState.QUEUED)
    log.info(
        "duplicate publish of %s stopped: key=%s is %s (task %s)",
        task.name,
        key_digest(key),
        state,
        first,
    )
    if policy == "raise":
        raise DuplicatePublishError(key, first, state=state, ttl_left=found.ttl_left)
    if found.action == "queued":
        return task.AsyncResult(first)
    record = found.record
    if record is None:  # pragma: no cover - "completed" always carries its record
        raise IdempotencyBackendError(key, "a completed key without its record")
    result_id = first or uuid()
    if is_failure_envelope(record.result):
        return EagerResult(
            result_id, failure_from(task, record.result, check.store_errors), states.FAILURE
        )
    return EagerResult(result_id, record.result, states.SUCCESS)


def drop_queued_marker(
    task: IdempotentTask,
    guard: DistributedIdempotencyGuard,
    key: str,
    task_id: Any = None,
    *,
    unless_running: bool = False,
) -> None:
    """End the queued marker of ``task_id`` (default: the delivery running now), whose message
    will not run: its body failed for good, raised ``Ignore`` or ``Reject(requeue=False)``, or
    a worker discarded it (revoked, expired). ``unless_running``: keep a marker that a
    delivery claimed while that delivery's lease is valid (Redis)."""
    store = publish_checker(guard.store)
    task_id = task.request.id if task_id is None else task_id
    if store is None or task_id is None:
        return
    try:
        if unless_running and isinstance(store, KeepsClaimedMarkers):
            store.drop_unclaimed(guard.record_key(key), guard.lock_resource(key), str(task_id))
        else:
            store.drop_queued(guard.record_key(key), str(task_id))
    except Exception as exc:  # a claimed marker is dead with its lease; else publish_ttl
        log.warning("could not end the queued marker of %s[%s]: %r", task.name, task_id, exc)


def requeue_marker(
    task: IdempotentTask, guard: DistributedIdempotencyGuard, key: str, cfg: IdempotencySettings
) -> None:
    """The running delivery's message went back to the queue (a published retry,
    ``Reject(requeue=True)``): its claimed marker is queued again, for
    ``idempotency_publish_ttl`` (SPEC §8: a re-submission gets the queued call). A store
    without markers that live by their lease (no ``requeue_marker``) has nothing to do."""
    store = guard.store
    task_id = task.request.id
    requeue = getattr(store, "requeue_marker", None)
    if not callable(requeue) or task_id is None:
        return
    try:
        requeue(guard.record_key(key), str(task_id), cfg.idempotency_publish_ttl)
    except Exception as exc:  # the key is then free once the lease ends: an extra message
        log.warning("could not re-queue the marker of %s[%s]: %r", task.name, task_id, exc)
