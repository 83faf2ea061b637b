"""The admin facade every backend implements: :class:`KeyAdmin`, and the shapes it answers in.

One key's state is an :class:`IdempotencyStatus` (whatever the backend), what a forget did a
:class:`Forgotten`, what a walk of one key namespace found or deleted a
:class:`NamespaceCount`; ``inspect``'s and ``stats``' fuller views are a :class:`KeyReport` and
a :class:`StatsReport`. The Python API (``Task.idempotency_status``, ``admin.forget_all``) and
the ``celery idempotency`` commands go through a :class:`KeyAdmin` and never ask which backend
it is: Redis (``backends.redis.admin``), the SQL backends (``backends.sql.admin``, one
logic for PostgreSQL and MySQL) and any guard's protocols (:class:`GuardAdmin`: ``memory://``,
a store of your own) each implement it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from celery_idempotent.core.exceptions import IdempotencyKeyHeldError
from celery_idempotent.core.states import KeyState

if TYPE_CHECKING:
    from celery_idempotent.core.guard import DistributedIdempotencyGuard

__all__ = [
    "FORCE_HINT",
    "Forgotten",
    "GuardAdmin",
    "IdempotencyStatus",
    "KeyAdmin",
    "KeyReport",
    "NamespaceCount",
    "Progress",
    "StatsReport",
    "format_duration",
]

#: A progress line's sink (the CLI's stderr), or ``None``: silent.
Progress = Callable[[str], None]
#: How a refusal of a held lock says to force it, from Python (the CLI says ``--force``).
FORCE_HINT = "pass force=True"


@dataclass(frozen=True)
class IdempotencyStatus:
    """What the store holds for one idempotency key, read in one round trip.

    ``state`` is a :class:`~celery_idempotent.KeyState` (a ``str``), one of
    ``celery_idempotent.admin.STATES``. ``task_id`` is the task id of the delivery that
    committed (or queued) the key, where the store keeps it (``None`` otherwise). ``age`` is
    seconds since the commit, by the committing worker's clock; ``ttl`` the seconds left of the
    record (completed), of the lease (running) or of the marker (queued). ``fencing_token`` is
    the record's, or the running lease's; ``fingerprint`` the one stored with the result
    (``None``: stored without one). ``holder`` is the owner id of a running lease.

    For a queued key, ``age`` is seconds since the call was published (by the server's clock,
    where the marker says) and ``claimed`` whether a delivery ever claimed it (``False``: no
    worker has received the message yet, or the broker lost it); ``None`` otherwise. A marker
    whose delivery ended without a commit stands for nothing: the key reads ``absent``.

    ``queued_task_id``: with ``idempotency_publish_until="started"``, a running key may have
    one more call queued behind the running one: its task id (``task_id`` is then the running
    call's, where the backend knows it); ``None`` otherwise.
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
    queued_task_id: str | None = None


@dataclass(frozen=True)
class Forgotten:
    """What a forget (``Task.idempotency_forget``, ``forget KEY``) did: ``state`` is the key's
    state before, ``deleted`` the names (Redis names, rows or store keys) it deleted.

    ``kept`` says what was read and kept, and why (a lock that changed hands since it was
    read, a fence key still ahead of the server clock); ``would_delete`` what a dry run would
    delete. A running body's key without ``force`` is not a ``Forgotten`` but an
    :class:`~celery_idempotent.IdempotencyKeyHeldError`.
    """

    key: str
    state: str
    deleted: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    would_delete: tuple[str, ...] = ()


@dataclass(frozen=True)
class NamespaceCount:
    """What a walk of one key namespace found (a dry run) or deleted: ``records`` counts
    records and queued markers, ``locks`` the held locks deleted (with ``force``) or found,
    ``kept_locks`` those kept (bodies running now), ``fences`` the fence keys,
    ``unattributed`` shortened names that may be the namespace's but cannot be told apart
    (left alone), ``scanned`` the names looked at, ``sample`` some of the names."""

    records: int = 0
    locks: int = 0
    kept_locks: int = 0
    fences: int = 0
    unattributed: int = 0
    scanned: int = 0
    sample: tuple[str, ...] = ()


@dataclass(frozen=True)
class KeyReport:
    """``inspect``'s view of one key: its :class:`IdempotencyStatus`, and what the backend
    shows of it beside that, as ``lines`` (``(label, value)`` rows for people) and
    ``document`` (the JSON document for scripts; its fields are the backend's, kept stable
    for the scripts that read them). ``result`` and ``result_error`` are the decoded result
    or why it was not decoded, when it was asked for and there is one (``result_shown``)."""

    status: IdempotencyStatus
    lines: tuple[tuple[str, str], ...]
    document: Mapping[str, Any]
    result: Any = None
    result_error: str | None = None
    result_shown: bool = False


@dataclass(frozen=True)
class StatsReport:
    """``stats``' count of a prefix's keys: ``header`` (where, for people), ``columns`` (the
    states counted, as JSON spells them), ``tasks`` (per task, a count per column), ``total``,
    ``notes`` (lines after the table), ``warnings`` (for stderr) and ``document`` (the JSON
    document for scripts; the backend's fields)."""

    header: str
    columns: tuple[str, ...]
    tasks: Mapping[str, Mapping[str, int]]
    total: Mapping[str, int]
    document: Mapping[str, Any]
    notes: tuple[str, ...] = ()
    warnings: tuple[str, ...] = field(default=())


class KeyAdmin(Protocol):
    """Reads and deletes the keys of one backend, under one key prefix.

    ``where`` says where the keys are (for messages: no password). ``can_force``: whether
    ``force`` can take a held lock from its holder (Redis: yes; a row lock of a live SQL
    session, or another process's in-memory lease: no, a held key is always kept).
    """

    @property
    def where(self) -> str: ...

    @property
    def can_force(self) -> bool: ...

    def status(self, key: str) -> IdempotencyStatus:
        """The key's state (``key`` namespaced: ``<task>:key:payment-42``)."""
        ...

    def forget(
        self, key: str, *, force: bool = False, include_fences: bool = False, dry_run: bool = False
    ) -> Forgotten:
        """Delete the key's record or queued marker (with ``force`` a held lock, where
        :attr:`can_force`; with ``include_fences`` its fence key). A held key without
        ``force`` raises :class:`~celery_idempotent.IdempotencyKeyHeldError`."""
        ...

    def inspect(self, key: str, *, show_result: bool = False) -> KeyReport:
        """The key's fuller view; ``show_result`` decodes the stored result too (with the
        app's accept list)."""
        ...

    def forget_namespace(
        self,
        namespace: str,
        *,
        force: bool = False,
        include_fences: bool = False,
        dry_run: bool = False,
        batch_size: int = 1000,
        progress: Progress | None = None,
    ) -> NamespaceCount:
        """Delete (``dry_run``: count) every key of one namespace; held ones are kept
        unless ``force`` (where :attr:`can_force`)."""
        ...

    def namespace_note(self, namespace: str) -> str | None:
        """What a walk of ``namespace`` cannot reach, said before it starts (``None``: all)."""
        ...

    def stats(
        self, namespace: str | None, *, batch_size: int = 1000, progress: Progress | None = None
    ) -> StatsReport:
        """Count the keys by state and task (``namespace``: one task's only)."""
        ...

    def close(self) -> None:
        """Give back what the admin opened (a client or backend it made itself)."""
        ...


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


class GuardAdmin:
    """:class:`KeyAdmin` through a guard's store and lock-provider protocols, for backends
    with no admin of their own (``memory://``, a store of your own): no TTL left and no
    holder, and a held lock is never forced (a lock provider releases only its own leases).
    It can read one key; walking a namespace needs the backend's own admin."""

    can_force = False

    def __init__(self, guard: DistributedIdempotencyGuard, where: str = "the guard's store"):
        self.guard = guard
        self.where = where

    def status(self, key: str, now: float | None = None) -> IdempotencyStatus:
        """The key's state, read through the store's and lock provider's protocols."""
        guard = self.guard
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
        # A store with the publish side's marker may say who queued the key, with its age
        # and whether a delivery claimed it (queued_marker_info), or only who (queued_marker).
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
        # idempotency_publish_until="started" (the SQL backends' marker table): the running
        # call's slot, and the one call queued behind it.
        slots_of = getattr(guard.store, "started_slots", None)
        slots = slots_of(guard.record_key(key)) if callable(slots_of) else {}
        queued_slot = slots.get("queued")
        is_locked = getattr(guard.lock_provider, "is_locked", None)
        if callable(is_locked) and is_locked(guard.lock_resource(key)):
            running = slots.get("running")
            return IdempotencyStatus(
                key=key,
                state=KeyState.RUNNING,
                task_id=running[0] if running is not None else task_id,
                queued_task_id=None if queued_slot is None else queued_slot[0],
            )
        if marker is None and queued_slot is not None:
            return IdempotencyStatus(
                key=key,
                state=KeyState.QUEUED,
                task_id=queued_slot[0],
                ttl=queued_slot[2],
                age=queued_slot[1],
                claimed=False,
            )
        if marker is not None:
            return IdempotencyStatus(
                key=key, state=KeyState.QUEUED, task_id=task_id, ttl=ttl, age=age, claimed=claimed
            )
        return IdempotencyStatus(key=key, state=KeyState.ABSENT)

    def forget(
        self, key: str, *, force: bool = False, include_fences: bool = False, dry_run: bool = False
    ) -> Forgotten:
        """Delete the record (or the queued marker); a held lock is refused
        (:class:`IdempotencyKeyHeldError`), with or without ``force``: it expires by itself."""
        del include_fences  # no fence keys behind the protocols
        guard = self.guard
        status = self.status(key)
        if status.state == KeyState.RUNNING:
            raise IdempotencyKeyHeldError(
                key,
                None,
                None,
                "the key's lock is held: a delivery is running its body now"
                + (" (this backend cannot delete a lease it does not hold)" if force else ""),
            )
        name = guard.record_key(key)
        if status.state == KeyState.ABSENT:
            return Forgotten(key=key, state=status.state)
        if dry_run:
            return Forgotten(key=key, state=status.state, would_delete=(name,))
        if status.state == KeyState.QUEUED and status.task_id is not None:
            dropped = guard.store.drop_queued(name, status.task_id)  # type: ignore[attr-defined]
            return Forgotten(key=key, state=KeyState.QUEUED, deleted=(name,) if dropped else ())
        guard.store.delete(name)
        return Forgotten(key=key, state=KeyState.COMPLETED, deleted=(name,))

    def inspect(self, key: str, *, show_result: bool = False) -> KeyReport:
        """The status as a report (the protocols show nothing more of a key)."""
        status = self.status(key)
        lines = [("key", key), ("state", str(status.state))]
        if status.fencing_token is not None:
            lines.append(("fencing token", str(status.fencing_token)))
        document = {"key": key, "state": KeyState.of(status.state).json_name}
        return KeyReport(status, tuple(lines), document)

    def forget_namespace(
        self,
        namespace: str,
        *,
        force: bool = False,
        include_fences: bool = False,
        dry_run: bool = False,
        batch_size: int = 1000,
        progress: Progress | None = None,
    ) -> NamespaceCount:
        """Not possible through the protocols (they name no keys): a ``NotImplementedError``."""
        raise NotImplementedError(
            f"{self.where}: a store reached only through its protocols cannot list its keys"
        )

    def namespace_note(self, namespace: str) -> str | None:
        """Nothing to say: a walk is not possible here at all."""
        return None

    def stats(
        self, namespace: str | None, *, batch_size: int = 1000, progress: Progress | None = None
    ) -> StatsReport:
        """Not possible through the protocols (they name no keys): a ``NotImplementedError``."""
        raise NotImplementedError(
            f"{self.where}: a store reached only through its protocols cannot count its keys"
        )

    def close(self) -> None:
        """Nothing to give back: the guard is its task's."""
