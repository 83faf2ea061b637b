"""Helpers for the IdempotentTask tests: what the workers of ``apps/cidem_app.py`` recorded."""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

from celery_idempotent.core.fingerprint import lock_resource, record_key


def count(app_module: ModuleType, *parts: Any) -> int:
    """How often the side effect ``parts`` happened (see ``cidem_app.bump``)."""
    value = app_module.client().get(app_module.ckey(*parts))
    return int(value or 0)


def signal_count(app_module: ModuleType, kind: str, key: str) -> int:
    """How often the signal ``kind`` (replayed, contended, committed, lease_lost) fired for
    ``key`` in any worker process."""
    return count(app_module, "sig", kind, key)


def signal_data(app_module: ModuleType, kind: str, key: str) -> list[dict[str, Any]]:
    """What the receivers got, one dict per firing."""
    raw = app_module.client().lrange(app_module.ckey("sigdata", kind, key), 0, -1)
    return [json.loads(item) for item in raw]


def key_of(task: Any, *args: Any, **kwargs: Any) -> str:
    """The namespaced idempotency key of ``task(*args, **kwargs)`` (no explicit header)."""
    return str(task.idempotency_key_for(args, kwargs))


def redis_names(task: Any, key: str) -> tuple[str, str]:
    """(lock resource, record key) of ``key`` in Redis, with the task's key prefix."""
    prefix = task.idempotency_settings().idempotency_key_prefix
    return lock_resource(prefix, key), record_key(prefix, key)


def settled(app_module: ModuleType, key: str, deliveries: int) -> bool:
    """Whether ``deliveries`` deliveries of ``key`` have each committed or replayed."""
    done = signal_count(app_module, "committed", key) + signal_count(app_module, "replayed", key)
    return done >= deliveries
