"""What the guard did in a worker you cannot reach into: a ledger kept in the store's Redis.

For tests whose worker runs in another process or container (pytest-celery's ``celery_setup``):
the in-process helpers of :class:`~celery_idempotent.testing.IdempotencyTester` count bodies by
hooking the task in the test's own process, which a container worker is not. Imported in the
worker (pytest-celery: add this module to ``default_worker_signals``), this module connects to
the library's signals and appends one entry per outcome to a Redis list in the task's own
idempotency store (``idempotency_url``, which must be a ``redis://`` or ``rediss://`` URL):

- ``committed``: the body ran and its result was stored;
- ``replayed``: a duplicate got the stored result, the body did not run;
- ``lease_lost``: the body ran but its lease ran out first (its commit was refused).

In the test, :func:`read_ledger` (with the URL at which the test process reaches that Redis)
returns the entries, :func:`wait_for_entries` waits for them, :func:`executions` counts the
bodies that ran for a task, and :func:`clear_ledger` empties it. Nothing is written unless this
module was imported, and only JSON is stored and read (nothing is unpickled).
"""

from __future__ import annotations

import json
import os
import threading
import time
from typing import Any

from celery_idempotent import signals

__all__ = ["LEDGER_KEY", "clear_ledger", "executions", "read_ledger", "wait_for_entries"]

#: The Redis list the entries go to (in the idempotency store's database).
LEDGER_KEY = "celery-idempotent:testing:ledger"

_clients: dict[str, Any] = {}
_clients_lock = threading.Lock()


def _client(url: str) -> Any:
    if not url.startswith(("redis://", "rediss://", "unix://")):
        raise ValueError(
            f"celery_idempotent.testing.ledger needs a Redis idempotency_url, got {url!r}"
        )
    with _clients_lock:
        client = _clients.get(url)
        if client is None:
            import redis  # noqa: PLC0415  (only where the ledger is used)

            client = _clients[url] = redis.Redis.from_url(url, socket_timeout=5)
        return client


def _record(event: str, sender: Any, task_id: Any, key: Any) -> None:
    from celery_idempotent.settings import resolve  # noqa: PLC0415  (imports Celery)

    url = resolve(sender.app, sender).idempotency_url
    entry = {
        "event": event,
        "task": sender.name,
        "task_id": task_id,
        "key": key,
        "pid": os.getpid(),
    }
    _client(str(url)).rpush(LEDGER_KEY, json.dumps(entry))


def _on_committed(sender: Any = None, task_id: Any = None, key: Any = None, **_: Any) -> None:
    _record("committed", sender, task_id, key)


def _on_replayed(sender: Any = None, task_id: Any = None, key: Any = None, **_: Any) -> None:
    _record("replayed", sender, task_id, key)


def _on_lease_lost(sender: Any = None, task_id: Any = None, key: Any = None, **_: Any) -> None:
    _record("lease_lost", sender, task_id, key)


# Module-level receivers (Celery keeps them by weak reference).
signals.idempotency_committed.connect(_on_committed)
signals.idempotency_replayed.connect(_on_replayed)
signals.idempotency_lease_lost.connect(_on_lease_lost)


def read_ledger(url: str, *, task: str | None = None) -> list[dict[str, Any]]:
    """The entries in the Redis at ``url`` (all, or those of the task named ``task``)."""
    entries = [json.loads(raw) for raw in _client(url).lrange(LEDGER_KEY, 0, -1)]
    return [entry for entry in entries if task is None or entry["task"] == task]


def wait_for_entries(
    url: str, count: int, *, task: str | None = None, timeout: float = 30.0
) -> list[dict[str, Any]]:
    """The entries once there are at least ``count`` of them (of ``task``); ``TimeoutError``
    naming what arrived if they do not within ``timeout`` seconds.

    A redelivery of the same task id shares the first delivery's result, so waiting for its
    ``AsyncResult`` says nothing about the redelivery itself: wait for its entry instead.
    """
    deadline = time.monotonic() + timeout
    while True:
        entries = read_ledger(url, task=task)
        if len(entries) >= count:
            return entries
        if time.monotonic() > deadline:
            raise TimeoutError(
                f"{count} ledger entries expected within {timeout:g}s, got {entries}"
            )
        time.sleep(0.05)


def executions(url: str, task: str) -> int:
    """How many bodies of the task named ``task`` ran (committed or lost their lease)."""
    return sum(1 for entry in read_ledger(url, task=task) if entry["event"] != "replayed")


def clear_ledger(url: str) -> None:
    """Forget every entry (the ledger key only; nothing else in that Redis is touched)."""
    _client(url).delete(LEDGER_KEY)
