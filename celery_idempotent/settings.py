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
from dataclasses import dataclass, field
from typing import Any

from celery_idempotent.core.names import DEFAULT_PREFIX
from celery_idempotent.core.validate import check_count, check_delay, check_duration, check_ttl
from celery_idempotent.setting_checks import (
    DUPLICATE_PUBLISH_POLICIES,
    MISSING_KEY_POLICIES,
    MYSQL_SCHEMES,
    ON_LOCKED_POLICIES,
    POSTGRES_SCHEMES,
    PUBLISH_UNTIL,
    REDIS_SCHEMES,
    Check,
    check_bool,
    check_client,
    check_fingerprint,
    check_key,
    check_key_prefix,
    check_namespace,
    check_store_errors,
    check_url,
    check_window,
    is_client,
    never_stored,
    one_of,
)
from celery_idempotent.urls import redact

__all__ = [
    "DEFAULTS",
    "DUPLICATE_PUBLISH_POLICIES",
    "ON_LOCKED_POLICIES",
    "PUBLISH_UNTIL",
    "IdempotencySettings",
    "check_setting",
    "clear_cache",
    "make_client_from",
    "never_stored",
    "resolve",
    "result_accept",
    "setting",
    "task_option_defaults",
]


def setting(
    default: Any, check: Check, *, nullable: bool = False, none_as_option: bool = False
) -> Any:
    """One setting, declared once: its default, its ``check(where, value)``, and what ``None``
    means. ``nullable``: ``None`` is a value of its own (else it means "the default");
    ``none_as_option``: also as a task option, whose "not set" is then :data:`NOT_SET`. Its
    documentation is the ``#:`` comment above the field (the docs' reference is built from it).
    """
    metadata = {"check": check, "nullable": nullable, "none_as_option": none_as_option}
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class IdempotencySettings:
    """The resolved settings for one task. Field names are the setting names."""

    #: where locks and records live: ``redis://``, ``rediss://``, ``unix://``; ``postgresql://``
    #: (``postgres://``) or ``django://<alias>``: PostgreSQL, where the record commits in the
    #: body's own transaction (:mod:`celery_idempotent.backends.postgres`); ``mysql://``: MariaDB
    #: 10.6+ (tested: 10.11) or MySQL 8.0.1+ (supported by design, not tested: no MySQL server
    #: was available), likewise (:mod:`celery_idempotent.backends.mysql`; ``django://``
    #: too when the alias is on Django's MySQL engine); or ``memory://`` for one
    #: process. ``None``: the ``broker_url`` when it is a Redis URL, the same Sentinel
    #: master when it is a ``sentinel://`` URL (with ``broker_transport_options['master_name']``,
    #: as kombu reads them), else an error that says so.
    idempotency_url: str | None = setting(None, check_url, nullable=True)
    #: a ready redis-py client (``redis.Redis``, a Sentinel ``master_for`` client,
    #: ``RedisCluster``) or a callable without arguments that returns one, called once per
    #: worker process: for Sentinel and Cluster, which a URL cannot describe. Set it or
    #: ``idempotency_url``, not both (a task option beats the app's other setting).
    idempotency_client: Any = setting(None, check_client, nullable=True)
    #: ``"args"``, ``"task_id"``, a format string over the bound arguments, or a callable
    #: ``(task, args, kwargs) -> str``.
    idempotency_key: Any = setting("args", check_key)
    #: what must match between duplicates of one key: ``"args"`` (every bound argument), a
    #: tuple of argument names (only these; others, like a ``requested_at`` timestamp, may
    #: differ), a callable ``(task, args, kwargs) -> str | None`` (its string is hashed before
    #: it is stored; ``None`` skips the check for that call), or ``None`` (no check).
    idempotency_fingerprint: Any = setting(
        "args", check_fingerprint, nullable=True, none_as_option=True
    )
    #: a key whose format field is ``None`` (``"user:{user_id}"`` with ``user_id=None``) or
    #: whose callable returns ``None``: ``"raise"`` (``IdempotencyKeyMissingError``, the body
    #: does not run) or ``"run"`` (run unguarded, one WARNING per call).
    idempotency_missing_key: str = setting("raise", one_of(MISSING_KEY_POLICIES))
    #: the namespace of the task's keys; ``None``: the task's name. Fix it and the keys survive
    #: a rename or a module move; two tasks share one only when both declare it (the worker
    #: warns at start otherwise).
    idempotency_namespace: str | None = setting(None, check_namespace, nullable=True)
    #: exception classes whose failure is stored like a result and raised again (same class,
    #: same args) to every duplicate within ``idempotency_ttl``; the body does not run again.
    #: ``Retry``, ``Ignore``, ``Reject``, time limits and this library's errors are never
    #: stored.
    idempotency_store_errors: tuple[type[Exception], ...] = setting((), check_store_errors)
    #: seconds a committed result is kept. ``0``: nothing is kept once the body ends (never
    #: twice at the same time, again afterwards): a duplicate delivery that arrives after the
    #: body ended, a broker redelivery included, runs the body again, and a failure listed in
    #: ``idempotency_store_errors`` is raised to its delivery and not kept either.
    idempotency_ttl: float = setting(86_400, check_ttl)
    #: lease seconds; renewed every third of it while the body runs.
    idempotency_lock_ttl: float = setting(10, check_duration)
    #: lock attempts after the first, inside one delivery.
    idempotency_retry_count: int = setting(3, check_count)
    #: back-off base in seconds between those attempts: ``base * 2**i + uniform(0, base)``
    #: before attempt ``i + 1``.
    idempotency_retry_base_delay: float = setting(0.1, check_delay)
    #: what a delivery that finds the key still held does: ``"retry"`` (re-queue with a
    #: growing countdown; not counted against ``max_retries``), ``"raise"``
    #: (``LockAcquisitionError``), ``"ignore"`` (Celery ``Ignore``) or ``"reject"`` (Celery
    #: ``Reject(requeue=False)``: with ``task_acks_late``, a broker's dead-letter exchange takes the
    #: duplicate; nothing is recorded under its task id, on Celery 5.7 too).
    idempotency_on_locked: str = setting("retry", one_of(ON_LOCKED_POLICIES))
    #: what ``apply_async``/``delay`` does with a call whose key is already completed, queued
    #: or running (one Redis round trip at publish): ``"existing"`` (publish nothing; return
    #: the first call's result: its value at once when completed, else its ``AsyncResult``),
    #: ``"raise"`` (``DuplicatePublishError``) or ``"publish"`` (publish anyway; the worker
    #: replays). Calls with links, chains, groups and chords always publish.
    idempotency_on_duplicate_publish: str = setting("existing", one_of(DUPLICATE_PUBLISH_POLICIES))
    #: seconds a "queued" marker set at publish lives at most (counted from the message's due
    #: time for a ``countdown``/``eta``): a message no worker ever claims (lost by the broker)
    #: blocks its key's publishes for no longer than this. Once a delivery claims the key, the
    #: marker lives only as long as that delivery's lease (on Redis). 3600 s is kombu's
    #: default Redis ``visibility_timeout``: a message a killed worker had prefetched, never
    #: claimed, comes back after it (measured by ``python -m benchmarks.publish_ttl``). A
    #: shorter TTL costs at most an extra message per identical publish, which the worker
    #: replays; a longer one keeps a lost message's key blocked longer.
    idempotency_publish_ttl: float = setting(3600, check_duration)
    #: how long a published call stops a duplicate publish: ``"completed"`` (while it is
    #: queued, running or completed) or ``"started"`` (only while it is queued: its delivery's
    #: claim ends its marker, so one call may run while one more waits; a publish after it
    #: completed goes through, and the worker replays it while the record lives). Every
    #: backend with a publish side: Redis, PostgreSQL and MySQL/MariaDB (their marker table
    #: ``<table>_markers``, created at first use); with ``idempotency_ttl=0`` it is
    #: celery-once's ``unlock_before_run``.
    idempotency_publish_until: str = setting("completed", one_of(PUBLISH_UNTIL))
    #: schedule slot in seconds (or a ``timedelta``): the key gets the publish time rounded to
    #: the nearest multiple of it, so that a periodic task runs once per slot however many
    #: ``celery beat`` instances publish it; ``None``: no slot. A task's own
    #: ``idempotency_window=None`` switches an app-wide window off for that task.
    idempotency_window: float | None = setting(
        None, check_window, nullable=True, none_as_option=True
    )
    #: replicas every claim, renewal and commit must reach (Redis ``WAIT``, in the same
    #: round trip) before it counts; 0: do not wait. A failover loses no commit only when it
    #: is every replica the master has (a worker warns at start otherwise): see "Sentinel and
    #: Redis Cluster" in the docs.
    idempotency_wait_replicas: int = setting(0, check_count)
    #: seconds ``WAIT`` may block for ``idempotency_wait_replicas`` (shorter than
    #: ``idempotency_lock_ttl``): a claim that misses its replicas is given back and the
    #: delivery re-queued; a commit is sent again until confirmed or ``lock_ttl`` passes.
    idempotency_wait_timeout: float = setting(1.0, check_duration)
    #: namespace of every Redis key (no braces: they are Redis Cluster hash tags).
    idempotency_key_prefix: str = setting(DEFAULT_PREFIX, check_key_prefix)
    #: kill switch: ``False`` runs tasks plainly, without any guard.
    idempotency_enabled: bool = setting(True, check_bool)

    @property
    def backend_url(self) -> str:
        """``idempotency_url`` after the ``broker_url`` fallback (set by :func:`resolve`);
        only meaningful when ``idempotency_client`` is not set."""
        if self.idempotency_url is None:  # pragma: no cover - resolve() always fills one
            raise ValueError("idempotency_url is not resolved (idempotency_client is set)")
        return self.idempotency_url

    @property
    def in_postgres(self) -> bool:
        """Whether locks and records live in a SQL database's transactions: PostgreSQL
        (``postgresql://``), MySQL / MariaDB (``mysql://``) or Django's (``django://``, on
        either engine). One name for both, since ``django://`` may be either."""
        return self.idempotency_client is None and (self.idempotency_url or "").startswith(
            (*POSTGRES_SCHEMES, *MYSQL_SCHEMES)
        )

    @property
    def in_sql(self) -> bool:
        """The same as :attr:`in_postgres` (the clearer name)."""
        return self.in_postgres

    def namespace_for(self, task_name: str) -> str:
        """The namespace of ``task_name``'s keys: ``idempotency_namespace``, else the task's
        name (the one place that default is spelled)."""
        return self.idempotency_namespace or task_name

    @property
    def in_memory(self) -> bool:
        """Whether locks and records live in this process only (``memory://``)."""
        return self.idempotency_client is None and (self.idempotency_url or "").startswith(
            "memory://"
        )


_FIELDS = {f.name: f for f in dataclasses.fields(IdempotencySettings)}
#: Every setting with its default, in the order of the README's table.
DEFAULTS: Mapping[str, Any] = {name: f.default for name, f in _FIELDS.items()}

_cache: weakref.WeakKeyDictionary[Any, dict[str, IdempotencySettings]] = weakref.WeakKeyDictionary()
_cache_lock = threading.Lock()


def clear_cache(app: Any = None) -> None:
    """Forget cached settings (of one app, or of all): the next task call reads them again."""
    with _cache_lock:
        if app is None:
            _cache.clear()
        else:
            _cache.pop(app, None)


def result_accept(conf: Any) -> list[str]:
    """The content types a stored result is loaded from, as Celery's result backend loads
    them: ``result_accept_content``, else ``accept_content``, else ``["json"]`` (the one place
    this fallback is spelled: the guard, the admin and the command line all use it)."""
    return list(conf.get("result_accept_content") or conf.get("accept_content") or ["json"])


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
        values[setting] = check_setting(setting, value, task_name=name)
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
_NULLABLE = frozenset(name for name, f in _FIELDS.items() if f.metadata.get("nullable"))
#: Of those, the ones whose ``None`` is also meaningful as a task option: for them the
#: ``IdempotentTask`` class attribute is :data:`NOT_SET`, and a task's own ``None`` counts.
_NONE_AS_OPTION = frozenset(name for name, f in _FIELDS.items() if f.metadata.get("none_as_option"))


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


def task_option_defaults() -> dict[str, Any]:
    """Every setting as ``IdempotentTask`` declares it: ``None`` (use the app's setting), or
    :data:`NOT_SET` for a setting whose ``None`` is a task's own choice."""
    return {name: NOT_SET if name in _NONE_AS_OPTION else None for name in DEFAULTS}


def declared_by_task(task: Any, setting: str) -> bool:
    """Whether ``task`` sets ``setting`` as its own option (not inherited from the app)."""
    unwrap = getattr(task, "_get_current_object", None)
    if callable(unwrap):
        task = unwrap()
    return _task_option(task, setting) is not _MISSING


def check_setting(setting: str, value: Any, *, task_name: str) -> Any:
    check: Check | None = _FIELDS[setting].metadata.get("check")
    if check is None:  # pragma: no cover - a field declared without setting()
        raise TypeError(f"{setting} is declared without setting(default, check) in settings.py")
    return check(f"{setting} (task {task_name})", value)


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


def make_client_from(value: Any, *, task_name: str | None = None) -> Any:
    """The client an ``idempotency_client`` setting stands for: the value itself, or what
    the callable returns (checked, with an error naming the setting)."""
    where = "idempotency_client" + (f" (task {task_name})" if task_name else "")
    if is_client(value):
        return value
    client = value()
    if not is_client(client):
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
        from celery_idempotent.backends.redis.client import sentinel_factory_from_broker  # noqa: PLC0415

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
