"""The check of each setting's value: ``check(where, value) -> value``, with an error that names
the setting (``where``) and the bad value. :mod:`celery_idempotent.settings` declares which
check each setting has, beside its default and its documentation.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from celery_idempotent import keyspace
from celery_idempotent.core.validate import check_duration
from celery_idempotent.urls import redact

__all__ = [
    "MISSING_KEY_POLICIES",
    "MYSQL_SCHEMES",
    "ON_LOCKED_POLICIES",
    "POSTGRES_SCHEMES",
    "PUBLISH_UNTIL",
    "REDIS_SCHEMES",
    "Check",
    "check_bool",
    "check_client",
    "check_fingerprint",
    "check_key",
    "check_key_prefix",
    "check_namespace",
    "check_store_errors",
    "check_url",
    "is_client",
    "never_stored",
    "one_of",
]

#: ``check(where, value) -> value``: the value to use, or an error naming ``where``.
Check = Callable[[str, Any], Any]

ON_LOCKED_POLICIES = ("retry", "raise", "ignore", "reject")
DUPLICATE_PUBLISH_POLICIES = ("existing", "raise", "publish")
#: ``idempotency_publish_until``: how long a call stops a duplicate publish.
PUBLISH_UNTIL = ("completed", "started")
MISSING_KEY_POLICIES = ("raise", "run")
#: What follows the namespace in a task key (``<namespace>:args:<sha256>``); a namespace may not
#: contain one, or the admin command could not tell where it ends.
KIND_MARKERS = keyspace.KIND_MARKERS
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: The PostgreSQL backend's schemes (records commit in the body's transaction; see
#: :mod:`celery_idempotent.backends.postgres`).
POSTGRES_SCHEMES = ("postgresql://", "postgres://", "django://")
#: The MySQL / MariaDB backend's scheme (see :mod:`celery_idempotent.backends.mysql`);
#: ``django://`` serves it too, when the alias is on Django's MySQL engine.
MYSQL_SCHEMES = ("mysql://",)


def one_of(choices: tuple[str, ...]) -> Check:
    """The check of a setting that takes one of ``choices``."""

    def check(where: str, value: Any) -> Any:
        if value not in choices:
            raise ValueError(f"{where} must be one of {', '.join(choices)}, got {value!r}")
        return value

    return check


def check_url(where: str, value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str):
        raise TypeError(f"{where} must be a URL string, not {type(value).__name__}")
    if not value.startswith((*REDIS_SCHEMES, *POSTGRES_SCHEMES, *MYSQL_SCHEMES, "memory://")):
        raise ValueError(
            f"{where} must be a redis://, rediss://, unix://, postgresql://, postgres://, "
            "mysql://, django://<alias> or memory:// URL, "
            f"got {redact(value)!r}"
        )
    return value


def check_client(where: str, value: Any) -> Any:
    if value is None or is_client(value) or callable(value):
        return value
    raise TypeError(
        f"{where} must be a redis-py client (redis.Redis, a Sentinel master_for client, "
        f"RedisCluster) or a callable that returns one, not {type(value).__name__}"
    )


def check_key(where: str, value: Any) -> Any:
    if callable(value):
        return value
    if not isinstance(value, str) or not value:
        raise TypeError(
            f"{where} must be 'args', 'task_id', a format string or a callable "
            f"(task, args, kwargs) -> str, not {value!r}"
        )
    return value


def check_key_prefix(where: str, value: Any) -> Any:
    if not isinstance(value, str) or not value or "{" in value or "}" in value:
        raise ValueError(f"{where} must be a non-empty str without braces, got {value!r}")
    return value


def check_bool(where: str, value: Any) -> Any:
    if not isinstance(value, bool):
        raise TypeError(f"{where} must be True or False, got {value!r}")
    return value


def check_fingerprint(where: str, value: Any) -> Any:
    if value is None or value == "args" or callable(value):
        return value
    if isinstance(value, str):  # a str is right, this one is not: a bad value
        raise ValueError(  # noqa: TRY004
            f"{where} must be 'args', a tuple of argument names, a callable "
            f"(task, args, kwargs) -> str | None, or None, got {value!r} (for one argument "
            f"write ({value!r},))"
        )
    if not isinstance(value, (tuple, list)) or not value:
        raise TypeError(
            f"{where} must be 'args', a non-empty tuple of argument names, a callable "
            f"(task, args, kwargs) -> str | None, or None, not {value!r}"
        )
    bad = [name for name in value if not isinstance(name, str) or not name.isidentifier()]
    if bad:
        raise TypeError(f"{where} must name arguments with str identifiers, got {bad[0]!r}")
    if len(set(value)) != len(value):
        raise ValueError(f"{where} names an argument twice: {tuple(value)!r}")
    return tuple(value)


def check_namespace(where: str, value: Any) -> Any:
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise TypeError(f"{where} must be a non-empty str (or None: the task name), not {value!r}")
    if "{" in value or "}" in value:
        raise ValueError(f"{where} must not contain braces (Redis hash tags), got {value!r}")
    marker = next((m for m in KIND_MARKERS if m in value or value.endswith(m[:-1])), None)
    if marker is not None:
        raise ValueError(
            f"{where} must not contain {marker!r} (it separates the namespace from the key), "
            f"got {value!r}"
        )
    return value


def never_stored() -> tuple[type[BaseException], ...]:
    """Exception classes that ``idempotency_store_errors`` never stores, whatever it lists:
    Celery's control flow (``Retry``, ``Ignore``, ``Reject``), time limits, a lost worker,
    and this library's own errors (a lock or backend failure is not the body's answer)."""
    from billiard.exceptions import Terminated, WorkerLostError  # noqa: PLC0415
    from celery.exceptions import (  # noqa: PLC0415
        Ignore,
        Reject,
        Retry,
        SoftTimeLimitExceeded,
        TimeLimitExceeded,
    )

    from celery_idempotent.core.exceptions import IdempotencyError  # noqa: PLC0415

    return (
        Retry,
        Ignore,
        Reject,
        SoftTimeLimitExceeded,
        TimeLimitExceeded,
        WorkerLostError,
        Terminated,
        IdempotencyError,
    )


def check_store_errors(where: str, value: Any) -> tuple[type[Exception], ...]:
    classes = (value,) if isinstance(value, type) else value
    if not isinstance(classes, (tuple, list)):
        raise TypeError(f"{where} must be a tuple of exception classes, not {value!r}")
    excluded = never_stored()
    for cls in classes:
        if not isinstance(cls, type) or not issubclass(cls, Exception):
            raise TypeError(
                f"{where} must hold exception classes (subclasses of Exception), got {cls!r}"
            )
        if issubclass(cls, excluded):  # an exception class, but one that is never stored
            raise ValueError(  # noqa: TRY004
                f"{where} lists {cls.__module__}.{cls.__qualname__}, which is never stored: "
                "Celery's Retry, Ignore, Reject, time limits and this library's own errors "
                "are control flow, not the body's answer"
            )
    return tuple(classes)


def is_client(value: Any) -> bool:
    """Whether ``value`` looks like a redis-py client (what the Redis backends call on it)."""
    return not isinstance(value, type) and callable(getattr(value, "register_script", None))


def check_window(where: str, value: Any) -> Any:
    """``idempotency_window``: ``None`` (no slot) or a duration."""
    return None if value is None else check_duration(where, value)
