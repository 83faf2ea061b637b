"""Switching apps and tasks to a test backend, counting their bodies, and putting them back.

The :class:`~celery_idempotent.testing.IdempotencyTester` keeps one :class:`Switchboard` per
test; nothing here delivers a task.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

__all__ = ["Switchboard", "current", "is_task"]

#: The settings the tester overrides, on the app and on every task: where the keys live, and
#: no replica to wait for (neither the memory backend nor the private server has one).
_SWITCHED = ("idempotency_url", "idempotency_client", "idempotency_wait_replicas")
_UNSET: Any = object()


def is_task(value: Any) -> bool:
    """Whether ``value`` looks like a Celery task (or its lazy proxy)."""
    return callable(getattr(value, "apply_async", None)) and hasattr(value, "name")


def current(task: Any) -> Any:
    """The task behind ``@app.task``'s lazy proxy (the task itself when it is none)."""
    unwrap = getattr(task, "_get_current_object", None)
    return unwrap() if callable(unwrap) else task


class Switchboard:
    """The apps and tasks switched to ``backend_url``, what they were before, and how many
    times each switched task's body ran."""

    def __init__(self, backend_url: str) -> None:
        self.backend_url = backend_url
        self._apps: dict[int, tuple[Any, dict[str, Any]]] = {}
        self._tasks: dict[int, tuple[Any, dict[str, Any], Any]] = {}
        self._lock = threading.Lock()
        self._executions: dict[int, int] = {}
        # task -> (entered, release, timeout): the next body of that task sets ``entered`` and
        # waits for ``release`` (another delivery found the key held) before it runs.
        self._holds: dict[int, tuple[threading.Event, threading.Event, float]] = {}

    def use(self, app_or_task: Any) -> None:
        """Switch an app (every idempotent task it has now and later) or one task's app."""
        app = getattr(app_or_task, "app", None) if is_task(app_or_task) else app_or_task
        if app is None:
            raise TypeError(f"use() takes a Celery app or task, not {app_or_task!r}")
        from celery_idempotent import settings  # noqa: PLC0415
        from celery_idempotent.celery.task import IdempotentTask, reset_backends  # noqa: PLC0415

        changed = False
        if id(app) not in self._apps:
            conf = app.conf
            before = {name: conf.get(name, _UNSET) for name in _SWITCHED}
            self._apps[id(app)] = (app, before)
            conf.update(self._overrides())
            changed = True
        for task in list(app.tasks.values()):
            if isinstance(task, IdempotentTask):
                changed = self._switch_task(task) or changed
        if is_task(app_or_task):
            if not isinstance(current(app_or_task), IdempotentTask):
                raise TypeError(
                    f"{current(app_or_task).name} is not an IdempotentTask: "
                    "declare it with @app.task(base=IdempotentTask)"
                )
            changed = self._switch_task(app_or_task) or changed
        if changed:
            # Settings are cached per app, clients and guards per process: a fresh backend
            # for this test, and the switched settings read again.
            settings.clear_cache(app)
            reset_backends()

    def _overrides(self) -> dict[str, Any]:
        return {
            "idempotency_url": self.backend_url,
            "idempotency_client": None,
            "idempotency_wait_replicas": 0,
        }

    def _switch_task(self, task: Any) -> bool:
        """Switch one task (its options, and count its executions); False if it was."""
        task = current(task)
        if id(task) in self._tasks:
            return False
        cls = type(task)
        before = {name: cls.__dict__.get(name, _UNSET) for name in _SWITCHED}
        # Task options live on the task's class (``@app.task(base=..., opt=...)``); one that
        # names another backend would otherwise win over the app's setting.
        for name, value in self._overrides().items():
            setattr(cls, name, value)
        own_run = task.__dict__.get("run", _UNSET)
        run = task.run
        counts = self._executions
        holds = self._holds
        lock = self._lock
        key = id(task)
        counts[key] = 0

        @functools.wraps(run)
        def counted(*args: Any, **kwargs: Any) -> Any:
            with lock:
                counts[key] += 1
                hold = holds.pop(key, None)
            if hold is not None:
                entered, release, timeout = hold
                entered.set()
                release.wait(timeout)
            return run(*args, **kwargs)

        task.run = counted
        self._tasks[key] = (task, before, own_run)
        return True

    def executions(self, task: Any) -> int:
        """How many times ``task``'s body has run since it was switched (switching it now)."""
        self.use(task)
        with self._lock:
            return self._executions[id(current(task))]

    def hold(
        self, task: Any, entered: threading.Event, release: threading.Event, timeout: float
    ) -> None:
        """Make the next body of ``task`` set ``entered``, then wait for ``release``."""
        with self._lock:
            self._holds[id(current(task))] = (entered, release, timeout)

    def unhold(self, task: Any) -> None:
        """Drop a :meth:`hold` that no body took."""
        with self._lock:
            self._holds.pop(id(current(task)), None)

    def restore(self) -> None:
        """Put every switched app and task back as it was."""
        from celery_idempotent import settings  # noqa: PLC0415

        for task, before, own_run in self._tasks.values():
            cls = type(task)
            for name, value in before.items():
                if value is _UNSET:
                    if name in cls.__dict__:
                        delattr(cls, name)
                else:
                    setattr(cls, name, value)
            if own_run is _UNSET:
                task.__dict__.pop("run", None)
            else:
                task.run = own_run
        for app, before in self._apps.values():
            for name, value in before.items():
                if value is _UNSET:
                    app.conf.pop(name, None)
                else:
                    app.conf[name] = value
            settings.clear_cache(app)
        self._tasks.clear()
        self._apps.clear()
