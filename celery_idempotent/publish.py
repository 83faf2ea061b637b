"""The publish side: duplicates stopped at ``apply_async``, in one Redis round trip.

:func:`publish` is what ``IdempotentTask.apply_async`` does: it computes the key as the
worker will, asks the store (``check_publish``) whether the key is completed, queued or
running, and either returns a result object without publishing or sets a "queued" marker and
publishes (removing the marker if the publish fails). The schedule slot
(``idempotency_window``) is stamped into the message's headers here. The worker ends the marker
of a body that failed for good with :func:`drop_queued_marker`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from celery import states
from celery.result import EagerResult
from celery.utils import uuid

from celery_idempotent import keyspace, signals
from celery_idempotent.exceptions import (
    DuplicatePublishError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyKeyMissingError,
    IdempotencyMismatchError,
)
from celery_idempotent.factory import factory
from celery_idempotent.keys import key_digest
from celery_idempotent.requeue import REQUEUE_HEADER
from celery_idempotent.results import failure_from, is_failure_envelope
from celery_idempotent.settings import DUPLICATE_PUBLISH_POLICIES
from celery_idempotent.stores.redis import PublishDecision, RedisIdempotencyStore
from celery_idempotent.task_keys import SLOT_HEADER, prepare_call

if TYPE_CHECKING:
    from celery_idempotent.guard import DistributedIdempotencyGuard
    from celery_idempotent.task import IdempotentTask

__all__ = ["drop_queued_marker", "publish"]

log = logging.getLogger("celery_idempotent")

#: Publish options that make a message part of a canvas: such a message is published as it
#: is (a deduplicated chord header would hang the chord); the run-time guard replays it.
_CANVAS_OPTIONS = ("chain", "group_id", "chord", "group_index")

#: Sends the message: ``send(task_id, options)`` is Celery's own ``apply_async`` of the call.
Send = Callable[[Any, dict[str, Any]], Any]


class _PublishPlan(NamedTuple):
    """What ``apply_async`` does: return ``result`` (no message), or publish as ``task_id``,
    removing the queued marker (store, record name) if the publish fails."""

    result: Any = None
    task_id: str | None = None
    marker: tuple[RedisIdempotencyStore, str] | None = None


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
) -> Any:
    """Publish a call of ``task`` unless it is a duplicate (see ``IdempotentTask.apply_async``):
    ``send(task_id, options)`` publishes it."""
    options = dict(options)
    policy = options.pop("idempotency_on_duplicate_publish", None)
    if policy is not None and policy not in DUPLICATE_PUBLISH_POLICIES:
        raise ValueError(
            "idempotency_on_duplicate_publish must be one of "
            f"{', '.join(DUPLICATE_PUBLISH_POLICIES)}, got {policy!r}"
        )
    if policy is not None:
        options["_idempotency_policy"] = policy
    plan = _plan_publish(
        task, args, kwargs, task_id, link=link, link_error=link_error, options=options
    )
    if plan.result is not None:
        return plan.result
    try:
        return send(plan.task_id or task_id, options)
    except BaseException:
        if plan.marker is not None and plan.task_id is not None:
            store, record = plan.marker
            try:
                store.drop_queued(record, plan.task_id)
            except Exception as exc:  # it expires after idempotency_publish_ttl
                log.warning("could not remove the queued marker of %s: %r", task.name, exc)
        raise


def _plan_publish(
    task: IdempotentTask,
    args: Any,
    kwargs: Any,
    task_id: str | None,
    *,
    link: Any,
    link_error: Any,
    options: dict[str, Any],
) -> _PublishPlan:
    """Decide a publish: publish (with or without a marker) or return a result object.
    Fills ``options['headers']`` with the schedule slot when there is a window."""
    try:
        cfg = task.idempotency_settings()
    except (TypeError, ValueError):  # reported at worker start and when the task runs
        return _PublishPlan()
    if not cfg.idempotency_enabled:
        return _PublishPlan()
    headers = dict(options.get("headers") or {})
    if cfg.idempotency_window is not None and SLOT_HEADER not in headers:
        headers[SLOT_HEADER] = keyspace.slot_for(time.time(), cfg.idempotency_window)
        options["headers"] = headers
    policy = options.pop("_idempotency_policy", None) or cfg.idempotency_on_duplicate_publish
    if (
        policy == "publish"
        or cfg.in_memory
        or task.app.conf.task_always_eager
        or link
        or link_error
        or any(options.get(name) is not None for name in _CANVAS_OPTIONS)
        or REQUEUE_HEADER in headers
    ):
        return _PublishPlan()
    task_id = str(task_id) if task_id else uuid()
    if not keyspace.can_mark(task_id):
        return _PublishPlan()
    if task.request_stack is None:  # a task class Celery bound as already bound
        from celery.utils.threads import LocalStack  # noqa: PLC0415 - as Task.bind does

        type(task).request_stack = LocalStack()
    task.push_request(id=task_id, headers=headers, eta=options.get("eta"))
    try:
        prepared = prepare_call(task, cfg, tuple(args or ()), dict(kwargs or {}))
    except (TypeError, ValueError, IdempotencyKeyMissingError):
        prepared = None  # the worker reports it when the task runs
    finally:
        task.pop_request()
    if prepared is None:
        return _PublishPlan(task_id=task_id)
    key, _, fingerprint = prepared
    guard = factory.guard(task, cfg)
    store = guard.store
    if not isinstance(store, RedisIdempotencyStore):
        return _PublishPlan(task_id=task_id)
    record = guard.record_key(key)
    try:
        decision = store.check_publish(
            record, guard.lock_resource(key), task_id, fingerprint, cfg.idempotency_publish_ttl
        )
    except IdempotencyConnectionError as exc:
        # Publishing without the check is safe: the worker's guard still decides.
        log.warning("publish-side check of %s skipped, Redis unreachable: %s", task.name, exc)
        return _PublishPlan(task_id=task_id)
    if decision.action == "publish":
        marker = None if decision.unchecked else (store, record)
        return _PublishPlan(task_id=task_id, marker=marker)
    if decision.action == "completed" and decision.task_id == task_id:
        # The very call that completed, sent again with its task id: it goes through, as
        # it does while queued (the worker replays it); no marker over the record.
        return _PublishPlan(task_id=task_id)
    return _PublishPlan(result=_duplicate_publish(task, policy, key, fingerprint, decision))


def _duplicate_publish(
    task: IdempotentTask, policy: str, key: str, fingerprint: str | None, found: PublishDecision
) -> Any:
    """The result object for a publish of a key that is completed, queued or running."""
    stored = found.stored_fingerprint
    if fingerprint is not None and stored is not None and stored != fingerprint:
        raise IdempotencyMismatchError(key, stored, fingerprint)
    first = found.task_id
    signals.idempotency_publish_stopped.send(
        sender=task, task_id=first, key=key, state=found.action
    )
    log.info(
        "duplicate publish of %s stopped: key=%s is %s (task %s)",
        task.name,
        key_digest(key),
        found.action,
        first,
    )
    if policy == "raise":
        raise DuplicatePublishError(key, first)
    if found.action == "queued":
        return task.AsyncResult(first)
    record = found.record
    if record is None:  # pragma: no cover - "completed" always carries its record
        raise IdempotencyBackendError(key, "a completed key without its record")
    result_id = first or uuid()
    if is_failure_envelope(record.result):
        return EagerResult(result_id, failure_from(task, record.result), states.FAILURE)
    return EagerResult(result_id, record.result, states.SUCCESS)


def drop_queued_marker(task: IdempotentTask, guard: DistributedIdempotencyGuard, key: str) -> None:
    """End the queued marker of the delivery running now (its body failed for good)."""
    store = guard.store
    task_id = task.request.id
    if not isinstance(store, RedisIdempotencyStore) or task_id is None:
        return
    try:
        store.drop_queued(guard.record_key(key), str(task_id))
    except Exception as exc:  # it expires after idempotency_publish_ttl anyway
        log.warning("could not end the queued marker of %s[%s]: %r", task.name, task_id, exc)
