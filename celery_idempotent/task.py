"""``IdempotentTask``: a Celery task base that runs each idempotency key's body once.

Celery's tracer calls a task's own ``__call__`` when the class defines one, after it has pushed
the request; ``IdempotentTask.__call__`` reads the request, derives the key and runs the body
(``super().__call__``) through a :class:`~celery_idempotent.DistributedIdempotencyGuard`.
One task instance serves every thread of a process, so nothing per call is kept on ``self``.
"""

from __future__ import annotations

import contextvars
import datetime as _dt
import inspect
import logging
import os
import random
import string
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

from celery import Task, states
from celery import signals as celery_signals
from celery.exceptions import Ignore, Reject, Retry
from celery.result import EagerResult
from celery.utils import uuid

from celery_idempotent import _green, admin, keyspace, signals
from celery_idempotent._health import eviction_policy, eviction_warning
from celery_idempotent._redis import SentinelClientFactory, import_redis, make_client
from celery_idempotent.admin import Forgotten, IdempotencyStatus
from celery_idempotent.backoff import ExponentialJitterBackoff
from celery_idempotent.exceptions import (
    DuplicatePublishError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyKeyMissingError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
)
from celery_idempotent.guard import ABSENT, DistributedIdempotencyGuard, GuardEvent, current_lease
from celery_idempotent.keys import fingerprint_payload, key_digest
from celery_idempotent.keyspace import task_key
from celery_idempotent.locks.memory import MemoryLockProvider
from celery_idempotent.locks.redis import RedisLockProvider
from celery_idempotent.protocols import IdempotencyStore, LockProvider
from celery_idempotent.settings import (
    DUPLICATE_PUBLISH_POLICIES,
    IdempotencySettings,
    declared_by_task,
    make_client_from,
    never_stored,
    resolve,
    task_option_defaults,
)
from celery_idempotent.stores.memory import MemoryIdempotencyStore
from celery_idempotent.stores.redis import PublishDecision, RedisIdempotencyStore
from celery_idempotent.urls import redact

__all__ = [
    "FAILURE_MARKER",
    "KEY_HEADER",
    "REQUEUE_HEADER",
    "SLOT_HEADER",
    "IdempotentTask",
    "check_beat_schedule",
    "check_namespaces",
    "reset_backends",
]

log = logging.getLogger("celery_idempotent")

#: The per-call header that sets the key explicitly:
#: ``task.apply_async(args, headers={"idempotency_key": "payment-42"})``.
KEY_HEADER = "idempotency_key"
#: How many times a duplicate was re-queued because its key was held (drives the countdown).
REQUEUE_HEADER = "idempotency_requeues"
#: The schedule slot (``idempotency_window``) stamped at publish, so that redeliveries keep it.
SLOT_HEADER = "idempotency_slot"
#: Publish options that make a message part of a canvas: such a message is published as it
#: is (a deduplicated chord header would hang the chord); the run-time guard replays it.
_CANVAS_OPTIONS = ("chain", "group_id", "chord", "group_index")

#: The key of the envelope in which a failure listed in ``idempotency_store_errors`` is stored:
#: ``{FAILURE_MARKER: 1, "exc": <the exception as Celery's result backend serializes it>}``.
FAILURE_MARKER = "__celery_idempotent_failure__"

#: The longest wait between two lock attempts of one delivery (the guard's back-off), and
#: between re-tries of an eager ``apply()`` whose key is held: the caller is blocked meanwhile.
MAX_REQUEUE_DELAY = 5.0
#: The longest countdown of a re-queued duplicate that found its key held. The countdown
#: doubles from ``idempotency_retry_base_delay`` up to this, so a duplicate waits at most
#: about as long again as it has waited (never more than this) after the key is released,
#: and a duplicate waiting on a body that runs for an hour is re-published about 90 times,
#: not about 960 times as with a 5 s cap (the fault suite measures both).
MAX_REQUEUE_COUNTDOWN = 60.0


def requeue_countdown(requeues: int, base: float, rand: float, cap: float) -> float:
    """Seconds before a duplicate re-queued ``requeues`` times so far is delivered again:
    ``base * 2**requeues`` capped at ``cap``, times a jitter of ``0.5 + rand / 2`` (``rand``
    in [0, 1)) so that the duplicates of one key do not arrive in lockstep."""
    backoff = ExponentialJitterBackoff(max(base, 0.05), cap, lambda: rand, jitter="equal")
    return backoff.delay(requeues)


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

#: Set on the request of a delivery while IdempotentTask.__call__ handles it.
_GUARDED = "_idempotency_guarded"

_backends_lock = threading.Lock()
# (pid, "url", url | "client", id(client), prefix, serializer, accept) -> (the client setting
# or None, (lock provider, store)); per process because a client made before fork must not be
# shared with the children.
_backends: dict[tuple[Any, ...], tuple[Any, tuple[LockProvider, IdempotencyStore]]] = {}
# (pid, id(app), task name) -> (the settings it was built from, guard). The settings object
# is cached per app (settings.resolve), so "is" tells a stale entry: an app whose id was
# reused after garbage collection, or settings re-read after clear_cache().
_guards: dict[tuple[Any, ...], tuple[IdempotencySettings, DistributedIdempotencyGuard]] = {}

# (guard, task name, task id) of the guarded body running in this context: retry() releases
# the lease only when it is called by that very delivery, not by a task called directly inside.
_current_guard: contextvars.ContextVar[tuple[DistributedIdempotencyGuard, str, Any] | None] = (
    contextvars.ContextVar("celery_idempotent_guard", default=None)
)


#: Exceptions that are Celery's control flow, not a body failing.
_CONTROL_FLOW = (Retry, Ignore, Reject)


class _PublishPlan(NamedTuple):
    """What ``apply_async`` does: return ``result`` (no message), or publish as ``task_id``,
    removing the queued marker (store, record name) if the publish fails."""

    result: Any = None
    task_id: str | None = None
    marker: tuple[RedisIdempotencyStore, str] | None = None


def _eta_seconds(eta: Any) -> float | None:
    """A request's ETA (ISO text or datetime) as epoch seconds, or ``None``."""
    if not eta:
        return None
    if isinstance(eta, str):
        try:
            eta = _dt.datetime.fromisoformat(eta)
        except ValueError:
            return None
    if isinstance(eta, _dt.datetime):
        if eta.tzinfo is None:
            eta = eta.replace(tzinfo=_dt.timezone.utc)
        return float(eta.timestamp())
    return None


def reset_backends() -> None:
    """Forget every client and guard made so far (tests; after changing settings)."""
    with _backends_lock:
        _backends.clear()
        _guards.clear()


class IdempotentTask(Task):  # type: ignore[misc]
    """A task whose body runs once per idempotency key; duplicates get the stored result.

    Use it as ``@app.task(base=IdempotentTask)``. The key comes from, in order: a per-call
    ``idempotency_key`` header; else the ``idempotency_key`` option or setting: ``"args"``
    (the canonical hash of the arguments bound to the signature, defaults applied),
    ``"task_id"``, a format string over the bound arguments (``"order:{order_id}"``), or a
    callable ``(task, args, kwargs) -> str``. Keys are namespaced by the task's name, or by
    ``idempotency_namespace``. A key whose format field is ``None`` (or a callable's ``None``)
    raises ``IdempotencyKeyMissingError``, or runs unguarded with
    ``idempotency_missing_key="run"``.

    The fingerprint of the bound arguments (or of those ``idempotency_fingerprint`` names) is
    stored with the result: a later delivery with the same key and other arguments fails with
    ``IdempotencyMismatchError``. A body that raises one of ``idempotency_store_errors``
    stores that failure; its duplicates raise it again without running the body.

    Inside the body, :func:`celery_idempotent.current_lease` gives the lease and its fencing
    token. A direct call ``task(...)`` (no Celery request) runs the body plainly.
    """

    abstract = True
    # Every setting is also a task option of the same name, set on this class below from the
    # settings' declarations (settings.task_option_defaults).

    # -- the call ---------------------------------------------------------------------------

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        request = self.request
        if request.called_directly or getattr(request, _GUARDED, False):
            # No request of its own: a direct call, also one from inside this task's own
            # body, where Celery leaves the running delivery's request (or a copy of it) on
            # top of the stack. Guarding it would take that delivery's key.
            return super().__call__(*args, **kwargs)
        cfg = self.idempotency_settings()
        if not cfg.idempotency_enabled:
            return super().__call__(*args, **kwargs)
        # Every delivery gets a request of its own (the tracer pushes a fresh one); a direct
        # call finds this one, or the copy Task.__call__ pushes of it, marked.
        setattr(request, _GUARDED, True)
        try:
            prepared = self._prepare_call(cfg, args, kwargs)
            if prepared is None:  # no key, idempotency_missing_key="run"
                return super().__call__(*args, **kwargs)
            return self._guarded_call(cfg, prepared, args, kwargs)
        finally:
            setattr(request, _GUARDED, False)

    def _prepare_call(
        self, cfg: IdempotencySettings, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[str, Any, str | None] | None:
        """(key, payload, fingerprint) of this delivery; ``None``: run it unguarded."""
        payload = self._bound_arguments(args, kwargs)
        args_hash = fingerprint_payload(payload) if _hashes_args(cfg) else None
        try:
            key = self.idempotency_key_for(args, kwargs, payload=payload, fingerprint=args_hash)
        except IdempotencyKeyMissingError as exc:
            if cfg.idempotency_missing_key != "run":
                raise
            log.warning(
                "no idempotency key for %s[%s] (%s is None): running it unguarded "
                "(idempotency_missing_key='run')",
                self.name,
                self.request.id,
                f"field {exc.field!r}" if exc.field is not None else "the key callable",
            )
            return None
        if cfg.idempotency_fingerprint == "args":
            return key, payload, args_hash
        return key, payload, self.idempotency_fingerprint_for(args, kwargs, payload=payload)

    def _guarded_call(
        self,
        cfg: IdempotencySettings,
        prepared: tuple[str, Any, str | None],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> Any:
        request = self.request
        key, payload, fingerprint = prepared
        guard = self._guard(cfg)
        started: list[bool] = []
        failed: list[BaseException] = []
        store_errors = cfg.idempotency_store_errors

        def body() -> Any:
            started.append(True)
            if not store_errors:
                return super(IdempotentTask, self).__call__(*args, **kwargs)
            try:
                return super(IdempotentTask, self).__call__(*args, **kwargs)
            except store_errors as exc:
                if isinstance(exc, never_stored()):
                    raise
                failed.append(exc)
                return self._failure_envelope(exc)

        token = _current_guard.set((guard, self.name, request.id))
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
                    self._on_locked(cfg, key, exc, args, kwargs)
                except IdempotencyConnectionError as exc:
                    # Redis unreachable before the body ran: nothing happened, so a re-queue
                    # is safe. After the body ran the error stands (the result is not stored).
                    # In eager mode there is no queue to come back through: waiting in place
                    # for a Redis that may never answer (a wrong URL) would hang the caller.
                    if started or cfg.idempotency_on_locked != "retry" or request.is_eager:
                        raise
                    log.warning(
                        "idempotency backend unreachable for %s[%s]; re-queueing: %s",
                        self.name,
                        request.id,
                        exc,
                    )
                    self._requeue(cfg, exc, args, kwargs)
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
                self._drop_queued_marker(guard, key)
            raise
        finally:
            _current_guard.reset(token)
        if _is_failure_envelope(outcome.value):
            if failed and not outcome.replayed:
                raise failed[0]
            stored = self._failure_from(outcome.value)
            log.info(
                "replayed stored failure %s for %s[%s] key=%s",
                type(stored).__name__,
                self.name,
                request.id,
                key_digest(key),
            )
            raise stored
        if not outcome.replayed and request.is_eager and not cfg.in_memory:
            # A worker hands the body's value to the caller, links and chains through the
            # result serializer; eagerly Celery hands over the object itself. Give the first
            # eager caller what its replays will get (JSON: a tuple arrives as a list).
            return self._as_delivered(outcome.value)
        if outcome.replayed and log.isEnabledFor(logging.INFO):
            log.info(
                "replayed stored result for %s[%s] key=%s (fencing token %s)",
                self.name,
                request.id,
                key_digest(key),
                outcome.fencing_token,
            )
        return outcome.value

    def _drop_queued_marker(self, guard: DistributedIdempotencyGuard, key: str) -> None:
        """End this delivery's queued marker (its body failed for good)."""
        store = guard.store
        task_id = self.request.id
        if not isinstance(store, RedisIdempotencyStore) or task_id is None:
            return
        try:
            store.drop_queued(guard.record_key(key), str(task_id))
        except Exception as exc:  # it expires after idempotency_publish_ttl anyway
            log.warning("could not end the queued marker of %s[%s]: %r", self.name, task_id, exc)

    # -- the publish side -------------------------------------------------------------------

    def apply_async(  # noqa: PLR0917 - Celery's own signature
        self,
        args: Any = None,
        kwargs: Any = None,
        task_id: str | None = None,
        producer: Any = None,
        link: Any = None,
        link_error: Any = None,
        shadow: Any = None,
        **options: Any,
    ) -> Any:
        """Celery's ``apply_async``, with duplicates stopped at publish (one Redis round trip).

        The key is computed as the worker will compute it. When it is already completed, no
        message is published and the result object returned has the first execution's task
        id and its stored value (``.get()`` returns at once); when a call with the key is
        queued or running, ``AsyncResult(<its task id>)``; with another fingerprint,
        :class:`IdempotencyMismatchError` is raised here. Otherwise a "queued" marker (task id
        and fingerprint) is set, then the message published (the marker is removed if the
        publish fails). ``idempotency_on_duplicate_publish`` (a setting, a task option, or an
        option of this call) can make a duplicate raise :class:`DuplicatePublishError` or
        publish anyway.

        Published as they are, without the check: a call with its marker's own task id
        (``retry()``, a client re-sending), the library's re-queues, calls with ``link``,
        ``link_error``, or part of a chain, group or chord, eager calls, memory:// backends.
        ``app.send_task`` does not come through here.
        """
        options = dict(options)
        policy = options.pop("idempotency_on_duplicate_publish", None)
        if policy is not None and policy not in DUPLICATE_PUBLISH_POLICIES:
            raise ValueError(
                "idempotency_on_duplicate_publish must be one of "
                f"{', '.join(DUPLICATE_PUBLISH_POLICIES)}, got {policy!r}"
            )
        if policy is not None:
            options["_idempotency_policy"] = policy
        plan = self._plan_publish(
            args, kwargs, task_id, link=link, link_error=link_error, options=options
        )
        if plan.result is not None:
            return plan.result
        try:
            return super().apply_async(
                args, kwargs, plan.task_id or task_id, producer, link, link_error, shadow, **options
            )
        except BaseException:
            if plan.marker is not None and plan.task_id is not None:
                store, record = plan.marker
                try:
                    store.drop_queued(record, plan.task_id)
                except Exception as exc:  # it expires after idempotency_publish_ttl
                    log.warning("could not remove the queued marker of %s: %r", self.name, exc)
            raise

    def _plan_publish(
        self,
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
            cfg = self.idempotency_settings()
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
            or self.app.conf.task_always_eager
            or link
            or link_error
            or any(options.get(name) is not None for name in _CANVAS_OPTIONS)
            or REQUEUE_HEADER in headers
        ):
            return _PublishPlan()
        task_id = str(task_id) if task_id else uuid()
        if not keyspace.can_mark(task_id):
            return _PublishPlan()
        if self.request_stack is None:  # a task class Celery bound as already bound
            from celery.utils.threads import LocalStack  # noqa: PLC0415 - as Task.bind does

            type(self).request_stack = LocalStack()
        self.push_request(id=task_id, headers=headers, eta=options.get("eta"))
        try:
            prepared = self._prepare_call(cfg, tuple(args or ()), dict(kwargs or {}))
        except (TypeError, ValueError, IdempotencyKeyMissingError):
            prepared = None  # the worker reports it when the task runs
        finally:
            self.pop_request()
        if prepared is None:
            return _PublishPlan(task_id=task_id)
        key, _, fingerprint = prepared
        guard = self._guard(cfg)
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
            log.warning("publish-side check of %s skipped, Redis unreachable: %s", self.name, exc)
            return _PublishPlan(task_id=task_id)
        if decision.action == "publish":
            marker = None if decision.unchecked else (store, record)
            return _PublishPlan(task_id=task_id, marker=marker)
        if decision.action == "completed" and decision.task_id == task_id:
            # The very call that completed, sent again with its task id: it goes through, as
            # it does while queued (the worker replays it); no marker over the record.
            return _PublishPlan(task_id=task_id)
        return _PublishPlan(result=self._duplicate_publish(policy, key, fingerprint, decision))

    def _duplicate_publish(
        self, policy: str, key: str, fingerprint: str | None, found: PublishDecision
    ) -> Any:
        """The result object for a publish of a key that is completed, queued or running."""
        stored = found.stored_fingerprint
        if fingerprint is not None and stored is not None and stored != fingerprint:
            raise IdempotencyMismatchError(key, stored, fingerprint)
        first = found.task_id
        signals.idempotency_publish_stopped.send(
            sender=self, task_id=first, key=key, state=found.action
        )
        log.info(
            "duplicate publish of %s stopped: key=%s is %s (task %s)",
            self.name,
            key_digest(key),
            found.action,
            first,
        )
        if policy == "raise":
            raise DuplicatePublishError(key, first)
        if found.action == "queued":
            return self.AsyncResult(first)
        record = found.record
        if record is None:  # pragma: no cover - "completed" always carries its record
            raise IdempotencyBackendError(key, "a completed key without its record")
        result_id = first or uuid()
        if _is_failure_envelope(record.result):
            return EagerResult(result_id, self._failure_from(record.result), states.FAILURE)
        return EagerResult(result_id, record.result, states.SUCCESS)

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``, after releasing this delivery's lock.

        ``Task.retry`` publishes the retry message before it raises ``Retry``; with a
        concurrent pool the retry could otherwise arrive while the lock is still held.
        """
        running = _current_guard.get()
        lease = current_lease()
        if (
            running is not None
            and lease is not None
            and running[1:] == (self.name, self.request.id)
            and not self.request.called_directly
        ):
            try:
                running[0].lock_provider.release(lease)
            except Exception as exc:  # the lease expires by itself; retrying matters more
                log.warning("could not release the lock before retry of %s: %r", self.name, exc)
        return super().retry(*args, **kwargs)

    # -- keys -------------------------------------------------------------------------------

    def idempotency_settings(self) -> IdempotencySettings:
        """The settings in force for this task (task options over ``app.conf``)."""
        return resolve(self.app, self)

    def idempotency_namespace_of(self) -> str:
        """The namespace of this task's keys: ``idempotency_namespace``, else its name."""
        return self.idempotency_settings().idempotency_namespace or str(self.name)

    def idempotency_key_for(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        payload: Any = None,
        fingerprint: str | None = None,
    ) -> str:
        """The namespaced key of a call with ``args`` and ``kwargs`` in the current request.

        ``fingerprint``, when given, is the hash of every bound argument (the ``"args"`` key);
        raises :class:`IdempotencyKeyMissingError` when a format field or the key callable
        gives ``None``.
        """
        cfg = self.idempotency_settings()
        key = self._unslotted_key(cfg, args, kwargs, payload=payload, fingerprint=fingerprint)
        if cfg.idempotency_window is None:
            return key
        return keyspace.with_slot(key, self._slot_of_request(cfg.idempotency_window))

    def _slot_of_request(self, window: float) -> str:
        """The schedule slot of this delivery: stamped at publish, else its ETA's, else the
        worker clock's (a message published by ``send_task``)."""
        request = self.request
        headers = getattr(request, "headers", None) or {}
        slot = headers.get(SLOT_HEADER) if isinstance(headers, dict) else None
        if slot is None:
            slot = getattr(request, SLOT_HEADER, None)
        if isinstance(slot, str) and slot:
            return slot
        when = _eta_seconds(getattr(request, "eta", None)) or time.time()
        return keyspace.slot_for(when, window)

    def _unslotted_key(
        self,
        cfg: IdempotencySettings,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        *,
        payload: Any,
        fingerprint: str | None,
    ) -> str:
        namespace = cfg.idempotency_namespace or self.name
        headers = getattr(self.request, "headers", None) or {}
        explicit = headers.get(KEY_HEADER) if isinstance(headers, dict) else None
        if explicit is None:
            explicit = getattr(self.request, KEY_HEADER, None)
        if explicit is not None:
            if not isinstance(explicit, str) or not explicit:
                raise TypeError(
                    f"the {KEY_HEADER!r} header must be a non-empty str, got {explicit!r}"
                )
            return task_key(namespace, "key", explicit)
        if cfg.idempotency_key == "task_id":
            return task_key(namespace, "id", str(self.request.id))
        return self._derived_key(cfg, args, kwargs, payload, fingerprint)

    def _derived_key(
        self,
        cfg: IdempotencySettings,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        payload: Any,
        fingerprint: str | None,
    ) -> str:
        """The key the ``idempotency_key`` strategy derives from the arguments (``"args"``, a
        format string or a callable; not ``"task_id"``), without reading the request."""
        namespace = cfg.idempotency_namespace or self.name
        strategy = cfg.idempotency_key
        if payload is None:
            payload = self._bound_arguments(args, kwargs)
        if callable(strategy):
            key = strategy(self, args, kwargs)
            if key is None:
                name = getattr(strategy, "__qualname__", None) or type(strategy).__name__
                raise IdempotencyKeyMissingError(f"<callable {name}>", self.name, None)
            if not isinstance(key, str) or not key:
                raise TypeError(
                    f"idempotency_key callable of task {self.name} must return a non-empty "
                    f"str (or None: no key), returned {type(key).__name__}"
                )
            return task_key(namespace, "key", key)
        if strategy == "args":
            return task_key(namespace, "args", fingerprint or fingerprint_payload(payload))
        return task_key(namespace, "key", self._format_key(strategy, payload))

    def idempotency_fingerprint_for(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, payload: Any = None
    ) -> str | None:
        """The fingerprint stored with a call's result and compared with its duplicates'
        (``None``: not compared), as ``idempotency_fingerprint`` says."""
        setting = self.idempotency_settings().idempotency_fingerprint
        if setting is None:
            return None
        if payload is None:
            payload = self._bound_arguments(args, kwargs)
        if setting == "args":
            return fingerprint_payload(payload)
        if callable(setting):
            value = setting(self, args, kwargs)
            if value is None:
                return None
            if not isinstance(value, str):
                raise TypeError(
                    f"idempotency_fingerprint callable of task {self.name} must return a str "
                    f"or None, returned {type(value).__name__}"
                )
            # Hashed: it may hold argument values, and Redis keeps it for idempotency_ttl.
            return fingerprint_payload(["fingerprint_fn", value])
        missing = [name for name in setting if name not in payload]
        if missing:
            raise ValueError(
                f"idempotency_fingerprint {setting!r} of task {self.name} names "
                f"{', '.join(missing)}, which the task has no argument for "
                f"(arguments: {', '.join(payload) or 'none'})"
            )
        return fingerprint_payload({name: payload[name] for name in setting})

    def _format_key(self, template: str, payload: dict[str, Any]) -> str:
        names = {
            field.split(".")[0].split("[")[0]
            for _, field, _, _ in string.Formatter().parse(template)
            if field is not None
        }
        if "" in names or any(n.isdigit() for n in names):
            raise ValueError(
                f"idempotency_key {template!r} of task {self.name} must name its fields, "
                "e.g. 'order:{order_id}'"
            )
        missing = sorted(names - set(payload))
        if missing:
            raise ValueError(
                f"idempotency_key {template!r} of task {self.name} names "
                f"{', '.join(missing)}, which the task has no argument for "
                f"(arguments: {', '.join(payload) or 'none'})"
            )
        return _KeyFormatter(template, self.name).format(template, **payload)

    def _bound_arguments(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
        """The call's arguments by parameter name, defaults applied: f(1) == f(x=1)."""
        cls = type(self)
        # One signature per task class (computing it costs more than the rest of the call).
        signature = cls.__dict__.get("_idempotency_signature")
        if signature is None or signature[0] is not cls.run:
            try:
                signature = (cls.run, inspect.signature(self.run))
            except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
                return {"args": list(args), "kwargs": dict(kwargs)}
            cls._idempotency_signature = signature
        signature = signature[1]
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise TypeError(f"{self.name}: {exc}") from exc
        bound.apply_defaults()
        return dict(bound.arguments)

    # -- admin ------------------------------------------------------------------------------

    def idempotency_status(
        self,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        task_id: str | None = None,
    ) -> IdempotencyStatus:
        """What the store holds for one key of this task: a frozen
        :class:`~celery_idempotent.admin.IdempotencyStatus` (state ``"completed"``,
        ``"running"`` or ``"absent"``, task id where known, age, TTL left, fencing token,
        fingerprint), read in one round trip, as ``celery -A proj idempotency inspect`` reads it.

        The key is the one a call with ``args`` and ``kwargs`` uses (shaped like
        ``apply_async``: ``charge.idempotency_status((42, 999))``), or ``key``, an explicit key
        as the ``idempotency_key`` header gives it, or ``task_id`` for a task keyed by task id.
        """
        cfg = self.idempotency_settings()
        nkey = self._admin_key(cfg, args, kwargs, key, task_id)
        client = self._admin_client(cfg)
        if client is None:
            return admin.status_from_guard(self._guard(cfg), nkey)
        return admin.status_of(admin.read_key(client, cfg.idempotency_key_prefix, nkey))

    def idempotency_forget(
        self,
        args: Sequence[Any] = (),
        kwargs: Mapping[str, Any] | None = None,
        *,
        key: str | None = None,
        task_id: str | None = None,
        force: bool = False,
    ) -> Forgotten:
        """Delete one key's record (named as for :meth:`idempotency_status`): its next delivery
        runs the body again. Returns a :class:`~celery_idempotent.admin.Forgotten`.

        A held lock means a delivery is running the body now: without ``force`` that raises
        :class:`~celery_idempotent.IdempotencyKeyHeldError` and nothing is deleted; with
        ``force`` the lock goes too, if it is still the lease that was read. The same as
        ``celery -A proj idempotency forget`` (``--force``).
        """
        cfg = self.idempotency_settings()
        nkey = self._admin_key(cfg, args, kwargs, key, task_id)
        client = self._admin_client(cfg)
        if client is None:
            return admin.forget_from_guard(self._guard(cfg), nkey, force=force)
        info = admin.read_key(client, cfg.idempotency_key_prefix, nkey)
        return admin.forget_key(client, info, force=force)

    def _admin_key(
        self,
        cfg: IdempotencySettings,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        key: str | None,
        task_id: str | None,
    ) -> str:
        """The namespaced key that the admin methods' arguments name (never from the current
        request: called inside a body, it must not take that delivery's header)."""
        namespace = cfg.idempotency_namespace or self.name
        named = [(what, value) for what, value in (("key", key), ("task_id", task_id)) if value]
        if key is not None or task_id is not None:
            if len(named) != 1 or args or kwargs:
                raise TypeError(
                    f"{self.name}: name one key: args/kwargs, key= or task_id= (got "
                    f"args={args!r}, kwargs={kwargs!r}, key={key!r}, task_id={task_id!r})"
                )
            what, value = named[0]
            if not isinstance(value, str):
                raise TypeError(f"{what} must be a non-empty str, got {value!r}")
            return task_key(namespace, "key" if what == "key" else "id", value)
        if cfg.idempotency_key == "task_id":
            raise TypeError(
                f"{self.name} is keyed by task id (idempotency_key='task_id'): pass task_id=..."
            )
        if isinstance(args, (str, bytes)) or not isinstance(args, Sequence):
            raise TypeError(f"args must be a tuple or list, as for apply_async, not {args!r}")
        call_args, call_kwargs = tuple(args), dict(kwargs or {})
        return self._derived_key(cfg, call_args, call_kwargs, None, None)

    def _admin_client(self, cfg: IdempotencySettings) -> Any:
        """The task's own Redis client (its backends'), or ``None`` for another backend."""
        _, store = self._backends(cfg)
        return store.client if isinstance(store, RedisIdempotencyStore) else None

    # -- contention -------------------------------------------------------------------------

    def _on_locked(
        self,
        cfg: IdempotencySettings,
        key: str,
        exc: LockAcquisitionError,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Apply ``idempotency_on_locked``; returns only to try again (eager mode)."""
        policy = cfg.idempotency_on_locked
        log.info(
            "key held by another delivery for %s[%s] key=%s after %d attempt(s): %s",
            self.name,
            self.request.id,
            key_digest(key),
            exc.attempts,
            policy,
        )
        if policy == "raise":
            raise exc
        if policy == "ignore":
            raise Ignore(f"idempotency key held by another delivery: {key_digest(key)}")
        if policy == "reject":
            raise Reject(
                f"idempotency key held by another delivery: {key_digest(key)}", requeue=False
            )
        self._requeue(cfg, exc, args, kwargs)

    def _requeue(
        self,
        cfg: IdempotencySettings,
        exc: Exception,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
    ) -> None:
        """Re-publish this delivery with a growing countdown, without counting a retry.

        ``Task.retry`` would count against ``max_retries``: a duplicate of a body that runs
        for minutes would end in ``MaxRetriesExceededError`` instead of the stored result.
        In eager mode (``apply()``) there is no queue: wait here and let the caller loop.
        """
        request = self.request
        headers = {
            name: value
            for name, value in (getattr(request, "headers", None) or {}).items()
            if name not in _X_DEATH_HEADERS
        }
        requeues = int(headers.get(REQUEUE_HEADER) or 0)
        # Eagerly the caller waits here, in place: no broker messages to save, keep it short.
        cap = MAX_REQUEUE_DELAY if request.is_eager else MAX_REQUEUE_COUNTDOWN
        countdown = requeue_countdown(
            requeues,
            cfg.idempotency_retry_base_delay,
            random.random(),  # noqa: S311 - jitter, not security
            cap,
        )
        if request.is_eager:
            time.sleep(countdown)
            headers[REQUEUE_HEADER] = requeues + 1
            request.headers = headers
            return
        headers[REQUEUE_HEADER] = requeues + 1
        sig = self.signature_from_request(
            request, args, kwargs, countdown=countdown, retries=request.retries, headers=headers
        )
        sig.apply_async()
        raise Retry(exc=exc, when=countdown, sig=sig)

    # -- backends ---------------------------------------------------------------------------

    def _guard(self, cfg: IdempotencySettings) -> DistributedIdempotencyGuard:
        ident = (os.getpid(), id(self.app), self.name)
        entry = _guards.get(ident)
        if entry is not None and entry[0] is cfg:
            return entry[1]
        lock_provider, store = self._backends(cfg)
        guard = DistributedIdempotencyGuard(
            store=store,
            lock_provider=lock_provider,
            ttl=cfg.idempotency_ttl,
            lock_ttl=cfg.idempotency_lock_ttl,
            retry_count=cfg.idempotency_retry_count,
            retry_base_delay=cfg.idempotency_retry_base_delay,
            retry_max_delay=MAX_REQUEUE_DELAY,
            key_prefix=cfg.idempotency_key_prefix,
            on_event=self._on_guard_event,
        )
        with _backends_lock:
            entry = _guards.get(ident)
            if entry is None or entry[0] is not cfg:
                entry = _guards[ident] = (cfg, guard)
            return entry[1]

    def _failure_envelope(self, exc: BaseException) -> dict[str, Any]:
        """What is stored for a failure listed in ``idempotency_store_errors``: the exception
        as Celery's result backend prepares it for the result serializer (class, module and
        args for JSON; the exception itself for pickle), in an envelope no result can be
        mistaken for (see :func:`_is_failure_envelope`)."""
        serializer, _ = self._serialization()
        return {FAILURE_MARKER: 1, "exc": self.backend.prepare_exception(exc, serializer)}

    def _failure_from(self, envelope: dict[str, Any]) -> BaseException:
        """The stored failure rebuilt as Celery's result backend rebuilds one: the same class
        with the same args; a stored name that is not an exception class is refused
        (``SecurityError``), and nothing is imported.

        A class listed in ``idempotency_store_errors`` is taken from the list itself: Celery
        looks classes up in ``sys.modules`` only, and a replay that does not run the body may
        not have imported the module the body takes it from.
        """
        stored = envelope["exc"]
        if isinstance(stored, dict):
            wanted = (stored.get("exc_module"), stored.get("exc_type"))
            for cls in self.idempotency_settings().idempotency_store_errors:
                if (cls.__module__, cls.__qualname__) == wanted:
                    message = stored.get("exc_message", ())
                    args = message if isinstance(message, (list, tuple)) else (message,)
                    try:
                        return cls(*args)
                    except Exception:  # as Celery: fall back to its own rebuild
                        break
        exc = self.backend.exception_to_python(stored)
        if not isinstance(exc, BaseException):  # pragma: no cover - Celery always gives one
            raise TypeError(f"stored failure of task {self.name} is not an exception: {exc!r}")
        return exc

    def _serialization(self) -> tuple[str, list[str]]:
        """The app's result serializer and the accept list results are loaded with."""
        conf = self.app.conf
        serializer = conf.get("result_serializer") or "json"
        accept = conf.get("result_accept_content") or conf.get("accept_content") or ["json"]
        return serializer, list(accept)

    def _as_delivered(self, value: Any) -> Any:
        """``value`` after a round trip through the result serializer, as a replay gets it."""
        import kombu.serialization  # noqa: PLC0415

        kombu_ser: Any = kombu.serialization  # kombu ships no type information
        serializer, accept = self._serialization()
        content_type, encoding, data = kombu_ser.dumps(value, serializer=serializer)
        accepted = kombu_ser.prepare_accept_content(accept)
        return kombu_ser.loads(data, content_type, encoding, accept=accepted)

    def _backends(self, cfg: IdempotencySettings) -> tuple[LockProvider, IdempotencyStore]:
        serializer, accept = self._serialization()
        source = cfg.idempotency_client
        # A client (or its factory) is keyed by identity; the entry keeps it, so an id reused
        # after it was garbage collected cannot pick up another client's backends.
        where = ("client", id(source)) if source is not None else ("url", cfg.backend_url)
        wait = (cfg.idempotency_wait_replicas, cfg.idempotency_wait_timeout)
        ident = (os.getpid(), *where, cfg.idempotency_key_prefix, serializer, tuple(accept), wait)
        with _backends_lock:
            found = _backends.get(ident)
            if found is not None and found[0] is source:
                return found[1]
            if source is None and cfg.in_postgres:
                _backends[ident] = (None, self._postgres_backend(cfg, serializer, accept))
                return _backends[ident][1]
            if source is not None:
                client = make_client_from(source, task_name=self.name)
            elif cfg.in_memory:
                client = None
            else:
                client = make_client(None, cfg.backend_url, "idempotency_url")
            pair: tuple[LockProvider, IdempotencyStore]
            if client is None:
                if cfg.idempotency_wait_replicas:
                    raise ValueError(
                        f"idempotency_wait_replicas (task {self.name}) needs a Redis backend, "
                        f"not memory:// (got {cfg.idempotency_wait_replicas}); use 0"
                    )
                pair = (MemoryLockProvider(), MemoryIdempotencyStore())
            else:
                pair = (
                    RedisLockProvider(client, key_prefix=cfg.idempotency_key_prefix),
                    RedisIdempotencyStore(
                        client,
                        serializer=serializer,
                        accept=accept,
                        wait_replicas=cfg.idempotency_wait_replicas,
                        wait_timeout=cfg.idempotency_wait_timeout,
                    ),
                )
            _backends[ident] = (source, pair)
            return pair

    def _postgres_backend(
        self, cfg: IdempotencySettings, serializer: str, accept: list[str]
    ) -> tuple[LockProvider, IdempotencyStore]:
        """One PostgreSQL backend serving as lock provider and store (one transaction)."""
        from celery_idempotent.postgres import backend_from_url  # noqa: PLC0415 - optional

        if cfg.idempotency_wait_replicas:
            raise ValueError(
                f"idempotency_wait_replicas (task {self.name}) is a Redis setting; PostgreSQL "
                f"replicates commits itself (got {cfg.idempotency_wait_replicas}); use 0"
            )
        backend = backend_from_url(cfg.backend_url, serializer=serializer, accept=accept)
        return backend, backend

    def _on_guard_event(self, event: GuardEvent) -> None:
        signal = {
            "replay": signals.idempotency_replayed,
            "contention": signals.idempotency_contended,
            "committed": signals.idempotency_committed,
            "lease_lost": signals.idempotency_lease_lost,
        }[event.kind]
        extra = {"attempt": event.attempt} if event.kind == "contention" else {}
        signal.send(
            sender=self,
            task_id=self.request.id,
            key=event.key,
            elapsed=event.elapsed,
            fencing_token=event.fencing_token,
            **extra,
        )


# Task options (same names as the settings): ``None`` means "use the app's setting"; ``NOT_SET``
# where a task's own ``None`` means something (``idempotency_fingerprint=None``: no check).
for _option, _unset in task_option_defaults().items():
    setattr(IdempotentTask, _option, _unset)


def _hashes_args(cfg: IdempotencySettings) -> bool:
    """Whether a call needs the hash of every bound argument (key or fingerprint)."""
    return bool(cfg.idempotency_key == "args" or cfg.idempotency_fingerprint == "args")


def _is_failure_envelope(value: Any) -> bool:
    """Whether a stored value is a failure stored by ``idempotency_store_errors``."""
    if type(value) is not dict or len(value) != 2 or "exc" not in value:
        return False
    return bool(value.get(FAILURE_MARKER) == 1)


class _KeyFormatter(string.Formatter):
    """``str.format`` for key templates that treats a ``None`` field as a missing key:
    ``"user:{user_id}"`` with ``user_id=None`` must not become the shared key ``user:None``."""

    def __init__(self, template: str, task_name: str) -> None:
        self.template = template
        self.task_name = task_name

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> Any:
        top = field_name.split(".", maxsplit=1)[0].split("[", maxsplit=1)[0]
        if kwargs.get(top) is None:  # also before reading a part of it (``{user.id}``)
            raise IdempotencyKeyMissingError(self.template, self.task_name, top)
        obj, used = super().get_field(field_name, args, kwargs)
        if obj is None:
            raise IdempotencyKeyMissingError(self.template, self.task_name, field_name)
        return obj, used


# --------------------------------------------------------------------------- worker start


def _backend_label(cfg: IdempotencySettings) -> str:
    """Where a task's keys live, for the start-up log (no password)."""
    source = cfg.idempotency_client
    if source is None:
        return redact(cfg.backend_url)
    label = getattr(source, "label", None)  # SentinelClientFactory (a Sentinel broker)
    if isinstance(label, str):
        return label
    name = getattr(source, "__qualname__", None) or type(source).__name__
    return f"idempotency_client {name}"


#: A task that the start-up check resolved: (name, task, its settings).
Resolved = tuple[str, "IdempotentTask", IdempotencySettings]


def check_app_at_worker_start(app: Any) -> list[str]:
    """Resolve the settings of every :class:`IdempotentTask` of ``app``; log one INFO line
    (how many tasks, where their keys live), one ERROR per misconfigured task, and one WARNING
    per finding of the :data:`STARTUP_CHECKS` (a setup that can break a promise).

    Connected to Celery's ``celeryd_after_setup`` signal, so that a bad or missing setting
    (an amqp broker and no ``idempotency_url``, a negative TTL) shows in the worker's log when
    it starts, not first when a task fails. Returns the error messages.
    """
    errors: list[str] = []
    places: dict[str, int] = {}
    resolved: list[Resolved] = []
    for name in sorted(app.tasks):
        task = app.tasks[name]
        if not isinstance(task, IdempotentTask):
            continue
        try:
            cfg = resolve(app, task)
        except (TypeError, ValueError) as exc:
            message = f"task {name} is misconfigured: {exc}; its calls fail until it is fixed"
            log.error("celery-idempotent: %s", message)  # noqa: TRY400 - no traceback needed
            errors.append(message)
            continue
        if not cfg.idempotency_enabled:
            label = "disabled (idempotency_enabled=False)"
        else:
            label = _backend_label(cfg)
            resolved.append((name, task, cfg))
        places[label] = places.get(label, 0) + 1
    if places:
        log.info(
            "celery-idempotent: %d idempotent task(s): %s",
            sum(places.values()),
            ", ".join(f"{n} at {label}" for label, n in places.items()),
        )
    for check in STARTUP_CHECKS:
        try:
            found = check(app, resolved)
        except Exception:  # a check must never stop the worker
            log.exception("celery-idempotent: start-up check %s failed", check.__name__)
            continue
        for message in found:
            log.warning("celery-idempotent: %s", message)
    return errors


# One small function per start-up check: (app, the enabled tasks) -> warning messages.


def check_pool(app: Any, tasks: list[Resolved]) -> list[str]:
    """Under gevent or eventlet: what a body that does not yield risks, and which lease to
    choose."""
    runtime = _green.runtime()
    if runtime is None or not tasks:
        return []
    shortest = min(tasks, key=lambda t: t[2].idempotency_lock_ttl)
    ttl, name = shortest[2].idempotency_lock_ttl, shortest[0]
    messages = [
        f"pool {runtime}: lease renewals run on an OS thread with a Redis connection of their "
        "own, so a body that blocks the event loop in Python code (a CPU loop) keeps its lease "
        "and costs none of the others. A body blocked in one C call that holds the GIL (some C "
        "extensions: image, PDF, compression, a database driver the pool does not patch) stops "
        "every renewal of this worker process for as long as it runs: past "
        f"idempotency_lock_ttl (here as short as {ttl:g}s, task {name}) the leases of all its "
        "bodies run out, their keys can run again elsewhere, and their commits are refused "
        "(LockLostError). Choose idempotency_lock_ttl longer than the longest such call"
    ]
    hub_renewed = sorted(name for name, _, cfg in tasks if not _renews_natively(cfg))
    if hub_renewed:
        messages.append(
            f"pool {runtime}: tasks {', '.join(hub_renewed)} use a Redis client whose "
            "connections the lease keeper's OS thread cannot have (TLS, Sentinel, Cluster or a "
            "client factory): their leases are renewed on the event loop, so any body of this "
            "worker that does not yield for idempotency_lock_ttl seconds costs them their "
            "leases; give those tasks an idempotency_lock_ttl longer than the longest such body"
        )
    return messages


def _renews_natively(cfg: IdempotencySettings) -> bool:
    """Whether the keeper's OS thread can have its own connection for these settings (judged
    without connecting)."""
    source = cfg.idempotency_client
    if source is None:
        return cfg.in_memory is False and cfg.backend_url.startswith(("redis://", "unix://"))
    if not callable(getattr(source, "register_script", None)):
        return False  # a factory: its client is made in each worker process
    from celery_idempotent import _native_redis  # noqa: PLC0415

    return _native_redis.native_caller_for(source, _green.natives()) is not None


def check_eviction(app: Any, tasks: list[Resolved]) -> list[str]:
    """The ``maxmemory-policy`` of every Redis the tasks' keys live on (one ``INFO memory``
    each, on a short-lived client)."""
    backends: dict[Any, IdempotencySettings] = {}
    for _, _, cfg in tasks:
        if not cfg.in_memory:
            source = cfg.idempotency_client
            ident = ("url", cfg.backend_url) if source is None else ("client", id(source))
            backends.setdefault(ident, cfg)
    messages: list[str] = []
    for cfg in backends.values():
        policy, error = _read_policy(cfg)
        message = eviction_warning(_backend_label(cfg), policy, error)
        if message is not None:
            messages.append(message)
    return messages


def _read_policy(cfg: IdempotencySettings) -> tuple[str | None, str | None]:
    source = cfg.idempotency_client
    if source is None:
        redis_mod = import_redis()
        client = redis_mod.Redis.from_url(
            cfg.backend_url, socket_timeout=2.0, socket_connect_timeout=2.0
        )
        try:
            return eviction_policy(client)
        finally:
            client.close()
    if callable(getattr(source, "register_script", None)):
        return eviction_policy(source)
    if isinstance(source, SentinelClientFactory):
        client = source()
        try:
            return eviction_policy(client)
        finally:
            client.close()
    # A user's factory is called once per worker process, by the tasks: not here.
    return None, "idempotency_client is a factory; it is not called at start"


#: The checks :func:`check_app_at_worker_start` runs, in order.
STARTUP_CHECKS: list[Callable[[Any, list[Resolved]], list[str]]] = [check_pool, check_eviction]


def check_namespaces(app: Any) -> list[str]:
    """Log one WARNING for each key namespace that idempotent tasks of ``app`` share by
    accident, and return the messages.

    Tasks whose keys share a namespace (on the same Redis, under the same key prefix) replay
    each other's results. That is meant only when every one of them declares the same
    ``idempotency_namespace`` as its own task option; a namespace that one task takes by
    default (its name) or from the app's setting, and another declares or also inherits, is
    an accident. Misconfigured and disabled tasks are left to the other checks.
    """
    groups: dict[tuple[str, str, str], list[tuple[str, bool]]] = {}
    for name in sorted(app.tasks):
        task = app.tasks[name]
        if not isinstance(task, IdempotentTask):
            continue
        try:
            cfg = resolve(app, task)
        except (TypeError, ValueError):
            continue
        if not cfg.idempotency_enabled:
            continue
        namespace = cfg.idempotency_namespace or name
        where = (_backend_label(cfg), cfg.idempotency_key_prefix, namespace)
        declared = declared_by_task(task, "idempotency_namespace")
        groups.setdefault(where, []).append((name, declared))
    messages: list[str] = []
    for (_, _, namespace), members in groups.items():
        if len(members) < 2 or all(declared for _, declared in members):
            continue
        undeclared = [name for name, declared in members if not declared]
        message = (
            f"tasks {', '.join(name for name, _ in members)} share the key namespace "
            f"{namespace!r} by accident ({', '.join(undeclared)} did not declare it): a "
            "duplicate of one replays the other's result. Give each task its own "
            "idempotency_namespace, or declare the same one on every task meant to share it"
        )
        log.warning("celery-idempotent: %s", message)
        messages.append(message)
    return messages


def check_beat_schedule(app: Any) -> list[str]:
    """Log one WARNING for each :class:`IdempotentTask` named in ``beat_schedule`` whose key
    would collapse its runs, and return the messages.

    A periodic task keyed by its arguments (the default) or by a format string, without an
    ``idempotency_window``, gets the same key at every run: it runs once, then only replays
    for ``idempotency_ttl``. The fix is ``idempotency_window`` (its period) or
    ``idempotency_key="task_id"``.
    """
    messages: list[str] = []
    schedule = app.conf.get("beat_schedule") or {}
    for entry_name, entry in sorted(schedule.items(), key=lambda item: str(item[0])):
        name = entry.get("task") if isinstance(entry, dict) else None
        task = app.tasks.get(name) if isinstance(name, str) else None
        if not isinstance(task, IdempotentTask):
            continue
        try:
            cfg = resolve(app, task)
        except (TypeError, ValueError):
            continue  # reported by check_app_at_worker_start
        strategy = cfg.idempotency_key
        if (
            not cfg.idempotency_enabled
            or cfg.idempotency_window is not None
            or callable(strategy)
            or strategy == "task_id"
        ):
            continue
        keyed_by = "its arguments" if strategy == "args" else f"the format string {strategy!r}"
        message = (
            f"periodic task {name} (beat_schedule entry {entry_name!r}) is keyed by {keyed_by} "
            f"and has no idempotency_window: every run gets the same key, so it runs once and "
            f"then only replays the stored result for idempotency_ttl "
            f"({cfg.idempotency_ttl:g} s). Set idempotency_window to its period (one run per "
            "slot, however many beat instances publish it) or idempotency_key='task_id'"
        )
        log.warning("celery-idempotent: %s", message)
        messages.append(message)
    return messages


def _check_beat_schedule_at_start(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    app = getattr(instance, "app", None)
    if app is not None:
        check_beat_schedule(app)


celery_signals.celeryd_after_setup.connect(
    _check_beat_schedule_at_start,
    weak=False,
    dispatch_uid="celery_idempotent.check_beat_schedule",
)


def _on_worker_setup(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    app = getattr(instance, "app", None)
    if app is not None:
        check_app_at_worker_start(app)


celery_signals.celeryd_after_setup.connect(
    _on_worker_setup, weak=False, dispatch_uid="celery_idempotent.check_app_at_worker_start"
)


def _check_namespaces_at_start(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    app = getattr(instance, "app", None)
    if app is not None:
        check_namespaces(app)


celery_signals.celeryd_after_setup.connect(
    _check_namespaces_at_start, weak=False, dispatch_uid="celery_idempotent.check_namespaces"
)
