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
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from celery_idempotent import keyspace
from celery_idempotent._validate import check_count, check_delay, check_duration
from celery_idempotent.urls import redact

__all__ = [
    "DEFAULTS",
    "ON_LOCKED_POLICIES",
    "IdempotencySettings",
    "clear_cache",
    "make_client_from",
    "resolve",
]

ON_LOCKED_POLICIES = ("retry", "raise", "ignore", "reject")
MISSING_KEY_POLICIES = ("raise", "run")
KEY_STRATEGIES = ("args", "task_id")
#: What follows the namespace in a task key (``<namespace>:args:<sha256>``); a namespace may not
#: contain one, or the admin command could not tell where it ends.
KIND_MARKERS = keyspace.KIND_MARKERS
REDIS_SCHEMES = ("redis://", "rediss://", "unix://")
#: The PostgreSQL backend's schemes (records commit in the body's transaction; see
#: :mod:`celery_idempotent.postgres`).
POSTGRES_SCHEMES = ("postgresql://", "postgres://", "django://")


@dataclass(frozen=True)
class IdempotencySettings:
    """The resolved settings for one task. Field names are the setting names."""

    #: where locks and records live: ``redis://``, ``rediss://``, ``unix://``, or ``memory://``
    #: for one process. ``None``: the ``broker_url`` when it is a Redis URL, the same Sentinel
    #: master when it is a ``sentinel://`` URL (with ``broker_transport_options['master_name']``,
    #: as kombu reads them), else an error that says so.
    idempotency_url: str | None = None
    #: a ready redis-py client (``redis.Redis``, a Sentinel ``master_for`` client,
    #: ``RedisCluster``) or a callable without arguments that returns one, called once per
    #: worker process: for Sentinel and Cluster, which a URL cannot describe. Set it or
    #: ``idempotency_url``, not both (a task option beats the app's other setting).
    idempotency_client: Any = None
    #: ``"args"``, ``"task_id"``, a format string over the bound arguments, or a callable
    #: ``(task, args, kwargs) -> str``.
    idempotency_key: Any = "args"
    #: what must match between duplicates of one key: ``"args"`` (every bound argument), a
    #: tuple of argument names (only these; others, like a ``requested_at`` timestamp, may
    #: differ), a callable ``(task, args, kwargs) -> str | None`` (its string is hashed before
    #: it is stored; ``None`` skips the check for that call), or ``None`` (no check).
    idempotency_fingerprint: Any = "args"
    #: a key whose format field is ``None`` (``"user:{user_id}"`` with ``user_id=None``) or
    #: whose callable returns ``None``: ``"raise"`` (``IdempotencyKeyMissingError``, the body
    #: does not run) or ``"run"`` (run unguarded, one WARNING per call).
    idempotency_missing_key: str = "raise"
    #: the namespace of the task's keys; ``None``: the task's name. Fix it and the keys survive
    #: a rename or a module move; two tasks share one only when both declare it (the worker
    #: warns at start otherwise).
    idempotency_namespace: str | None = None
    #: exception classes whose failure is stored like a result and raised again (same class,
    #: same args) to every duplicate within ``idempotency_ttl``; the body does not run again.
    #: ``Retry``, ``Ignore``, ``Reject``, time limits and this library's errors are never
    #: stored.
    idempotency_store_errors: tuple[type[Exception], ...] = ()
    #: seconds a committed result is kept.
    idempotency_ttl: float = 86_400
    #: lease seconds; renewed every third of it while the body runs.
    idempotency_lock_ttl: float = 10
    #: lock attempts after the first, inside one delivery.
    idempotency_retry_count: int = 3
    #: back-off base in seconds between those attempts: ``base * 2**i + uniform(0, base)``
    #: before attempt ``i + 1``.
    idempotency_retry_base_delay: float = 0.1
    #: what a delivery that finds the key still held does: ``"retry"`` (re-queue with a
    #: growing countdown; not counted against ``max_retries``), ``"raise"``
    #: (``LockAcquisitionError``), ``"ignore"`` (Celery ``Ignore``) or ``"reject"`` (Celery
    #: ``Reject(requeue=False)``: a broker's dead-letter exchange takes the duplicate).
    idempotency_on_locked: str = "retry"
    #: replicas every claim and commit must reach (Redis ``WAIT``, in the same round trip)
    #: before it counts; 0: do not wait. For Sentinel setups, see "Sentinel and Redis
    #: Cluster" in the docs.
    idempotency_wait_replicas: int = 0
    #: seconds ``WAIT`` may block for ``idempotency_wait_replicas`` (shorter than
    #: ``idempotency_lock_ttl``): a claim that misses its replicas is given back and the
    #: delivery re-queued; a commit is sent again until confirmed or ``lock_ttl`` passes.
    idempotency_wait_timeout: float = 1.0
    #: namespace of every Redis key (no braces: they are Redis Cluster hash tags).
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
    _check_fingerprint_names(task, values["idempotency_fingerprint"], task_name=name)
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
_NULLABLE = frozenset(
    {"idempotency_url", "idempotency_client", "idempotency_fingerprint", "idempotency_namespace"}
)
#: Of those, the ones whose ``None`` is also meaningful as a task option: for them the
#: ``IdempotentTask`` class attribute is :data:`NOT_SET`, and a task's own ``None`` counts.
_NONE_AS_OPTION = frozenset({"idempotency_fingerprint"})


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
    def __repr__(self) -> str:
        return "<not set>"


_MISSING: Any = _Missing()

#: The class attribute of a task option whose ``None`` means something (``idempotency_fingerprint
#: = None``: no check): "not set on this task, use the app's setting".
NOT_SET: Any = _MISSING


def _task_option(task: Any, setting: str) -> Any:
    # getattr_static: a callable set with @app.task(idempotency_key=fn) is a plain function
    # on the generated class; plain getattr would hand back a bound method.
    try:
        value = inspect.getattr_static(type(task), setting)
    except AttributeError:
        return _MISSING
    if isinstance(value, staticmethod):
        value = value.__func__
    if value is None and setting not in _NONE_AS_OPTION:
        return _MISSING
    return value


def declared_by_task(task: Any, setting: str) -> bool:
    """Whether ``task`` sets ``setting`` as its own option (not inherited from the app)."""
    unwrap = getattr(task, "_get_current_object", None)
    if callable(unwrap):
        task = unwrap()
    return _task_option(task, setting) is not _MISSING


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
                f"got {redact(value)!r}"
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
    if setting == "idempotency_fingerprint":
        return _check_fingerprint(where, value)
    if setting == "idempotency_missing_key":
        if value not in MISSING_KEY_POLICIES:
            raise ValueError(
                f"{where} must be one of {', '.join(MISSING_KEY_POLICIES)}, got {value!r}"
            )
        return value
    if setting == "idempotency_namespace":
        return _check_namespace(where, value)
    if setting == "idempotency_store_errors":
        return _check_store_errors(where, value)
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


def _check_fingerprint(where: str, value: Any) -> Any:
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


def _check_fingerprint_names(task: Any, names: Any, *, task_name: str) -> None:
    """A tuple ``idempotency_fingerprint`` must name the task's arguments (checked here, so a
    typo shows at worker start, not first at a call)."""
    run = getattr(task, "run", None)
    if not isinstance(names, tuple) or not callable(run):
        return
    try:
        params = inspect.signature(run).parameters
    except (TypeError, ValueError):  # pragma: no cover - builtins without a signature
        return
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return  # **kwargs: a name may arrive in it; the call checks
    unknown = [n for n in names if n not in params]
    if unknown:
        raise ValueError(
            f"idempotency_fingerprint (task {task_name}) names {', '.join(unknown)}, which the "
            f"task has no argument for (arguments: {', '.join(params) or 'none'})"
        )


def _check_namespace(where: str, value: Any) -> Any:
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

    from celery_idempotent.exceptions import IdempotencyError  # noqa: PLC0415

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


def _check_store_errors(where: str, value: Any) -> tuple[type[Exception], ...]:
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
        f"({redact(first) or 'unset'!r}) is not a Redis URL: set "
        "app.conf.idempotency_url = 'redis://host:6379/0' (or 'memory://' for one process)"
    )
