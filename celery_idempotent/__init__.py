"""celery-idempotent: exactly-once in effect for Celery tasks.

``@app.task(base=IdempotentTask)`` runs a task's body once per idempotency key and replays the
stored result to every duplicate delivery. Under it, :class:`DistributedIdempotencyGuard` does
the same for any Python callable.

Importing this package imports neither ``redis`` nor ``celery``: the Redis classes and
``IdempotentTask`` load their modules on first use.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from celery_idempotent.backends.memory.locks import MemoryLockProvider
from celery_idempotent.backends.memory.store import MemoryIdempotencyStore
from celery_idempotent.core.backoff import ExponentialJitterBackoff
from celery_idempotent.core.exceptions import (
    CommitUnknownError,
    DuplicatePublishError,
    IdempotencyAbortedError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyError,
    IdempotencyKeyHeldError,
    IdempotencyKeyMissingError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
    RecordDecodeError,
    ResultEncodeError,
)
from celery_idempotent.core.fingerprint import fingerprint_payload
from celery_idempotent.core.guard import (
    DistributedIdempotencyGuard,
    GuardEvent,
    Outcome,
    current_lease,
    require_lease,
)
from celery_idempotent.core.protocols import (
    AtomicBackend,
    Claim,
    IdempotencyRecord,
    IdempotencyStore,
    Lease,
    LockProvider,
)
from celery_idempotent.core.states import KeyState
from celery_idempotent.transactions import current_connection

if TYPE_CHECKING:
    from celery_idempotent.admin import IdempotencyStatus
    from celery_idempotent.backends.mysql import MySQLBackend
    from celery_idempotent.backends.postgres import DjangoBackend, PostgresBackend
    from celery_idempotent.backends.redis.locks import RedisLockProvider
    from celery_idempotent.backends.redis.store import RedisIdempotencyStore
    from celery_idempotent.celery.task import IdempotentTask

__version__ = "0.2.0"

__all__ = [
    "AtomicBackend",
    "Claim",
    "CommitUnknownError",
    "DistributedIdempotencyGuard",
    "DjangoBackend",
    "DuplicatePublishError",
    "ExponentialJitterBackoff",
    "GuardEvent",
    "IdempotencyAbortedError",
    "IdempotencyBackendError",
    "IdempotencyConnectionError",
    "IdempotencyError",
    "IdempotencyKeyHeldError",
    "IdempotencyKeyMissingError",
    "IdempotencyMismatchError",
    "IdempotencyRecord",
    "IdempotencyStatus",
    "IdempotencyStore",
    "IdempotentTask",
    "KeyState",
    "Lease",
    "LockAcquisitionError",
    "LockLostError",
    "LockProvider",
    "MemoryIdempotencyStore",
    "MemoryLockProvider",
    "MySQLBackend",
    "Outcome",
    "PostgresBackend",
    "RecordDecodeError",
    "RedisIdempotencyStore",
    "RedisLockProvider",
    "ResultEncodeError",
    "__version__",
    "current_connection",
    "current_lease",
    "fingerprint_payload",
    "require_lease",
]

_LAZY = {
    "IdempotencyStatus": "celery_idempotent.admin",
    "RedisLockProvider": "celery_idempotent.backends.redis.locks",
    "RedisIdempotencyStore": "celery_idempotent.backends.redis.store",
    "IdempotentTask": "celery_idempotent.celery.task",
    "PostgresBackend": "celery_idempotent.backends.postgres",
    "DjangoBackend": "celery_idempotent.backends.postgres",
    "MySQLBackend": "celery_idempotent.backends.mysql",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'celery_idempotent' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
