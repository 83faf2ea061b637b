"""Inspect and forget idempotency keys: the one admin layer of the CLI and the Python API.

From Python, on any :class:`~celery_idempotent.IdempotentTask` (shaped like ``apply_async``, so
that no parameter name of the task can collide)::

    charge.idempotency_status((42, 999))              # the key a call with these arguments uses
    charge.idempotency_status(args=(42, 999), kwargs={"currency": "EUR"})
    charge.idempotency_status(key="payment-42")       # an explicit key (the per-call header)
    report.idempotency_status(task_id="3f2a...")      # a task keyed by task id
    charge.idempotency_forget((42, 999))              # its next delivery runs the body again

Both, ``celery -A proj idempotency inspect | forget | stats`` (:mod:`celery_idempotent.cli`)
and :func:`forget_all` go through one :class:`~celery_idempotent.core.admin.KeyAdmin`, the
facade every backend implements (Redis: ``RedisAdmin``; PostgreSQL and MySQL: ``SqlAdmin``;
any other store, ``memory://`` included: :class:`~celery_idempotent.core.admin.GuardAdmin`),
made by :func:`admin_for` from a task's resolved settings. None of them asks which backend it
is; none builds a backend's name itself. Redis's own steps stay importable from here:
:func:`read_key`, :func:`status_of`, :func:`forget_plan` and :func:`forget_key`.

States: ``"completed"`` (a record: the result is replayed), ``"running"`` (no record, the lock
is held: a delivery runs the body now), ``"queued"`` (the publish side's marker: a call was
published and its body has not started; its task id is reported) and ``"absent"``.
Records keep the committing delivery's task id where the layout has room and the writer
filled it (layout v2 has the field; ``None`` otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_idempotent.backends.redis.admin import (
    RedisAdmin,
    forget_key,
    forget_plan,
    held_lock_reason,
    status_of,
)
from celery_idempotent.backends.redis.key_info import KeyInfo, read_key
from celery_idempotent.core.admin import (
    Forgotten,
    GuardAdmin,
    IdempotencyStatus,
    KeyAdmin,
    KeyReport,
    NamespaceCount,
    StatsReport,
    format_duration,
)
from celery_idempotent.core.protocols import InspectsKeys
from celery_idempotent.core.states import KeyState

if TYPE_CHECKING:
    from celery_idempotent.core.guard import DistributedIdempotencyGuard
    from celery_idempotent.settings import IdempotencySettings

__all__ = [
    "STATES",
    "Forgotten",
    "ForgottenAll",
    "GuardAdmin",
    "IdempotencyStatus",
    "KeyAdmin",
    "KeyInfo",
    "KeyReport",
    "NamespaceCount",
    "NamespaceForgotten",
    "StatsReport",
    "admin_for",
    "forget_all",
    "forget_from_guard",
    "forget_key",
    "forget_plan",
    "format_duration",
    "held_lock_reason",
    "idempotent_tasks",
    "read_key",
    "status_from_guard",
    "status_of",
]

#: Every state a key can be in, as :attr:`IdempotencyStatus.state` spells it.
STATES = tuple(state.value for state in KeyState)

#: Why keys in ``memory://`` cannot be walked from outside their process.
IN_PROCESS = "memory://: the keys live inside each worker process"


def status_from_guard(
    guard: DistributedIdempotencyGuard, key: str, now: float | None = None
) -> IdempotencyStatus:
    """The status of ``key`` through a guard's store and lock-provider protocols
    (:class:`~celery_idempotent.core.admin.GuardAdmin`), for backends with no admin of their
    own (``memory://``, a store of your own): no TTL left, and no holder."""
    return GuardAdmin(guard).status(key, now)


def forget_from_guard(guard: DistributedIdempotencyGuard, key: str, *, force: bool) -> Forgotten:
    """:func:`forget_key` through a guard's protocols: deletes the record; a held lock is
    refused (:class:`~celery_idempotent.IdempotencyKeyHeldError`), and ``force`` cannot take
    it from its holder there (a lock provider releases only its own leases): it expires by
    itself."""
    return GuardAdmin(guard).forget(key, force=force)


def admin_for(
    cfg: IdempotencySettings,
    *,
    accept: list[str] | None = None,
    serializer: str = "json",
    task_name: str | None = None,
    store: Any = None,
    guard: DistributedIdempotencyGuard | None = None,
) -> KeyAdmin:
    """The :class:`~celery_idempotent.core.admin.KeyAdmin` of the keys ``cfg`` (a task's
    resolved settings) puts somewhere: the one place that asks which backend that is.

    ``store`` is the task's own store when the caller has it (the process's backend: its
    client or connection pool is used, and :meth:`~KeyAdmin.close` leaves it open); without
    it the admin makes a client (or an SQL backend, loading results with ``accept``) of its
    own from the settings and closes it. ``memory://`` needs ``guard`` (the process's own
    keys); without one its admin reads nothing and says why. A URL or client the settings
    cannot build raises the ``ValueError`` or ``TypeError`` that says why.
    """
    from celery_idempotent.urls import redact  # noqa: PLC0415

    prefix = cfg.idempotency_key_prefix
    if cfg.in_memory:
        return GuardAdmin(guard, where=IN_PROCESS) if guard is not None else _Unlisted()
    if cfg.in_postgres:
        from celery_idempotent.backends.sql.admin import SqlAdmin  # noqa: PLC0415

        shown = redact(cfg.backend_url)
        if store is not None:
            return SqlAdmin(store, prefix, shown)
        return SqlAdmin(_sql_backend(cfg.backend_url, accept), prefix, shown, owned=True)
    from celery_idempotent.backends.redis import client as redis_client  # noqa: PLC0415
    from celery_idempotent.settings import make_client_from  # noqa: PLC0415

    owned = False
    if isinstance(store, InspectsKeys):
        client = store.key_client()
    elif cfg.idempotency_client is not None:
        client = make_client_from(cfg.idempotency_client, task_name=task_name)
    else:
        client = redis_client.make_client(None, cfg.backend_url, "idempotency_url")
        owned = True
    if cfg.idempotency_client is not None:
        shown = redis_client.describe_client(client)
    else:
        shown = redact(cfg.backend_url)
    return RedisAdmin(client, prefix, shown, serializer=serializer, accept=accept, owned=owned)


def _sql_backend(url: str, accept: list[str] | None) -> Any:
    from celery_idempotent.backends import sql_backend_from_url  # noqa: PLC0415

    if url.startswith("django://"):
        import django  # noqa: PLC0415

        django.setup()
    return sql_backend_from_url(url, accept=accept or ["json"])


class _Unlisted(GuardAdmin):
    """``memory://`` seen from outside the worker processes: nothing to read."""

    def __init__(self) -> None:
        super().__init__(None, where=IN_PROCESS)  # type: ignore[arg-type]

    def status(self, key: str, now: float | None = None) -> IdempotencyStatus:
        raise NotImplementedError(IN_PROCESS)

    def forget_namespace(self, namespace: str, **options: Any) -> NamespaceCount:
        raise NotImplementedError(IN_PROCESS)

    def stats(self, namespace: str | None, **options: Any) -> StatsReport:
        raise NotImplementedError(IN_PROCESS)


# --------------------------------------------------------------------------- every task


@dataclass(frozen=True)
class NamespaceForgotten:
    """One key namespace of :func:`forget_all`: the tasks that share it, where its keys live
    (``where``: the URL without its password, or the client), and what was deleted (or, in a
    dry run, would be). ``records`` counts records and queued markers; ``locks`` the held
    locks deleted (with ``force``), ``kept_locks`` those kept (bodies running now; rows held by
    running bodies on PostgreSQL); ``unattributed`` shortened Redis names that may be the
    namespace's but cannot be told apart (left alone). ``skipped`` says why nothing was
    looked at (``memory://``: the keys live inside each worker process)."""

    namespace: str
    tasks: tuple[str, ...]
    where: str
    prefix: str
    records: int = 0
    locks: int = 0
    kept_locks: int = 0
    fences: int = 0
    unattributed: int = 0
    sample: tuple[str, ...] = ()
    skipped: str | None = None


@dataclass(frozen=True)
class ForgottenAll:
    """What :func:`forget_all` did (``dry_run``: would do), one entry per key namespace."""

    dry_run: bool
    namespaces: tuple[NamespaceForgotten, ...]

    @property
    def records(self) -> int:
        return sum(n.records for n in self.namespaces)

    @property
    def locks(self) -> int:
        return sum(n.locks for n in self.namespaces)

    @property
    def kept_locks(self) -> int:
        return sum(n.kept_locks for n in self.namespaces)


def idempotent_tasks(app: Any) -> list[Any]:
    """Every registered task of ``app`` that is an ``IdempotentTask`` (the app's task modules
    imported first), sorted by name."""
    app.loader.import_default_modules()
    found = [
        task
        for name, task in app.tasks.items()
        if not name.startswith("celery.") and callable(getattr(task, "idempotency_settings", None))
    ]
    return sorted(found, key=lambda task: str(task.name))


def forget_all(
    app: Any,
    *,
    force: bool = False,
    dry_run: bool = False,
    include_fences: bool = False,
    batch_size: int = 1000,
    url: str | None = None,
    prefix: str | None = None,
    progress: Callable[[str], None] | None = None,
) -> ForgottenAll:
    """Forget every key of every idempotent task of ``app``: records and queued markers, held
    locks only with ``force``, fence keys only with ``include_fences``; with ``dry_run``,
    count what would go and delete nothing. celery-singleton's ``clear_locks(app)``, and the
    CLI's ``celery -A proj idempotency forget --all``.

    Each task's keys are looked up where its own settings put them (its ``idempotency_url``
    or ``idempotency_client``, ``idempotency_key_prefix`` and ``idempotency_namespace``);
    ``url`` and ``prefix`` override those for every task. Tasks sharing a namespace on one
    backend are walked once. Every walk is ``SCAN`` in batches of ``batch_size`` (Redis) or
    one ``DELETE ... SKIP LOCKED`` (PostgreSQL: rows a running body holds are kept, as
    ``forget --task`` keeps them). ``memory://`` tasks are reported as skipped. A task whose
    settings do not resolve raises the ``ValueError`` or ``TypeError`` that says why.
    """
    from celery_idempotent.settings import resolve, result_accept  # noqa: PLC0415
    from celery_idempotent.urls import redact  # noqa: PLC0415

    groups: dict[tuple[str, str, str], list[Any]] = {}
    settings: dict[tuple[str, str, str], Any] = {}
    for task in idempotent_tasks(app):
        cfg = resolve(app, task)
        if url is not None:
            cfg = dataclasses.replace(cfg, idempotency_url=url, idempotency_client=None)
        if prefix is not None:
            cfg = dataclasses.replace(cfg, idempotency_key_prefix=prefix)
        if cfg.idempotency_client is not None:
            where = f"client {cfg.idempotency_client!r}"
        else:
            where = redact(cfg.backend_url)
        namespace = cfg.namespace_for(str(task.name))
        group = (where, cfg.idempotency_key_prefix, namespace)
        groups.setdefault(group, []).append(task)
        settings.setdefault(group, cfg)
    accept = result_accept(app.conf)
    admins: dict[tuple[str, str], KeyAdmin] = {}
    done: list[NamespaceForgotten] = []
    try:
        for group, tasks in groups.items():
            where, key_prefix, namespace = group
            names = tuple(str(task.name) for task in tasks)
            base = NamespaceForgotten(namespace, names, where, key_prefix)
            admin = admins.get((where, key_prefix))
            if admin is None:
                admin = admin_for(settings[group], accept=accept, task_name=names[0])
                admins[(where, key_prefix)] = admin
            try:
                found = admin.forget_namespace(
                    namespace,
                    force=force,
                    dry_run=dry_run,
                    include_fences=include_fences,
                    batch_size=batch_size,
                    progress=progress,
                )
            except NotImplementedError as exc:
                done.append(dataclasses.replace(base, skipped=str(exc)))
                continue
            done.append(
                dataclasses.replace(
                    base,
                    records=found.records,
                    locks=found.locks,
                    kept_locks=found.kept_locks,
                    fences=found.fences,
                    unattributed=found.unattributed,
                    sample=found.sample,
                )
            )
    finally:
        for each in admins.values():
            with contextlib.suppress(Exception):
                each.close()
    return ForgottenAll(dry_run, tuple(done))
