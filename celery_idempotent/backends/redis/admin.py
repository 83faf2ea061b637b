"""Redis's :class:`~celery_idempotent.core.admin.KeyAdmin`: :class:`RedisAdmin`.

One key is read with :func:`~celery_idempotent.backends.redis.key_info.read_key` (one
``READ_KEY`` script: record, lock and fence key, consistent, Cluster-safe) and deleted with the
``FORGET`` script (the lock compared with the token that was read); a namespace is walked with
``SCAN`` in batches (:mod:`celery_idempotent.backends.redis.scan`).
"""

from __future__ import annotations

import time
from typing import Any

from celery_idempotent.backends.redis import admin_scripts as redis_admin_scripts
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis import scan as redis_scan
from celery_idempotent.backends.redis.health import eviction_policy, eviction_warning
from celery_idempotent.backends.redis.key_info import KeyInfo, read_key
from celery_idempotent.core.admin import (
    FORCE_HINT,
    Forgotten,
    IdempotencyStatus,
    KeyReport,
    NamespaceCount,
    Progress,
    StatsReport,
    format_duration,
)
from celery_idempotent.core.exceptions import IdempotencyKeyHeldError, RecordDecodeError
from celery_idempotent.core.names import HEAD_CHARS, MAX_READABLE_KEY
from celery_idempotent.core.states import IN_PROGRESS, KeyState

__all__ = [
    "STATS_COLUMNS",
    "RedisAdmin",
    "forget_key",
    "forget_plan",
    "held_lock_reason",
    "status_of",
]

#: What ``stats`` counts per task: completed records, held locks (a body running), and queued
#: markers (published by ``apply_async``, not committed yet; a queued call whose body runs
#: counts in "in_progress" too, by its lock).
STATS_COLUMNS = ("completed", IN_PROGRESS, "queued")
_QUEUED_HEAD = keyspace.QUEUED_HEAD.encode()


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
        # A marker no delivery claimed, beside a held lock, is a call queued behind the
        # running one (idempotency_publish_until="started": the running call's claim ended
        # its own marker, and its lease's token names it).
        return IdempotencyStatus(
            key=info.key,
            state=KeyState.RUNNING,
            task_id=info.running_task_id,
            queued_task_id=info.queued_task_id if info.queued_behind else None,
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


def held_lock_reason(info: KeyInfo, force_hint: str = FORCE_HINT) -> str:
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
    client: Any, info: KeyInfo, *, force: bool, include_fences: bool = False
) -> Forgotten:
    """Delete what :func:`forget_plan` names for ``info`` (read with :func:`read_key`).

    A held lock is deleted only with ``force``, and only if it is still the lease that was
    read (compare-and-delete on its token): a lease taken since is someone else's and stays.
    ``kept`` says which were kept and why: the lock when it changed hands, a fence key the
    server clock has not passed yet.
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
    kept: list[str] = []
    marked = info.queued_task_id is not None or info.dead_marker_task_id is not None
    if (info.record is not None or marked) and gone_record:
        deleted.append(info.record_name)
    if info.lock_token is not None and gone_lock:
        deleted.append(info.lock_name)
    elif info.lock_token is not None:
        kept.append(f"{info.lock_name}: it changed hands since it was read")
    if include_fences and info.fence_value is not None and gone_fence:
        deleted.append(info.fence_name)
    elif include_fences and info.fence_value is not None:
        kept.append(f"{info.fence_name}: the server clock is behind its fencing token")
    state = KeyState.of(info.state)
    return Forgotten(key=info.key, state=state, deleted=tuple(deleted), kept=tuple(kept))


_STATE_LINES = {
    KeyState.COMPLETED: "completed",
    KeyState.RUNNING: "in progress (locked)",
    KeyState.QUEUED: "queued (published, not run yet)",
    KeyState.ABSENT: "absent",
}


def _iso(at: float | None) -> str:
    import datetime as _dt  # noqa: PLC0415

    if at is None:
        return "-"
    moment = _dt.datetime.fromtimestamp(at, tz=_dt.timezone.utc)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def _lines(info: KeyInfo, now: float) -> list[tuple[str, str]]:
    rows: list[tuple[str, str]] = [
        ("key", info.key),
        ("state", _STATE_LINES[KeyState.of(info.state)]),
    ]
    running = info.running_task_id
    if running is not None and info.queued_behind:  # idempotency_publish_until="started"
        rows.append(("running as", f"task {running}"))
    if info.queued_task_id is not None:
        label = "queued behind it" if info.queued_behind else "queued as"
        rows.append((label, f"task {info.queued_task_id}"))
        age = info.queued_age(now)
        rows.append(("queued for", "-" if age is None else format_duration(age)))
        rows.append(("marker ttl", format_duration(info.queued_ttl)))
        claimed = "yes (a delivery claimed it)" if info.queued_claimed else "no delivery yet"
        rows.append(("claimed", claimed))
    rec = info.record
    if rec is not None:
        rows += [
            ("age", f"{format_duration(info.age(now))} (committed {_iso(rec['committed_at'])})"),
            ("ttl left", format_duration(info.record_ttl)),
            ("fencing token", str(rec["fencing_token"] or "-")),
            ("fingerprint", rec["fingerprint"] or "- (stored without input)"),
            ("result", f"{rec['content_type']}, {rec['encoding']}, {rec['size']} bytes"),
        ]
    if info.lock_token is not None:
        rows += [
            ("holder", info.holder or "-"),
            ("lease left", format_duration(info.lock_ttl)),
        ]
        if rec is None:
            rows.append(("fencing token", f"{info.lease_fence or '-'} (current lease)"))
    elif rec is not None:
        rows.append(("lock", "free"))
    if rec is None and info.lock_token is None and info.fence_value is not None:
        rows.append(
            ("last fence", f"{info.fence_value} (expires in {format_duration(info.fence_ttl)})")
        )
    rows += [("record name", info.record_name), ("lock name", info.lock_name)]
    return rows


def _record_states(client: Any, records: list[tuple[str, bytes]]) -> list[str | None]:
    """Each record name's state, one pipelined ``GETRANGE`` of its head per name (a record name
    holds a completed record or a queued marker): ``"completed"``, ``"queued"``, or ``None``
    for a name gone since the SCAN. A v1 record (a hash) answers WRONGTYPE: completed."""
    if not records:
        return []
    pipe = client.pipeline(transaction=False)
    for _, raw in records:
        pipe.getrange(raw, 0, len(_QUEUED_HEAD) - 1)
    states: list[str | None] = []
    for head in pipe.execute(raise_on_error=False):
        if isinstance(head, Exception):
            states.append("completed")
        elif not head:
            states.append(None)
        else:
            states.append("queued" if bytes(head) == _QUEUED_HEAD else "completed")
    return states


class RedisAdmin:
    """The :class:`~celery_idempotent.core.admin.KeyAdmin` of the keys under ``prefix`` on
    the Redis of ``client``; ``shown_url`` says where (no password). ``serializer`` and
    ``accept`` decode a stored result for ``inspect --show-result``. ``owned``: the admin made
    the client, and :meth:`close` closes it. ``force`` deletes a held lock (``can_force``)."""

    can_force = True

    def __init__(
        self,
        client: Any,
        prefix: str,
        shown_url: str,
        *,
        serializer: str = "json",
        accept: list[str] | None = None,
        owned: bool = False,
    ) -> None:
        self.client = client
        self.prefix = prefix
        self.shown_url = shown_url
        self.serializer = serializer
        self.accept = accept
        self.owned = owned

    @property
    def where(self) -> str:
        """``prefix 'P' on URL``."""
        return f"prefix {self.prefix!r} on {self.shown_url}"

    def read(self, key: str, *, with_data: bool = False) -> KeyInfo:
        """What Redis holds for ``key`` (:func:`read_key`)."""
        return read_key(self.client, self.prefix, key, with_data=with_data)

    def status(self, key: str) -> IdempotencyStatus:
        """The key's state, read in one script."""
        return status_of(self.read(key))

    def forget(
        self, key: str, *, force: bool = False, include_fences: bool = False, dry_run: bool = False
    ) -> Forgotten:
        """Delete the key's record or marker (with ``force`` its held lock, if still the lease
        read; with ``include_fences`` its fence key, once the server clock has passed it)."""
        info = self.read(key)
        if dry_run:
            plan = forget_plan(info, force=force, include_fences=include_fences)
            return Forgotten(key=key, state=KeyState.of(info.state), would_delete=tuple(plan))
        return forget_key(self.client, info, force=force, include_fences=include_fences)

    def decode(self, info: KeyInfo) -> tuple[Any, str | None]:
        """The stored result decoded with the accept list, or the reason it was refused."""
        from celery_idempotent.backends.redis.store import RedisIdempotencyStore  # noqa: PLC0415

        try:
            store = RedisIdempotencyStore(
                self.client, serializer=self.serializer, accept=self.accept
            )
            if info.layout == keyspace.V1_VERSION:
                return store.decode_v1(info.key, info.raw).result, None
            return store.decode(info.key, info.raw).result, None
        except (RecordDecodeError, TypeError, ValueError) as exc:
            return None, str(exc)

    def inspect(self, key: str, *, show_result: bool = False) -> KeyReport:
        """The key's record, lease, fence, queued marker and names."""
        info = self.read(key, with_data=show_result)
        now = time.time()
        shown = show_result and info.record is not None
        result, error = self.decode(info) if shown else (None, None)
        doc = info.as_json(now)
        doc["prefix"] = self.prefix
        doc["url"] = self.shown_url
        if shown:
            doc["result"] = result
            doc["result_error"] = error
        return KeyReport(
            status_of(info, now),
            tuple(_lines(info, now)),
            doc,
            result=result,
            result_error=error,
            result_shown=shown,
        )

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
        """SCAN the namespace's names; delete (``dry_run``: count) its records and markers,
        its held locks with ``force`` (without, they are counted as kept), its fence keys
        with ``include_fences``."""
        if dry_run:
            found = redis_scan.count_task(
                self, namespace, batch_size, force, include_fences, progress=progress
            )
            return NamespaceCount(
                records=found.records,
                locks=found.locks if force else 0,
                kept_locks=0 if force else found.locks,
                fences=found.fences,
                unattributed=found.unattributed,
                scanned=found.scanned,
                sample=tuple(found.sample),
            )
        # Without force, a held lock is counted (reported as kept), not deleted.
        kept = 0 if force else redis_scan.count_task(self, namespace, batch_size, True).locks
        gone = redis_scan.delete_task(
            self, namespace, batch_size, force, include_fences, progress=progress
        )
        return NamespaceCount(
            records=gone.records,
            locks=gone.locks,
            kept_locks=kept,
            fences=gone.fences,
            unattributed=gone.unattributed,
            scanned=gone.scanned,
        )

    def namespace_note(self, namespace: str) -> str | None:
        """Keys longer than the readable length are stored under a shortened name; for a
        namespace that fills the kept head, some cannot be told apart from other tasks'."""
        if len(redis_scan.tagged_task(namespace)) < HEAD_CHARS:
            return None
        return (
            f"keys of {namespace} longer than {MAX_READABLE_KEY} characters are stored under a "
            f"shortened name that keeps only their first {HEAD_CHARS} characters; those that "
            "cannot be told apart from other tasks' are reported, not deleted (use --raw)"
        )

    def stats(
        self, namespace: str | None, *, batch_size: int = 1000, progress: Progress | None = None
    ) -> StatsReport:
        """Keys by state and task in one SCAN (approximate on a busy server: SCAN may return
        a key twice while Redis resizes its table), and the server's ``maxmemory-policy``."""
        per_task: dict[str, dict[str, int]] = {}
        scan = redis_scan.Scan()
        records: list[tuple[str, bytes]] = []

        def count_records() -> None:
            for (task, _), state in zip(records, _record_states(self.client, records)):
                if state is not None:
                    per_task[task][state] += 1
            records.clear()

        names = redis_scan.scan_names(self, namespace, batch_size, scan)
        for found, (kind, task, raw) in enumerate(names, 1):
            counts = per_task.setdefault(task, dict.fromkeys(STATS_COLUMNS, 0))
            if kind == "record":
                records.append((task, raw))
                if len(records) >= batch_size:
                    count_records()
            else:
                counts[IN_PROGRESS] += 1
            if progress is not None and found % (batch_size * 10) == 0:
                progress(f"counted {found} key(s)")
        count_records()
        total = {state: sum(c[state] for c in per_task.values()) for state in STATS_COLUMNS}
        tasks = dict(sorted(per_task.items()))
        policy, policy_error = eviction_policy(self.client)
        warning = eviction_warning(self.shown_url, policy, policy_error)
        notes: tuple[str, ...] = ()
        if scan.other:
            notes = (f"({scan.other} other key(s) under the prefix are not celery-idempotent's)",)
        return StatsReport(
            header=f"prefix {self.prefix!r} on {self.shown_url}, maxmemory-policy "
            f"{policy or 'unknown'}",
            columns=STATS_COLUMNS,
            tasks=tasks,
            total=total,
            document={
                "prefix": self.prefix,
                "url": self.shown_url,
                "maxmemory_policy": policy,
                "total": total,
                "tasks": tasks,
                "other": scan.other,
                "scanned": scan.scanned,
            },
            notes=notes,
            warnings=() if warning is None else (warning,),
        )

    def close(self) -> None:
        """Close the client if the admin made it."""
        if self.owned:
            self.client.close()
