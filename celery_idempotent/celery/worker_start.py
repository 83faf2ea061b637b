"""What a worker checks when it starts (Celery's ``celeryd_after_setup`` signal): the settings
of every :class:`~celery_idempotent.IdempotentTask`, where their keys live, and the setups that
can break a promise (a green pool, an evicting Redis, namespaces shared by accident, a periodic
task whose key would collapse its runs). Each check logs, and returns its messages.

The signal receivers are connected when this module is imported (``task.py`` imports it).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, TypeVar

from celery import signals as celery_signals

from celery_idempotent.backends.redis.client import import_redis
from celery_idempotent.backends.redis.health import (
    eviction_policy,
    eviction_warning,
    health_client,
)
from celery_idempotent.celery.factory import backend_label
from celery_idempotent.core import green
from celery_idempotent.setting_checks import POSTGRES_SCHEMES
from celery_idempotent.settings import IdempotencySettings, declared_by_task, resolve

if TYPE_CHECKING:
    from celery_idempotent.celery.task import IdempotentTask

__all__ = [
    "AT_WORKER_START",
    "BACKEND_KINDS",
    "STARTUP_CHECKS",
    "StartupError",
    "applies_to",
    "backend_kind",
    "check_app_at_worker_start",
    "check_beat_schedule",
    "check_delivery",
    "check_eviction",
    "check_mysql",
    "check_namespaces",
    "check_pool",
    "check_postgres",
    "check_replicas",
    "check_setting_names",
    "run_startup_checks",
]

log = logging.getLogger("celery_idempotent")


def _idempotent_tasks(app: Any) -> dict[str, IdempotentTask]:
    """The :class:`~celery_idempotent.IdempotentTask` tasks of ``app`` by name, sorted."""
    # Imported here: task.py imports this module (to connect the receivers below).
    from celery_idempotent.celery.task import IdempotentTask  # noqa: PLC0415

    tasks = {name: app.tasks[name] for name in sorted(app.tasks)}
    return {name: task for name, task in tasks.items() if isinstance(task, IdempotentTask)}


#: A task that the start-up check resolved: (name, task, its settings).
Resolved = tuple[str, "IdempotentTask", IdempotencySettings]


def check_app_at_worker_start(app: Any) -> list[str]:
    """Resolve the settings of every :class:`IdempotentTask` of ``app``; log one INFO line
    (how many tasks, where their keys live), one ERROR per misconfigured task, and one WARNING
    per finding of the :data:`STARTUP_CHECKS` (a setup that can break a promise).

    Connected to Celery's ``celeryd_after_setup`` signal, so that a bad or missing setting
    (an amqp broker and no ``idempotency_url``, a negative TTL) shows in the worker's log when
    it starts, not first when a task fails. Returns the error messages.
    """
    errors: list[str] = []
    places: dict[str, int] = {}
    resolved: list[Resolved] = []
    for name, task in _idempotent_tasks(app).items():
        try:
            cfg = resolve(app, task)
        except (TypeError, ValueError) as exc:
            message = f"task {name} is misconfigured: {exc}; its calls fail until it is fixed"
            log.error("celery-idempotent: %s", message)  # noqa: TRY400 - no traceback needed
            errors.append(message)
            continue
        if not cfg.idempotency_enabled:
            label = "disabled (idempotency_enabled=False)"
        else:
            label = backend_label(cfg)
            resolved.append((name, task, cfg))
        places[label] = places.get(label, 0) + 1
    if places:
        log.info(
            "celery-idempotent: %d idempotent task(s): %s",
            sum(places.values()),
            ", ".join(f"{n} at {label}" for label, n in places.items()),
        )
    errors.extend(run_startup_checks(app, resolved))
    return errors


def run_startup_checks(app: Any, resolved: list[Resolved]) -> list[str]:
    """Run each of :data:`STARTUP_CHECKS` on the tasks whose backend it applies to (its
    ``backends``, see :func:`applies_to`); log each finding (an :class:`StartupError` as
    ERROR, the others as WARNING) and return the errors."""
    errors: list[str] = []
    for check in STARTUP_CHECKS:
        kinds = getattr(check, "backends", None)
        tasks = [t for t in resolved if kinds is None or backend_kind(t[2]) in kinds]
        if kinds is not None and not tasks:
            continue
        try:
            found = check(app, tasks)
        except Exception:  # a check must never stop the worker
            log.exception("celery-idempotent: start-up check %s failed", check.__name__)
            continue
        for message in found:
            if isinstance(message, StartupError):
                log.error("celery-idempotent: %s", message)
                errors.append(message)
            else:
                log.warning("celery-idempotent: %s", message)
    return errors


class StartupError(str):
    """A start-up finding that is an ERROR (the tasks cannot work as configured), not a
    WARNING (a setup that can break a promise)."""

    __slots__ = ()


#: The backend kinds a check can declare (see :func:`backend_kind`).
BACKEND_KINDS = ("memory", "redis", "postgres", "mysql", "other")

Check = TypeVar("Check", bound=Callable[..., Any])


def applies_to(*kinds: str) -> Callable[[Check], Check]:
    """Declare the backend kinds a start-up check is about: it then receives only the tasks
    whose keys live on one of them, and does not run when there are none (a Redis check never
    sees a PostgreSQL URL)."""
    unknown = [kind for kind in kinds if kind not in BACKEND_KINDS]
    if unknown or not kinds:
        raise ValueError(f"backend kinds must be among {BACKEND_KINDS}, got {kinds!r}")

    def mark(check: Check) -> Check:
        check.backends = frozenset(kinds)  # type: ignore[attr-defined]
        return check

    return mark


def backend_kind(cfg: IdempotencySettings) -> str:
    """``memory``, ``redis``, ``postgres`` (``postgresql://``, ``django://``), ``mysql`` or
    ``other``: where a task's keys live, judged from its settings without connecting."""
    if cfg.in_memory:
        return "memory"
    if cfg.idempotency_client is not None:
        return "redis"
    url = cfg.backend_url
    if url.startswith(POSTGRES_SCHEMES):
        return "postgres"
    if url.startswith(("mysql://", "mariadb://")):
        return "mysql"
    if url.startswith(("redis://", "rediss://", "unix://", "sentinel://", "redis+sentinel://")):
        return "redis"
    return "other"


# One small function per start-up check: (app, the enabled tasks) -> warning messages.


@applies_to("redis", "memory")
def check_pool(app: Any, tasks: list[Resolved]) -> list[str]:
    """Under gevent or eventlet: what a body that does not yield risks, and which lease to
    choose."""
    runtime = green.runtime()
    if runtime is None or not tasks:
        return []
    shortest = min(tasks, key=lambda t: t[2].idempotency_lock_ttl)
    ttl, name = shortest[2].idempotency_lock_ttl, shortest[0]
    messages = [
        f"pool {runtime}: lease renewals run on an OS thread with a Redis connection of their "
        "own, so a body that blocks the event loop in Python code (a CPU loop) keeps its lease "
        "and costs none of the others. A body blocked in one C call that holds the GIL (some C "
        "extensions: image, PDF, compression, a database driver the pool does not patch) stops "
        "every renewal of this worker process for as long as it runs: past "
        f"idempotency_lock_ttl (here as short as {ttl:g}s, task {name}) the leases of all its "
        "bodies run out, their keys can run again elsewhere, and their commits are refused "
        "(LockLostError). Choose idempotency_lock_ttl longer than the longest such call"
    ]
    hub_renewed = sorted(name for name, _, cfg in tasks if not _renews_natively(cfg))
    if hub_renewed:
        messages.append(
            f"pool {runtime}: tasks {', '.join(hub_renewed)} use a Redis client whose "
            "connections the lease keeper's OS thread cannot have (TLS, Sentinel, Cluster or a "
            "client factory): their leases are renewed on the event loop, so any body of this "
            "worker that does not yield for idempotency_lock_ttl seconds costs them their "
            "leases; give those tasks an idempotency_lock_ttl longer than the longest such body"
        )
    return messages


def _renews_natively(cfg: IdempotencySettings) -> bool:
    """Whether the keeper's OS thread can have its own connection for these settings (judged
    without connecting)."""
    source = cfg.idempotency_client
    if source is None:
        return cfg.in_memory is False and cfg.backend_url.startswith(("redis://", "unix://"))
    if not callable(getattr(source, "register_script", None)):
        return False  # a factory: its client is made in each worker process
    from celery_idempotent.backends.redis import native as native_redis  # noqa: PLC0415

    return native_redis.native_caller_for(source, green.natives()) is not None


@applies_to("redis")
def check_eviction(app: Any, tasks: list[Resolved]) -> list[str]:
    """The ``maxmemory-policy`` of every Redis the tasks' keys live on (one ``INFO memory``
    each, on a short-lived client)."""
    backends: dict[Any, IdempotencySettings] = {}
    for _, _, cfg in tasks:
        if not cfg.in_memory:
            source = cfg.idempotency_client
            ident = ("url", cfg.backend_url) if source is None else ("client", id(source))
            backends.setdefault(ident, cfg)
    messages: list[str] = []
    for cfg in backends.values():
        unreachable = _redis_unreachable(cfg)
        if unreachable is not None:
            messages.append(
                StartupError(
                    f"the idempotency Redis at {backend_label(cfg)} is unreachable "
                    f"({unreachable}): every idempotent task fails until it answers"
                )
            )
            continue
        policy, error = _read_policy(cfg)
        message = eviction_warning(backend_label(cfg), policy, error)
        if message is not None:
            messages.append(message)
    return messages


def _redis_unreachable(cfg: IdempotencySettings) -> str | None:
    """Why the Redis of ``cfg``'s URL does not answer a PING (a connection error), or ``None``
    (it answers, or refuses PING for another reason, or is not a plain URL)."""
    if cfg.idempotency_client is not None:
        return None
    redis_mod = import_redis()
    client = redis_mod.Redis.from_url(
        cfg.backend_url, socket_timeout=2.0, socket_connect_timeout=2.0
    )
    try:
        client.ping()
    except (redis_mod.ConnectionError, redis_mod.TimeoutError) as exc:
        return str(exc) or type(exc).__name__
    except Exception:  # refused by an ACL, say: reachable; the eviction check reports it
        return None
    finally:
        client.close()
    return None


def _read_policy(cfg: IdempotencySettings) -> tuple[str | None, str | None]:
    source = cfg.idempotency_client
    with health_client(source, cfg.backend_url if source is None else None) as client:
        if client is None:
            # A user's factory is called once per worker process, by the tasks: not here.
            return None, "idempotency_client is a factory; it is not called at start"
        return eviction_policy(client)


@applies_to("redis")
def check_replicas(app: Any, tasks: list[Resolved]) -> list[str]:
    """``idempotency_wait_replicas`` against the replicas each master has now (one ``INFO
    replication`` each): more than it has, every claim is given back and re-queued (ERROR);
    fewer, a Sentinel failover can lose commits that a replica which is not promoted
    confirmed, since the old master keeps it until it is demoted (WARNING; measured in
    ``docs/operations/sentinel-cluster.md``)."""
    seen: dict[Any, tuple[IdempotencySettings, list[str]]] = {}
    for name, _, cfg in tasks:
        if cfg.idempotency_wait_replicas:
            source = cfg.idempotency_client
            ident = ("url", cfg.backend_url) if source is None else ("client", id(source))
            entry = seen.setdefault((ident, cfg.idempotency_wait_replicas), (cfg, []))
            entry[1].append(name)
    messages: list[str] = []
    for (_, wait), (cfg, names) in seen.items():
        replicas = _replica_count(cfg)
        if replicas is None or replicas == wait:
            continue
        what = f"idempotency_wait_replicas={wait} (tasks {', '.join(sorted(names))})"
        where = f"the master at {backend_label(cfg)} has {replicas} replica(s) connected"
        if replicas < wait:
            messages.append(
                StartupError(
                    f"{what}, but {where}: every claim is given back and its delivery "
                    f"re-queued until {wait} are"
                )
            )
        else:
            messages.append(
                f"{what}, and {where}: in a failover the old master keeps confirming writes "
                "through a replica that is not promoted until it is demoted, and commits "
                f"confirmed that way are lost; set it to {replicas} to lose none"
            )
    return messages


def _replica_count(cfg: IdempotencySettings) -> int | None:
    """``connected_slaves`` of the Redis of ``cfg``, or ``None`` when it cannot be read."""
    source = cfg.idempotency_client
    with health_client(source, cfg.backend_url if source is None else None) as client:
        if client is None:
            return None  # a user's factory is called once per worker process, not here
        try:
            return int(client.info("replication").get("connected_slaves", 0))
        except Exception:  # unreachable or INFO refused: the other checks say so
            return None


@applies_to("postgres")
def check_postgres(app: Any, tasks: list[Resolved]) -> list[str]:
    """Each PostgreSQL backend of the tasks answers, and has its table: an unknown
    ``django://<alias>``, a server that does not answer, or (with the Django app installed)
    a table not migrated yet are ERRORs now rather than at the first call."""
    from celery_idempotent.celery import checks  # noqa: PLC0415

    seen: dict[str, list[str]] = {}
    for name, _, cfg in tasks:
        seen.setdefault(cfg.backend_url, []).append(name)
    messages: list[str] = []
    for url, names in seen.items():
        problem = checks.postgres_problem(url)
        if problem is not None:
            messages.append(StartupError(f"{problem} (tasks {', '.join(names)})"))
    return messages


@applies_to("mysql")
def check_mysql(app: Any, tasks: list[Resolved]) -> list[str]:
    """Each MySQL backend of the tasks answers (``mysql://``; ``django://`` on Django's MySQL
    engine is checked by :func:`check_postgres`, which reads Django's alias): a server that
    does not answer, or PyMySQL missing, is an ERROR now rather than at the first call."""
    from celery_idempotent.urls import redact  # noqa: PLC0415

    seen: dict[str, list[str]] = {}
    for name, _, cfg in tasks:
        seen.setdefault(cfg.backend_url, []).append(name)
    messages: list[str] = []
    for url, names in seen.items():
        try:
            from celery_idempotent.backends.mysql import MySQLBackend  # noqa: PLC0415

            backend = MySQLBackend(url)
            conn = backend._connect()
            try:
                backend._flight(conn, [("SELECT 1", ())])
            finally:
                conn.close()
        except Exception as exc:
            text = str(exc).strip().splitlines()
            messages.append(
                StartupError(
                    f"the idempotency MySQL at {redact(url)} is unreachable: "
                    f"{text[0] if text else type(exc).__name__} (tasks {', '.join(names)})"
                )
            )
    return messages


def check_delivery(app: Any, tasks: list[Resolved]) -> list[str]:
    """Tasks whose message is acknowledged so that a killed worker loses the call (see
    :func:`celery_idempotent.celery.checks.delivery_warnings`)."""
    from celery_idempotent.celery import checks  # noqa: PLC0415

    return checks.delivery_warnings(app, [task for _, task, _ in tasks])


def check_setting_names(app: Any, tasks: list[Resolved]) -> list[str]:
    """Settings whose name looks like one of ours but is not (see
    :func:`celery_idempotent.celery.checks.misspelt_settings`): ERRORs."""
    from celery_idempotent.celery import checks  # noqa: PLC0415

    return [StartupError(message) for message in checks.misspelt_settings(app)]


#: The checks :func:`check_app_at_worker_start` runs, in order. A check decorated with
#: :func:`applies_to` gets only the tasks on the backends it names, and is skipped without any.
STARTUP_CHECKS: list[Callable[[Any, list[Resolved]], list[str]]] = [
    check_setting_names,
    check_delivery,
    check_pool,
    check_eviction,
    check_replicas,
    check_postgres,
    check_mysql,
]


def check_namespaces(app: Any) -> list[str]:
    """Log one WARNING for each key namespace that idempotent tasks of ``app`` share by
    accident, and return the messages.

    Tasks whose keys share a namespace (on the same Redis, under the same key prefix) replay
    each other's results. That is meant only when every one of them declares the same
    ``idempotency_namespace`` as its own task option; a namespace that one task takes by
    default (its name) or from the app's setting, and another declares or also inherits, is
    an accident. Misconfigured and disabled tasks are left to the other checks.
    """
    groups: dict[tuple[str, str, str], list[tuple[str, bool]]] = {}
    for name, task in _idempotent_tasks(app).items():
        try:
            cfg = resolve(app, task)
        except (TypeError, ValueError):
            continue
        if not cfg.idempotency_enabled:
            continue
        namespace = cfg.namespace_for(name)
        where = (backend_label(cfg), cfg.idempotency_key_prefix, namespace)
        declared = declared_by_task(task, "idempotency_namespace")
        groups.setdefault(where, []).append((name, declared))
    messages: list[str] = []
    for (_, _, namespace), members in groups.items():
        if len(members) < 2 or all(declared for _, declared in members):
            continue
        undeclared = [name for name, declared in members if not declared]
        message = (
            f"tasks {', '.join(name for name, _ in members)} share the key namespace "
            f"{namespace!r} by accident ({', '.join(undeclared)} did not declare it): a "
            "duplicate of one replays the other's result. Give each task its own "
            "idempotency_namespace, or declare the same one on every task meant to share it"
        )
        log.warning("celery-idempotent: %s", message)
        messages.append(message)
    return messages


def check_beat_schedule(app: Any) -> list[str]:
    """Log one WARNING for each :class:`IdempotentTask` named in ``beat_schedule`` whose key
    would collapse its runs, and return the messages.

    A periodic task keyed by its arguments (the default) or by a format string, without an
    ``idempotency_window``, gets the same key at every run: it runs once, then only replays
    for ``idempotency_ttl``. The fix is ``idempotency_window`` (its period) or
    ``idempotency_key="task_id"``.
    """
    messages: list[str] = []
    schedule = app.conf.get("beat_schedule") or {}
    tasks = _idempotent_tasks(app)
    for entry_name, entry in sorted(schedule.items(), key=lambda item: str(item[0])):
        name = entry.get("task") if isinstance(entry, dict) else None
        task = tasks.get(name) if isinstance(name, str) else None
        if task is None:
            continue
        try:
            cfg = resolve(app, task)
        except (TypeError, ValueError):
            continue  # reported by check_app_at_worker_start
        strategy = cfg.idempotency_key
        if (
            not cfg.idempotency_enabled
            or cfg.idempotency_window is not None
            or not cfg.idempotency_ttl  # 0: nothing kept, each run after the last one runs
            or callable(strategy)
            or strategy == "task_id"
        ):
            continue
        keyed_by = "its arguments" if strategy == "args" else f"the format string {strategy!r}"
        message = (
            f"periodic task {name} (beat_schedule entry {entry_name!r}) is keyed by {keyed_by} "
            f"and has no idempotency_window: every run gets the same key, so it runs once and "
            f"then only replays the stored result for idempotency_ttl "
            f"({cfg.idempotency_ttl:g} s). Set idempotency_window to its period (one run per "
            "slot, however many beat instances publish it) or idempotency_key='task_id'"
        )
        log.warning("celery-idempotent: %s", message)
        messages.append(message)
    return messages


#: What a worker checks at start, in this order (each logs its own findings).
AT_WORKER_START: list[Callable[[Any], list[str]]] = [
    check_beat_schedule,
    check_app_at_worker_start,
    check_namespaces,
]


def _check_at_worker_start(sender: Any = None, instance: Any = None, **kwargs: Any) -> None:
    app = getattr(instance, "app", None)
    if app is None:
        return
    from celery_idempotent.celery.checks import mark_checked  # noqa: PLC0415

    mark_checked(app)  # the worker's own publishes need not repeat the checks
    for check in AT_WORKER_START:
        try:
            check(app)
        except Exception:  # one check failing must not stop the others, nor the worker
            log.exception("celery-idempotent: start-up check %s failed", check.__name__)


celery_signals.celeryd_after_setup.connect(
    _check_at_worker_start, weak=False, dispatch_uid="celery_idempotent.check_at_worker_start"
)
