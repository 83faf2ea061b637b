"""``IdempotentTask``: a Celery task base that runs each idempotency key's body once.

Celery's tracer calls a task's own ``__call__`` when the class defines one, after it has pushed
the request; ``IdempotentTask.__call__`` reads the request, derives the key and runs the body
(``super().__call__``) through a :class:`~celery_idempotent.DistributedIdempotencyGuard`.
One task instance serves every thread of a process, so nothing per call is kept on ``self``.

This module is the Celery adapter only; the work is done by:

- ``keys.py``: the key and fingerprint of a call (``prepare_call``: the one call from
  here to the key, with the settings resolved once in ``__call__``);
- ``factory.py``: the backends and guards of the process (``reset_backends``);
- ``publish.py``: duplicates stopped at ``apply_async``;
- ``delivery.py``: one delivery run through the guard, its outcome handed back to Celery;
- ``requeue.py``: ``idempotency_on_locked`` and the re-queue of a duplicate;
- ``request.py``: the worker's ``Request``: a rejected duplicate records nothing;
- ``results.py``: the result serializer and the stored-failure envelope;
- ``worker_start.py``: the checks a worker runs when it starts (connected on import of this
  module).
"""

from __future__ import annotations

import contextvars
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from celery import Task
from celery._state import _task_stack

from celery_idempotent import admin
from celery_idempotent.admin import Forgotten, IdempotencyStatus, KeyAdmin
from celery_idempotent.celery import call_options, delivery
from celery_idempotent.celery import keys as task_keys
from celery_idempotent.celery.factory import factory, reset_backends
from celery_idempotent.celery.keys import KEY_HEADER, SLOT_HEADER
from celery_idempotent.celery.publish import publish
from celery_idempotent.celery.requeue import (
    MAX_REQUEUE_COUNTDOWN,
    MAX_REQUEUE_DELAY,
    REQUEUE_HEADER,
    requeue_countdown,
)
from celery_idempotent.celery.results import FAILURE_MARKER
from celery_idempotent.celery.worker_start import (
    STARTUP_CHECKS,
    check_app_at_worker_start,
    check_beat_schedule,
    check_eviction,
    check_namespaces,
    check_pool,
)
from celery_idempotent.core.guard import DistributedIdempotencyGuard
from celery_idempotent.settings import IdempotencySettings, resolve, task_option_defaults

__all__ = [
    "FAILURE_MARKER",
    "KEY_HEADER",
    "MAX_REQUEUE_COUNTDOWN",
    "MAX_REQUEUE_DELAY",
    "REQUEUE_HEADER",
    "SLOT_HEADER",
    "STARTUP_CHECKS",
    "IdempotentTask",
    "check_app_at_worker_start",
    "check_beat_schedule",
    "check_eviction",
    "check_namespaces",
    "check_pool",
    "requeue_countdown",
    "reset_backends",
]

log = logging.getLogger("celery_idempotent")

#: Set on the request of a delivery while IdempotentTask.__call__ handles it.
_GUARDED = "_idempotency_guarded"

#: (task name, task id) of the delivery whose ``retry()`` runs in this context: its
#: ``apply_async`` of that task id is the retry message.
_retrying: contextvars.ContextVar[tuple[str, Any] | None] = contextvars.ContextVar(
    "celery_idempotent_retrying", default=None
)


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

    Inside the body, :func:`celery_idempotent.require_lease` gives the lease and its fencing
    token. A direct call ``task(...)`` (no Celery request) runs the body plainly.
    """

    abstract = True
    #: The worker's request class (Celery's ``Task.Request``): Celery's own, except that a
    #: duplicate rejected by ``idempotency_on_locked="reject"`` records nothing under its task
    #: id on every Celery version (see :mod:`celery_idempotent.celery.request`). A subclass
    #: that sets its own ``Request`` should derive it from ``IdempotentRequest``.
    Request = "celery_idempotent.celery.request:IdempotentRequest"
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
            # The call's own idempotency_* options, carried with its message (apply_async).
            call_cfg = call_options.with_call_options(
                cfg, call_options.from_request(self.name, request)
            )
            # The one crossing to the key: resolved once here, the settings go down with it.
            # apply() hands the caller's objects to the body; the key is the worker's, from
            # the arguments as a message would carry them (one identity).
            prepared = task_keys.prepare_call(
                self, call_cfg, args, kwargs, as_message=bool(request.is_eager)
            )
            if prepared is None:  # no key, idempotency_missing_key="run"
                return super().__call__(*args, **kwargs)
            guard = factory.guard(self, cfg)
            if _calls_run_plainly(type(self)):
                body = functools.partial(self._run_body, self.run, args, kwargs)
            else:
                body = functools.partial(super().__call__, *args, **kwargs)
            return delivery.run(self, call_cfg, guard, prepared, body, args=args, kwargs=kwargs)
        finally:
            setattr(request, _GUARDED, False)

    def _run_body(
        self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> Any:
        # What Task.__call__ does, less its copy of the request: the body sees the request the
        # tracer pushed for this delivery, as a plain task's body does (the tracer calls a
        # plain task's run directly). The copy (a Context built from the request's __dict__,
        # its custom headers worked out again) cost a first execution about 8% of its CPU
        # time in process, more in a loaded worker.
        _task_stack.push(self)
        try:
            return run(*args, **kwargs)
        finally:
            _task_stack.pop()

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
        retrying = _retrying.get()
        hands_over = retrying is not None and retrying == (self.name, task_id)

        def send(task_id: str, options: dict[str, Any], producer: Any) -> Any:
            if hands_over and _retrying.get() is not None:
                # Celery has decided to publish the retry of the delivery running now (a
                # refused retry never gets here): the delivery gives up its lease, and its
                # marker names the retry, queued again, just before the message is pushed,
                # so that the retry finds its key free however soon it is delivered (after
                # the push, a retry due in 0.05 s could find it held and wait). A push that
                # fails then makes Celery's retry raise Reject: the marker ends with it.
                _retrying.set(None)
                delivery.hand_over(self)
            return super(IdempotentTask, self).apply_async(
                args, kwargs, task_id, producer, link, link_error, shadow, **options
            )

        result = publish(
            self,
            args,
            kwargs,
            task_id,
            link=link,
            link_error=link_error,
            options=options,
            send=send,
            producer=producer,
        )
        if hands_over and _retrying.get() is not None:
            # Published without our send (none of today's paths): hand over after it.
            _retrying.set(None)
            delivery.hand_over(self)
        return result

    def retry(self, *args: Any, **kwargs: Any) -> Any:
        """Celery's ``retry``; this delivery keeps its lease until the retry is published.

        ``Task.retry`` publishes the retry message (same task id) and then raises ``Retry``:
        the lease is given up, and the key's queued marker handed to the retry, right after
        that publish (in ``apply_async``), so that the retry can claim the key at once. A retry
        that Celery refuses (``MaxRetriesExceededError``, or ``exc`` raised again, caught or
        not) publishes nothing: the delivery keeps its lease, and whatever the body then
        returns or raises ends it as any body's end does (a value is committed).
        """
        request = self.request
        if request.called_directly or request.is_eager or delivery.running_guard(self) is None:
            return super().retry(*args, **kwargs)
        token = _retrying.set((self.name, request.id))
        try:
            return super().retry(*args, **kwargs)
        finally:
            _retrying.reset(token)

    # -- keys -------------------------------------------------------------------------------

    def idempotency_settings(self) -> IdempotencySettings:
        """The settings in force for this task (task options over ``app.conf``)."""
        return resolve(self.app, self)

    def idempotency_namespace_of(self) -> str:
        """The namespace of this task's keys: ``idempotency_namespace``, else its name."""
        return self.idempotency_settings().namespace_for(str(self.name))

    @task_keys.default_hook
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

        A hook: a subclass may override it, and the worker and the publish side then both
        take a call's key from the override (``payload`` is the bound arguments). Not
        overridden, a call's key is derived without calling it, from the settings the call
        resolved once.
        """
        cfg = self.idempotency_settings()
        return task_keys.key_for(self, cfg, args, kwargs, payload=payload, fingerprint=fingerprint)

    @task_keys.default_hook
    def idempotency_fingerprint_for(
        self, args: tuple[Any, ...], kwargs: dict[str, Any], *, payload: Any = None
    ) -> str | None:
        """The fingerprint stored with a call's result and compared with its duplicates'
        (``None``: not compared), as ``idempotency_fingerprint`` says.

        A hook, as :meth:`idempotency_key_for` is, for every ``idempotency_fingerprint`` but
        ``"args"`` (the hash of the bound arguments, computed once with the key)."""
        cfg = self.idempotency_settings()
        return task_keys.fingerprint_for(self, cfg, args, kwargs, payload=payload)

    def idempotency_guard(self) -> DistributedIdempotencyGuard:
        """The guard this task's calls go through in this process (built once from its
        settings, over the backends they name)."""
        return factory.guard(self, self.idempotency_settings())

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
        key_admin, nkey = self._admin_target(args, kwargs, key=key, task_id=task_id)
        return key_admin.status(nkey)

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
        key_admin, nkey = self._admin_target(args, kwargs, key=key, task_id=task_id)
        return key_admin.forget(nkey, force=force)

    def _admin_target(
        self,
        args: Sequence[Any],
        kwargs: Mapping[str, Any] | None,
        *,
        key: str | None,
        task_id: str | None,
    ) -> tuple[KeyAdmin, str]:
        """(the admin of this task's backend, over the process's own store; the namespaced
        key the admin methods' arguments name)."""
        cfg = self.idempotency_settings()
        nkey = task_keys.admin_key(self, cfg, args, kwargs, key=key, task_id=task_id)
        _, store = factory.backends(self, cfg)
        key_admin = admin.admin_for(cfg, store=store, guard=factory.guard(self, cfg))
        return key_admin, nkey


def _calls_run_plainly(cls: type[IdempotentTask]) -> bool:
    """Whether the ``__call__`` after ``IdempotentTask``'s in ``cls``'s MRO is Celery's own
    ``Task.__call__`` (then the body is run without it; a mixin's ``__call__`` still runs)."""
    found = cls.__dict__.get("_idempotency_plain_call")
    if found is None:
        mro = cls.__mro__
        after = mro[mro.index(IdempotentTask) + 1 :]
        found = (
            next((c.__dict__["__call__"] for c in after if "__call__" in c.__dict__), None)
            is Task.__call__
        )
        cls._idempotency_plain_call = found
    return bool(found)


# Task options (same names as the settings): ``None`` means "use the app's setting"; ``NOT_SET``
# where a task's own ``None`` means something (``idempotency_fingerprint=None``: no check).
for _option, _unset in task_option_defaults().items():
    setattr(IdempotentTask, _option, _unset)
