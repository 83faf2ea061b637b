"""redis-py's exceptions as the library's: connection-level failures and transient refusals
become :class:`IdempotencyConnectionError` (nothing was written: re-queue), anything else
:class:`IdempotencyBackendError`.
"""

from __future__ import annotations

from typing import Any

from celery_idempotent.backends.redis.client import import_redis
from celery_idempotent.core.exceptions import (
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyError,
)

__all__ = ["TRANSIENT_REPLIES", "is_transient_reply", "translate_errors"]

_ERROR_CLASSES: tuple[tuple[type[BaseException], ...], type[BaseException]] | None = None

#: Error replies that mean "this server cannot take the write now, try again": a master without
#: enough replicas (``min-replicas-to-write``), a replica (a demoted master), a cluster or a
#: replica link that is down, a server loading its data. Nothing was written: they are
#: reported as :class:`IdempotencyConnectionError`, like an unreachable server, so that a
#: delivery that had not started its body is re-queued instead of failing.
TRANSIENT_REPLIES = ("NOREPLICAS", "READONLY", "MASTERDOWN", "CLUSTERDOWN", "TRYAGAIN", "LOADING")


def _error_classes() -> tuple[tuple[type[BaseException], ...], type[BaseException]]:
    """(connection-level errors, any other redis-py error), looked up once."""
    global _ERROR_CLASSES  # noqa: PLW0603 - a cache filled on first use
    if _ERROR_CLASSES is None:
        exceptions = import_redis().exceptions
        _ERROR_CLASSES = (
            (
                exceptions.ConnectionError,
                exceptions.TimeoutError,
                exceptions.AuthenticationError,
                exceptions.ReadOnlyError,
                exceptions.TryAgainError,
                exceptions.ClusterDownError,
                ConnectionError,
                TimeoutError,
            ),
            exceptions.RedisError,
        )
    return _ERROR_CLASSES


def is_transient_reply(exc: BaseException) -> bool:
    """Whether a redis-py error is a transient refusal (see :data:`TRANSIENT_REPLIES`); the
    code may follow a script error's own text, so the first words are searched."""
    words = str(exc)[:200].replace(":", " ").split()
    return any(word in TRANSIENT_REPLIES for word in words[:12])


class translate_errors:
    """``with translate_errors(key, op):`` turns redis-py exceptions into the library's,
    chaining the original.

    A class, not a ``@contextmanager`` generator: it wraps every Redis call, two per guarded
    call, and a generator-based context manager costs several times more to enter and exit.
    """

    __slots__ = ("key", "op")

    def __init__(self, key: str, op: str) -> None:
        self.key = key
        self.op = op

    def __enter__(self) -> None:
        return None

    def __exit__(self, exc_type: Any, exc: BaseException | None, tb: Any) -> None:
        # Returns None: an exception is never swallowed, only replaced.
        if exc is None or isinstance(exc, IdempotencyError):
            return
        connection_errors, redis_error = _error_classes()
        if isinstance(exc, connection_errors) or (
            isinstance(exc, redis_error) and is_transient_reply(exc)
        ):
            raise IdempotencyConnectionError(self.key, f"Redis {self.op} failed: {exc}") from exc
        if isinstance(exc, redis_error):
            raise IdempotencyBackendError(self.key, f"Redis {self.op} failed: {exc}") from exc
