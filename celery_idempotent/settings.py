"""Settings of :class:`~celery_idempotent.IdempotentTask`, read from the Celery app's config.

The defaults live here once, in :data:`DEFAULTS`; the README's table is checked against them by
the test suite. Values are read lazily with ``app.conf.get(name)`` (never ``add_defaults`` or
``setdefault``, which would hide a value set through Django's ``CELERY_`` namespace), validated
with an error that names the setting, and cached per app. A task option of the same name
(``@app.task(base=IdempotentTask, idempotency_ttl=60)``) overrides the app's setting for that
task.
"""

from __future__ import annotations

import dataclasses
import inspect
import threading
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from celery_idempotent._validate import check_count, check_delay, check_duration

__all__ = [
    "DEFAULTS",
    "ON_LOCKED_POLICIES",
    "IdempotencySettings",
    "clear_cache",
    "make_client_from",
    "resolve",
]

ON_LOCKED_POLICIES = ("retry", "raise", "ignore")
KEY_STRATEGIES = ("args", "task_id")
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: The PostgreSQL backend's schemes (records commit in the body's transaction; see
#: :mod:`celery_idempotent.postgres`).
POSTGRES_SCHEMES = ("postgresql://", "postgres://", "django://")


@dataclass(frozen=True)
class IdempotencySettings:
    """The resolved settings for one task. Field names are the setting names."""

    #: where locks and records live: ``redis://``, ``rediss://``, ``unix://`` or ``memory://``;
    #: ``None`` here means "fall back to a Redis ``broker_url``".
    idempotency_url: str | None = None
    #: a ready redis-py client (``redis.Redis``, a Sentinel ``master_for`` client,
    #: ``RedisCluster``) or a callable without arguments that returns one, called once per
    #: worker process; used instead of ``idempotency_url`` (set one of the two, not both).
    idempotency_client: Any = None
    #: ``"args"``, ``"task_id"``, a format string over the bound arguments, or a callable
    #: ``(task, args, kwargs) -> str``.
    idempotency_key: Any = "args"
    #: seconds a committed result is kept.
    idempotency_ttl: float = 86_400
    #: lease seconds; renewed while the body runs.
    idempotency_lock_ttl: float = 10
    #: lock attempts after the first, inside one delivery.
    idempotency_retry_count: int = 3
    #: back-off base between those attempts, seconds.
    idempotency_retry_base_delay: float = 0.1
    #: what a delivery that finds the key still held does: ``"retry"`` (re-queue with a
    #: growing countdown; not counted against ``max_retries``), ``"raise"``
    #: (``LockAcquisitionError``) or ``"ignore"`` (Celery ``Ignore``).
    idempotency_on_locked: str = "retry"
    #: replicas every claim and commit must reach (Redis ``WAIT``, in the same round trip)
    #: before it counts; 0: do not wait. For Sentinel setups, see the README.
    idempotency_wait_replicas: int = 0
    #: seconds ``WAIT`` may block for ``idempotency_wait_replicas``.
    idempotency_wait_timeout: float = 1.0
    #: namespace of every Redis key.
    idempotency_key_prefix: str = "idempotency:"
    #: kill switch: ``False`` runs tasks plainly, without any guard.
    idempotency_enabled: bool = True

    @property
    def backend_url(self) -> str:
        """``idempotency_url`` after the ``broker_url`` fallback (set by :func:`resolve`);
        only meaningful when ``idempotency_client`` is not set."""
        if self.idempotency_url is None:  # pragma: no cover - resolve() always fills one
            raise ValueError("idempotency_url is not resolved (idempotency_client is set)")
        return self.idempotency_url

    @property
    def in_postgres(self) -> bool:
        """Whether locks and records live in PostgreSQL (``postgresql://``, ``django://``)."""
        return self.idempotency_client is None and (self.idempotency_url or "").startswith(
            POSTGRES_SCHEMES
        )

    @property
    def in_memory(self) -> bool:
        """Whether locks and records live in this process only (``memory://``)."""
        return self.idempotency_client is None and (self.idempotency_url or "").startswith(
            "memory://"
        )


#: Every setting with its default, in the order of the README's table.
DEFAULTS: Mapping[str, Any] = {f.name: f.default for f in dataclasses.fields(IdempotencySettings)}

_cache: weakref.WeakKeyDictionary[Any, dict[str, IdempotencySettings]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def clear_cache(app: Any = None) -> None:
    """Forget cached settings (of one app, or of all): the next task call reads them again."""
    with _cache_lock:
        if app is None:
            _cache.clear()
        else:
            _cache.pop(app, None)


def resolve(app: Any, task: Any) -> IdempotencySettings:
    """The settings for ``task``: its own options over ``app.conf`` over :data:`DEFAULTS`."""
    # ``@app.task`` returns a lazy proxy until the app is finalized: its type has none of the
    # task's options, yet its ``name`` is the task's, under which the result is cached.
    unwrap = getattr(task, "_get_current_object", None)
    if callable(unwrap):
        task = unwrap()
    name = getattr(task, "name", None) or type(task).__name__
    with _cache_lock:
        per_app = _cache.get(app)
        if per_app is not None and name in per_app:
            return per_app[name]
    values: dict[str, Any] = {}
    from_task: set[str] = set()
    conf = app.conf
    for setting, default in DEFAULTS.items():
        value = _task_option(task, setting)
        if value is _MISSING:
            value = conf.get(setting, default)
            if value is None and setting not in _NULLABLE:
                value = default
        else:
            from_task.add(setting)
        values[setting] = _validate(setting, value, task_name=name)
    _pick_backend(values, from_task, task_name=name)
    if (
        values["idempotency_wait_replicas"]
        and values["idempotency_wait_timeout"] >= values["idempotency_lock_ttl"]
    ):
        raise ValueError(
            f"idempotency_wait_timeout ({values['idempotency_wait_timeout']:g}s) must be shorter "
            f"than idempotency_lock_ttl ({values['idempotency_lock_ttl']:g}s) for task {name}: "
            "a claim that waits that long for its replicas has lost its lease"
        )
    if values["idempotency_url"] is None and values["idempotency_client"] is None:
        fallback = _broker_fallback(conf)
        values["idempotency_url" if isinstance(fallback, str) else "idempotency_client"] = fallback
    resolved = IdempotencySettings(**values)
    with _cache_lock:
        _cache.setdefault(app, {})[name] = resolved
    return resolved


#: Settings whose ``None`` means something (not "use the default").
_NULLABLE = frozenset({"idempotency_url", "idempotency_client"})


def _pick_backend(values: dict[str, Any], from_task: set[str], *, task_name: str) -> None:
    """``idempotency_url`` or ``idempotency_client``: a task option beats the app's other
    setting; both set at one level is an error naming both."""
    url, client = values["idempotency_url"], values["idempotency_client"]
    if url is None or client is None:
        return
    url_by_task = "idempotency_url" in from_task
    client_by_task = "idempotency_client" in from_task
    if url_by_task and not client_by_task:
        values["idempotency_client"] = None
    elif client_by_task and not url_by_task:
        values["idempotency_url"] = None
    else:
        where = "task options" if url_by_task else "app settings"
        raise ValueError(
            f"idempotency_url and idempotency_client are both set in the {where} of task "
            f"{task_name}: set one of them (the client is used instead of the URL)"
        )


class _Missing:
    pass


_MISSING: Any = _Missing()


def _task_option(task: Any, setting: str) -> Any:
    # getattr_static: a callable set with @app.task(idempotency_key=fn) is a plain function
    # on the generated class; plain getattr would hand back a bound method.
    try:
        value = inspect.getattr_static(type(task), setting)
    except AttributeError:
        return _MISSING
    if isinstance(value, staticmethod):
        value = value.__func__
    return _MISSING if value is None else value


def _validate(setting: str, value: Any, *, task_name: str) -> Any:
    where = f"{setting} (task {task_name})"
    if setting == "idempotency_url":
        if value is None:
            return None
        if not isinstance(value, str):
            raise TypeError(f"{where} must be a URL string, not {type(value).__name__}")
        if not value.startswith((*REDIS_SCHEMES, *POSTGRES_SCHEMES, "memory://")):
            raise ValueError(
                f"{where} must be a redis://, rediss://, unix://, postgresql://, postgres://, "
                "django://<alias> or memory:// URL, "
                f"got {_redact(value)!r}"
            )
        return value
    if setting == "idempotency_client":
        if value is None or _is_client(value) or callable(value):
            return value
        raise TypeError(
            f"{where} must be a redis-py client (redis.Redis, a Sentinel master_for client, "
            f"RedisCluster) or a callable that returns one, not {type(value).__name__}"
        )
    if setting == "idempotency_key":
        if callable(value):
            return value
        if not isinstance(value, str) or not value:
            raise TypeError(
                f"{where} must be 'args', 'task_id', a format string or a callable "
                f"(task, args, kwargs) -> str, not {value!r}"
            )
        return value
    if setting in ("idempotency_ttl", "idempotency_lock_ttl"):
        return check_duration(where, value)
    if setting in ("idempotency_retry_count", "idempotency_wait_replicas"):
        return check_count(where, value)
    if setting == "idempotency_wait_timeout":
        return check_duration(where, value)
    if setting == "idempotency_retry_base_delay":
        return check_delay(where, value)
    if setting == "idempotency_on_locked":
        if value not in ON_LOCKED_POLICIES:
            raise ValueError(
                f"{where} must be one of {', '.join(ON_LOCKED_POLICIES)}, got {value!r}"
            )
        return value
    if setting == "idempotency_key_prefix":
        if not isinstance(value, str) or not value or "{" in value or "}" in value:
            raise ValueError(f"{where} must be a non-empty str without braces, got {value!r}")
        return value
    if setting == "idempotency_enabled":
        if not isinstance(value, bool):
            raise TypeError(f"{where} must be True or False, got {value!r}")
        return value
    raise AssertionError(setting)  # pragma: no cover


def _is_client(value: Any) -> bool:
    """Whether ``value`` looks like a redis-py client (what the Redis backends call on it)."""
    return not isinstance(value, type) and callable(getattr(value, "register_script", None))


def make_client_from(value: Any, *, task_name: str | None = None) -> Any:
    """The client an ``idempotency_client`` setting stands for: the value itself, or what
    the callable returns (checked, with an error naming the setting)."""
    where = "idempotency_client" + (f" (task {task_name})" if task_name else "")
    if _is_client(value):
        return value
    client = value()
    if not _is_client(client):
        raise TypeError(
            f"{where} returned {type(client).__name__}, not a redis-py client (redis.Redis, "
            "a Sentinel master_for client, RedisCluster)"
        )
    return client


#: One client factory per Sentinel broker configuration, shared by every task that falls back
#: to it, so that a worker process makes one Sentinel client for them all.
_sentinel_factories: dict[str, Any] = {}


def _broker_fallback(conf: Any) -> Any:
    """The Redis ``broker_url`` (a URL), or for a ``sentinel://`` broker a client factory on
    the same Sentinel master (from ``broker_transport_options``); else a ValueError."""
    # Celery's own ``broker_url`` property: ``CELERY_BROKER_URL`` from the environment first,
    # then ``broker_url``/``broker_host`` (plain ``conf.get`` would miss the environment).
    try:
        broker = conf.broker_url or ""
    except AttributeError:
        broker = conf.get("broker_url") or conf.get("broker_host") or ""
    if isinstance(broker, (list, tuple)):  # failover URLs, as ';' in a string
        broker = ";".join(str(url) for url in broker)
    broker = str(broker)
    first = broker.split(";")[0].strip()
    if first.startswith(REDIS_SCHEMES):
        return first
    if first.startswith("sentinel://"):
        from celery_idempotent._redis import sentinel_factory_from_broker  # noqa: PLC0415

        options = conf.get("broker_transport_options") or {}
        ident = repr((broker, sorted(options.items(), key=lambda item: str(item[0]))))
        with _cache_lock:
            factory = _sentinel_factories.get(ident)
            if factory is None:
                factory = _sentinel_factories[ident] = sentinel_factory_from_broker(broker, options)
        return factory
    raise ValueError(
        "idempotency_url is not set and broker_url "
        f"({_redact(first) or 'unset'!r}) is not a Redis URL: set "
        "app.conf.idempotency_url = 'redis://host:6379/0' (or 'memory://' for one process)"
    )


def _redact(url: str) -> str:
    from celery_idempotent._redis import _redact as redact  # noqa: PLC0415

    return redact(url)


def setting_names() -> list[str]:
    """The setting names, for documentation and tests."""
    return list(DEFAULTS)


#: ``(task, args, kwargs) -> str``: the shape of a callable ``idempotency_key``.
KeyFunction = Callable[[Any, tuple[Any, ...], dict[str, Any]], str]
