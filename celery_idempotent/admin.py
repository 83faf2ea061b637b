"""Inspect and forget idempotency keys: the one admin layer of the CLI and the Python API.

From Python, on any :class:`~celery_idempotent.IdempotentTask` (shaped like ``apply_async``, so
that no parameter name of the task can collide)::

    charge.idempotency_status((42, 999))              # the key a call with these arguments uses
    charge.idempotency_status(args=(42, 999), kwargs={"currency": "EUR"})
    charge.idempotency_status(key="payment-42")       # an explicit key (the per-call header)
    report.idempotency_status(task_id="3f2a...")      # a task keyed by task id
    charge.idempotency_forget((42, 999))              # its next delivery runs the body again

From the shell, ``celery -A proj idempotency inspect | forget`` (:mod:`celery_idempotent.cli`)
reads and deletes through the same functions: :func:`read_key`, :func:`status_of`,
:func:`forget_plan` and :func:`forget_key`. Neither builds a Redis name itself.

States: ``"completed"`` (a record: the result is replayed), ``"running"`` (no record, the lock
is held: a delivery runs the body now), ``"queued"`` (the publish side's marker: a call was
published and its body has not started; its task id is reported) and ``"absent"``.
Records keep the committing delivery's task id where the layout has room and the writer
filled it (layout v2 has the field; ``None`` otherwise).
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery_idempotent.backends.redis import admin_scripts as redis_admin_scripts
from celery_idempotent.backends.redis import client as redis_client
from celery_idempotent.backends.redis import scan as redis_scan
from celery_idempotent.backends.redis.key_info import KeyInfo, read_key
from celery_idempotent.core.exceptions import IdempotencyKeyHeldError
from celery_idempotent.core.states import KeyState

if TYPE_CHECKING:
    import redis

    from celery_idempotent.core.guard import DistributedIdempotencyGuard

__all__ = [
    "STATES",
    "Forgotten",
    "ForgottenAll",
    "IdempotencyStatus",
    "KeyInfo",
    "NamespaceForgotten",
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


@dataclass(frozen=True)
class IdempotencyStatus:
    """What the store holds for one idempotency key, read in one round trip.

    ``state`` is a :class:`~celery_idempotent.KeyState` (a ``str``), one of :data:`STATES`.
    ``task_id`` is the task id of the delivery that committed (or queued) the key, where the
    store keeps it (``None`` otherwise). ``age`` is seconds since the commit, by the committing
    worker's clock; ``ttl`` the seconds left of the record (completed), of the lease (running)
    or of the marker (queued). ``fencing_token`` is the record's, or the running lease's;
    ``fingerprint`` the one stored with the result (``None``: stored without one). ``holder`` is
    the owner id of a running lease.

    For a queued key, ``age`` is seconds since the call was published (by the server's clock,
    where the marker says) and ``claimed`` whether a delivery ever claimed it (``False``: no
    worker has received the message yet, or the broker lost it); ``None`` otherwise. A marker
    whose delivery ended without a commit stands for nothing: the key reads ``absent``.
    """

    key: str
    state: str
    task_id: str | None = None
    age: float | None = None
    ttl: float | None = None
    fencing_token: int | None = None
    fingerprint: str | None = None
    holder: str | None = None
    claimed: bool | None = None


@dataclass(frozen=True)
class Forgotten:
    """What :func:`forget_key` (or ``Task.idempotency_forget``) did: ``state`` is the key's
    state before, ``deleted`` the Redis names (or store keys) it deleted."""

    key: str
    state: str
    deleted: tuple[str, ...] = ()


# --------------------------------------------------------------------------- formatting


def format_duration(seconds: float | None) -> str:
    """``850ms``, ``12.3s``, ``4m05s``, ``23h59m``, ``2d03h``; ``-`` for ``None``."""
    if seconds is None:
        return "-"
    if seconds < 1:
        return f"{seconds * 1000:.0f}ms"
    if seconds < 60:
        return f"{seconds:.1f}s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes}m{secs:02d}s"
    hours, minutes = divmod(minutes, 60)
    if hours < 24:
        return f"{hours}h{minutes:02d}m"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h"


def status_of(info: KeyInfo, now: float | None = None) -> IdempotencyStatus:
    """The :class:`IdempotencyStatus` of what :func:`read_key` read."""
    now = time.time() if now is None else now
    record = info.record
    if record is not None:
        return IdempotencyStatus(
            key=info.key,
            state=KeyState.COMPLETED,
            task_id=record.get("task_id"),
            age=info.age(now),
            ttl=info.record_ttl,
            fencing_token=record["fencing_token"],
            fingerprint=record["fingerprint"],
            holder=info.holder,
        )
    if info.lock_token is not None:
        return IdempotencyStatus(
            key=info.key,
            state=KeyState.RUNNING,
            task_id=info.queued_task_id,
            ttl=info.lock_ttl,
            fencing_token=info.lease_fence,
            holder=info.holder,
        )
    if info.queued_task_id is not None:
        return IdempotencyStatus(
            key=info.key,
            state=KeyState.QUEUED,
            task_id=info.queued_task_id,
            age=info.queued_age(now),
            ttl=info.queued_ttl,
            claimed=info.queued_claimed,
        )
    return IdempotencyStatus(key=info.key, state=KeyState.ABSENT)


# --------------------------------------------------------------------------- forgetting


def held_lock_reason(info: KeyInfo, force_hint: str = "pass force=True") -> str:
    """Why a held lock is not deleted without ``force`` (``force_hint``: how to force it)."""
    return (
        f"the lock {info.lock_name} is held by {info.holder} (lease left "
        f"{format_duration(info.lock_ttl)}): a delivery is running the body now, and deleting "
        "its lock lets a duplicate run the body at the same time (the holder's result would "
        f"then not be stored: LockLostError). Wait for it to finish, or {force_hint} if the "
        "holder is known to be dead (its lease expires by itself)."
    )


def forget_plan(info: KeyInfo, *, force: bool, include_fences: bool = False) -> list[str]:
    """The Redis names :func:`forget_key` deletes for ``info``; raises
    :class:`IdempotencyKeyHeldError` for a held lock without ``force``."""
    plan: list[str] = []
    if info.record is not None or info.queued_task_id is not None or info.dead_marker_task_id:
        plan.append(info.record_name)
    if info.lock_token is not None:
        if not force:
            raise IdempotencyKeyHeldError(
                info.key, info.holder, info.lock_ttl, held_lock_reason(info)
            )
        plan.append(info.lock_name)
    if include_fences and info.fence_value is not None:
        plan.append(info.fence_name)
    return plan


def forget_key(
    client: redis.Redis, info: KeyInfo, *, force: bool, include_fences: bool = False
) -> Forgotten:
    """Delete what :func:`forget_plan` names for ``info`` (read with :func:`read_key`).

    A held lock is deleted only with ``force``, and only if it is still the lease that was
    read (compare-and-delete on its token): a lease taken since is someone else's and stays.
    """
    forget_plan(info, force=force, include_fences=include_fences)
    # One script: the lock is compared with the token that was read; a fence key goes only
    # once the server clock has passed it (a token ahead of the clock is kept in it).
    forget_script = client.register_script(redis_admin_scripts.FORGET)
    gone_record, gone_lock, gone_fence = forget_script(
        keys=[info.lock_name, info.record_name, info.fence_name],
        args=[
            info.lock_token or "",
            "1" if info.lock_token is not None else "0",
            "1" if include_fences else "0",
        ],
    )
    deleted: list[str] = []
    marked = info.queued_task_id is not None or info.dead_marker_task_id is not None
    if (info.record is not None or marked) and gone_record:
        deleted.append(info.record_name)
    if info.lock_token is not None and gone_lock:
        deleted.append(info.lock_name)
    if include_fences and info.fence_value is not None and gone_fence:
        deleted.append(info.fence_name)
    state = KeyState.of(info.state)
    return Forgotten(key=info.key, state=state, deleted=tuple(deleted))


# --------------------------------------------------------------------------- other backends


def status_from_guard(
    guard: DistributedIdempotencyGuard, key: str, now: float | None = None
) -> IdempotencyStatus:
    """The status of ``key`` through a guard's store and lock-provider protocols, for
    backends this module cannot read directly (``memory://``, a store of your own): no TTL
    left, and no holder."""
    now = time.time() if now is None else now
    record = guard.store.get(guard.record_key(key))
    if record is not None:
        at = record.created_at
        return IdempotencyStatus(
            key=key,
            state=KeyState.COMPLETED,
            age=max(0.0, now - at) if at >= 1e9 else None,
            fencing_token=record.fencing_token,
            fingerprint=record.fingerprint,
        )
    # A store with the publish side's marker (PostgreSQL) may say who queued the key.
    # With its age and whether a delivery claimed it, where the store says (PostgreSQL).
    info_of = getattr(guard.store, "queued_marker_info", None)
    info = info_of(guard.record_key(key)) if callable(info_of) else None
    if info is not None:
        task_id, ttl, age, claimed = info
        marker: tuple[str, float] | None = (task_id, ttl)
    else:
        queued_of = getattr(guard.store, "queued_marker", None)
        marker = queued_of(guard.record_key(key)) if callable(queued_of) else None
        age, claimed = None, None
    task_id, ttl = marker if marker is not None else (None, None)
    is_locked = getattr(guard.lock_provider, "is_locked", None)
    if callable(is_locked) and is_locked(guard.lock_resource(key)):
        return IdempotencyStatus(key=key, state=KeyState.RUNNING, task_id=task_id)
    if marker is not None:
        return IdempotencyStatus(
            key=key, state=KeyState.QUEUED, task_id=task_id, ttl=ttl, age=age, claimed=claimed
        )
    return IdempotencyStatus(key=key, state=KeyState.ABSENT)


def forget_from_guard(guard: DistributedIdempotencyGuard, key: str, *, force: bool) -> Forgotten:
    """:func:`forget_key` through a guard's protocols: deletes the record; a held lock is
    refused (:class:`IdempotencyKeyHeldError`), and ``force`` cannot take it from its holder
    there (a lock provider releases only its own leases): it expires by itself."""
    status = status_from_guard(guard, key)
    if status.state == KeyState.RUNNING:
        raise IdempotencyKeyHeldError(
            key,
            None,
            None,
            "the key's lock is held: a delivery is running its body now"
            + (" (this backend cannot delete a lease it does not hold)" if force else ""),
        )
    name = guard.record_key(key)
    if status.state == KeyState.QUEUED and status.task_id is not None:
        dropped = guard.store.drop_queued(name, status.task_id)  # type: ignore[attr-defined]
        return Forgotten(key=key, state=KeyState.QUEUED, deleted=(name,) if dropped else ())
    if status.state != KeyState.COMPLETED:
        return Forgotten(key=key, state=status.state)
    guard.store.delete(name)
    return Forgotten(key=key, state=KeyState.COMPLETED, deleted=(name,))


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
    from celery_idempotent.settings import make_client_from, resolve  # noqa: PLC0415
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
    clients: dict[str, Any] = {}
    owned: list[Any] = []  # clients made here from a URL (a configured client is the user's)
    done: list[NamespaceForgotten] = []
    try:
        for group, tasks in groups.items():
            where, key_prefix, namespace = group
            cfg = settings[group]
            names = tuple(str(task.name) for task in tasks)
            base = NamespaceForgotten(namespace, names, where, key_prefix)
            if cfg.in_memory:
                done.append(
                    dataclasses.replace(
                        base, skipped="memory://: the keys live inside each worker process"
                    )
                )
                continue
            if cfg.in_postgres:
                done.append(_forget_sql(app, cfg, base, dry_run=dry_run))
                continue
            client = clients.get(where)
            if client is None:
                if cfg.idempotency_client is not None:
                    client = make_client_from(cfg.idempotency_client, task_name=names[0])
                else:
                    client = redis_client.make_client(None, cfg.backend_url, "idempotency_url")
                    owned.append(client)
                clients[where] = client
            done.append(
                _forget_redis(
                    _Space(client, key_prefix),
                    base,
                    force=force,
                    dry_run=dry_run,
                    include_fences=include_fences,
                    batch_size=batch_size,
                    progress=progress,
                )
            )
    finally:
        for each in owned:
            with contextlib.suppress(Exception):
                each.close()
    return ForgottenAll(dry_run, tuple(done))


@dataclass(frozen=True)
class _Space:
    client: Any
    prefix: str


def _forget_redis(
    space: _Space,
    base: NamespaceForgotten,
    *,
    force: bool,
    dry_run: bool,
    include_fences: bool,
    batch_size: int,
    progress: Callable[[str], None] | None,
) -> NamespaceForgotten:
    if dry_run:
        found = redis_scan.count_task(
            space, base.namespace, batch_size, force, include_fences, progress=progress
        )
        return dataclasses.replace(
            base,
            records=found.records,
            locks=found.locks if force else 0,
            kept_locks=0 if force else found.locks,
            fences=found.fences,
            unattributed=found.unattributed,
            sample=tuple(found.sample),
        )
    # Without force, a held lock is counted (reported as kept), not deleted.
    kept = 0 if force else redis_scan.count_task(space, base.namespace, batch_size, True).locks
    gone = redis_scan.delete_task(
        space, base.namespace, batch_size, force, include_fences, progress=progress
    )
    return dataclasses.replace(
        base,
        records=gone.records,
        locks=gone.locks,
        kept_locks=kept,
        fences=gone.fences,
        unattributed=gone.unattributed,
    )


def _forget_sql(
    app: Any, cfg: Any, base: NamespaceForgotten, *, dry_run: bool
) -> NamespaceForgotten:
    from celery_idempotent.backends import sql_backend_from_url  # noqa: PLC0415
    from celery_idempotent.settings import result_accept  # noqa: PLC0415

    url: str = cfg.backend_url
    if url.startswith("django://"):
        import django  # noqa: PLC0415

        django.setup()
    conf = app.conf
    accept = result_accept(conf)
    backend: Any = sql_backend_from_url(url, accept=accept)
    sql_admin: Any
    if getattr(backend, "dialect", "postgresql") == "mysql":  # MySQL / MariaDB
        from celery_idempotent.backends.mysql import admin as mysql_admin  # noqa: PLC0415

        sql_admin = mysql_admin
    else:
        from celery_idempotent.backends.postgres import admin as pg_admin  # noqa: PLC0415

        sql_admin = pg_admin
    try:
        doc = sql_admin.forget_task(backend, base.prefix, base.namespace, dry_run=dry_run)
    finally:
        close = getattr(backend, "close", None)
        if callable(close):
            close()
    return dataclasses.replace(base, records=int(doc["records"]), kept_locks=int(doc["held"]))
