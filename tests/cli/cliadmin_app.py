"""A tiny Celery app for the ``celery -A cliadmin_app idempotency ...`` tests.

``make_app(url, prefix)`` builds an app whose idempotent tasks keep their keys in the Redis at
``url`` under ``prefix``; the module-level ``app`` (what ``celery -A cliadmin_app`` loads) is
configured from ``CLIADMIN_REDIS_URL`` and ``CLIADMIN_PREFIX``, so that a subprocess sees the
records a test made in-process with ``make_app`` and the same two values.
"""

from __future__ import annotations

import os
import threading
import warnings
from typing import Any

from celery import Celery

try:
    from celery.exceptions import DuplicateTaskNameWarning
except ImportError:  # celery < 5.4 does not warn about duplicate task names

    class DuplicateTaskNameWarning(UserWarning):  # type: ignore[no-redef]
        """Stands in for the warning that older Celery versions do not have."""


from celery_idempotent import IdempotentTask

#: Gates that ``cliadmin.hold`` waits on, by name (a test sets one to let the body finish).
GATES: dict[str, threading.Event] = {}
#: Set by ``cliadmin.hold`` once its body runs (under the lock), by gate name.
STARTED: dict[str, threading.Event] = {}
#: What unpickling a :class:`Tripwire` recorded: must stay empty (pickle is never accepted).
TRIPPED: list[str] = []


def _trip(what: str) -> str:
    TRIPPED.append(what)
    return what


class Tripwire:
    """A result whose unpickling leaves a trace in :data:`TRIPPED`."""

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (_trip, ("unpickled",))


def make_app(url: str | None, prefix: str, **conf: Any) -> Celery:
    """An app with the four test tasks, keeping idempotency keys at ``url`` under ``prefix``."""
    app = Celery("cliadmin_app", broker="memory://", set_as_current=False)
    app.conf.update(idempotency_url=url, idempotency_key_prefix=prefix, **conf)

    @app.task(base=IdempotentTask, shared=False, name="cliadmin.charge")
    def charge(order_id: int, amount: int) -> dict[str, int]:
        return {"order": order_id, "charged": amount}

    @app.task(
        base=IdempotentTask, shared=False, name="cliadmin.ship", idempotency_key="order:{order_id}"
    )
    def ship(order_id: int, address: str) -> str:
        return f"shipped {order_id} to {address}"

    @app.task(base=IdempotentTask, shared=False, name="cliadmin.report", idempotency_key="task_id")
    def report(day: str) -> list[str]:
        return [day]

    @app.task(base=IdempotentTask, shared=False, name="cliadmin.hold", idempotency_lock_ttl=2)
    def hold(gate: str) -> str:
        STARTED.setdefault(gate, threading.Event()).set()
        if not GATES.setdefault(gate, threading.Event()).wait(120):  # slow subprocesses
            raise TimeoutError(f"gate {gate} was never opened")
        return f"released {gate}"

    with warnings.catch_warnings():
        # Finalizing registers every shared task (``@app.task`` without ``shared=False``)
        # defined so far in this process, other suites' included; their name clashes are
        # theirs, not this app's.
        warnings.simplefilter("ignore", DuplicateTaskNameWarning)
        app.finalize(auto=True)
    return app


app = make_app(
    os.environ.get("CLIADMIN_REDIS_URL", "redis://127.0.0.1:6379/0"),
    os.environ.get("CLIADMIN_PREFIX", "idempotency:"),
)
