"""Inspect, forget and count the keys of an SQL backend's table: PostgreSQL's, and MySQL's /
MariaDB's (``django://`` on either engine too), one logic for both.

:class:`SqlAdmin` is the SQL backends' :class:`~celery_idempotent.core.admin.KeyAdmin`. The SQL
text is each dialect's own (``AdminStatements`` in its ``sql.py``, found beside the backend's
``Statements``); everything else is here once. A key's row is:

- ``completed``: an unexpired record; ``running`` (``in_progress`` in the JSON): a transaction
  holds the row, a body runs now; ``queued``: the publish side's marker (a call was published
  and no delivery has committed it); ``absent``.
- :func:`forget_one`, :func:`forget_task`: delete records; a key whose row a running body
  holds is kept (its transaction will commit or roll back by itself; no force can take a row
  lock away from a live session: end that session, ``pg_terminate_backend`` or ``KILL <id>``,
  if it must go).
- :func:`stats`: completed records by task, and rows held by running bodies. A key's very
  first run inserts its row inside its own transaction, invisible until it commits: such runs
  are not counted as in progress.

Every statement that could wait for a running body's row lock skips it (``SKIP LOCKED``,
``NOWAIT``) or waits at most the backend's ``lock_timeout``.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Protocol

from celery_idempotent import keyspace
from celery_idempotent.backends.sql.backend import SQLBackend
from celery_idempotent.core import names
from celery_idempotent.core.admin import (
    Forgotten,
    IdempotencyStatus,
    KeyReport,
    NamespaceCount,
    Progress,
    StatsReport,
    format_duration,
)
from celery_idempotent.core.exceptions import IdempotencyKeyHeldError
from celery_idempotent.core.states import IN_PROGRESS, KeyState

__all__ = [
    "AdminSql",
    "SqlAdmin",
    "admin_statements",
    "describe",
    "forget_one",
    "forget_task",
    "row_state",
    "stats",
]

#: Keys deleted per statement by :func:`forget_task`.
DELETE_BATCH = 500


class AdminSql(Protocol):
    """What a dialect's ``AdminStatements`` (in its ``sql.py``) gives the admin."""

    says_claimed: bool
    row: str
    count: str
    free: str
    live: str
    unheld: str

    def forget_row(self, row: str, lock_timeout: float) -> list[tuple[str, tuple[Any, ...]]]: ...

    def delete_keys(self, keys: Any) -> list[tuple[str, tuple[Any, ...]]]: ...

    def lock_refused(self, exc: BaseException) -> bool: ...


def admin_statements(backend: SQLBackend) -> AdminSql:
    """The admin SQL of ``backend``'s dialect: the ``AdminStatements`` of the module that
    holds its ``Statements`` (each dialect's ``sql.py`` has both), so that nothing below asks
    which dialect it runs on."""
    module = sys.modules[type(backend.sql).__module__]
    made: AdminSql = module.AdminStatements(backend.table)
    return made


def row_state(backend: SQLBackend, row: str) -> tuple[list[Any] | None, bool]:
    """(the row's fields or None, whether a transaction holds it now)."""
    sql = admin_statements(backend)
    rows = backend.autocommit([(sql.row, (row,))])[0]
    held = backend.is_locked(row.replace("{", "lock:{", 1))
    return (list(rows[0]) if rows else None), held


def _state(found: list[Any] | None, held: bool) -> KeyState:
    if found is not None and found[0] == "completed" and float(found[7]) > 0:
        return KeyState.COMPLETED
    if held:
        return KeyState.RUNNING
    if found is not None and found[0] == "queued" and float(found[7]) > 0:
        return KeyState.QUEUED
    return KeyState.ABSENT


def describe(
    backend: SQLBackend, prefix: str, nkey: str, *, show_result: bool, shown_url: str
) -> dict[str, Any]:
    """One key's row as a JSON-ready document: ``state`` (``completed``, ``in_progress``: a
    transaction holds the row, ``queued`` or ``absent``), ``record`` (its columns, age and
    ttl), ``queued`` (the marker's task id, ttl, age and whether a delivery claimed it, where
    the dialect says) and, with ``show_result``, the decoded ``result`` or why it could not be
    (``result_error``)."""
    sql = admin_statements(backend)
    row = names.record_name(prefix, nkey)
    found, held = row_state(backend, row)
    state = _state(found, held)
    record = found if state == KeyState.COMPLETED else None
    queued = found is not None and found[0] == "queued" and float(found[7]) > 0
    now = time.time()
    result: Any = None
    error: str | None = None
    if show_result and record is not None:
        try:
            data = bytes(record[8]) if record[8] is not None else b""
            result = backend.codec.loads(nkey, record[3], record[4], data)
        except Exception as exc:
            error = str(exc)
    doc: dict[str, Any] = {
        "key": nkey,
        "state": state.json_name,
        "row": row,
        "table": backend.table,
        "url": shown_url,
        "record": None,
        "held": held,
    }
    if queued and found is not None:  # the publish side's marker (task id in ``result``)
        doc["queued"] = {
            "task_id": bytes(found[8]).decode("utf-8", "replace") if found[8] else None,
            "ttl": float(found[7]),
            # seconds since the publish (the publisher's clock), and whether a delivery
            # claimed it before it was queued again (``requeue_marker`` types the row; a
            # dialect without that statement does not say: ``None``)
            "age": None if found[6] is None else max(0.0, now - float(found[6])),
            "claimed": (found[3] == "requeued") if sql.says_claimed else None,
        }
    _started_slots(backend, doc, row, held)
    if record is not None:
        created = float(record[6]) if record[6] is not None else None
        doc["record"] = {
            "fencing_token": record[1],
            "fingerprint": record[2],
            "content_type": record[3],
            "encoding": record[4],
            "size": record[5],
            "committed_at": created,
            "age": None if created is None or created < 1e9 else max(0.0, now - created),
            "ttl": float(record[7]),
        }
        if show_result:
            doc["result"] = result
            doc["result_error"] = error
    return doc


def _started_slots(backend: SQLBackend, doc: dict[str, Any], row: str, held: bool) -> None:
    """The marker table's slots of ``idempotency_publish_until="started"`` into ``doc``:
    the running call (``running``, while the row is held) and the one queued behind it."""
    slots = backend.started_slots(row)
    running, queued = slots.get("running"), slots.get("queued")
    if held and running is not None:
        doc["running"] = {"task_id": running[0], "age": running[1]}
    if queued is not None and doc.get("queued") is None and doc["state"] != "completed":
        doc["queued"] = {"task_id": queued[0], "ttl": queued[2], "age": queued[1], "claimed": False}
        if doc["state"] == "absent":
            doc["state"] = "queued"


def _delete_row(backend: SQLBackend, row: str) -> int | None:
    """Delete one row, unless a running body's row lock is not given up in time (``None``)."""
    sql = admin_statements(backend)
    try:
        return int(backend.autocommit(sql.forget_row(row, backend.lock_timeout))[-1])
    except Exception as exc:
        if sql.lock_refused(exc):
            return None
        raise


def forget_one(backend: SQLBackend, prefix: str, nkey: str, *, dry_run: bool) -> dict[str, Any]:
    """Delete one key's row unless a running body holds it."""
    row = names.record_name(prefix, nkey)
    found, held = row_state(backend, row)
    doc: dict[str, Any] = {"key": nkey, "row": row, "dry_run": dry_run, "deleted": 0}
    doc["state"] = IN_PROGRESS if held else "absent" if found is None else str(found[0])
    if not held and not dry_run:
        doc["deleted"] = backend.forget_markers(row)  # the "started" mode's markers
        if found is None and doc["deleted"]:
            doc["state"] = "queued"
    if held or found is None or dry_run:
        return doc
    deleted = _delete_row(backend, row)
    if deleted is None:
        doc["state"] = IN_PROGRESS
    else:
        doc["deleted"] += deleted
    return doc


def _like(prefix: str, namespace: str | None) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    if namespace is None:
        return escaped + "%"
    ns = namespace.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "{" + ns + ":%"


def forget_task(
    backend: SQLBackend, prefix: str, namespace: str, *, dry_run: bool
) -> dict[str, Any]:
    """Delete every record of one task's namespace; rows held by running bodies are kept.

    In one transaction: count the rows, lock those no transaction holds (``SKIP LOCKED``:
    never waits), delete those by key in batches, commit (a dry run rolls back instead).
    """
    sql = admin_statements(backend)
    like = _like(prefix, namespace)
    tx, rows = backend._begin("", [(sql.count, (like,)), (sql.free, (like,))])
    total, keys = int(rows[0][0][0]), [key for (key,) in rows[1]]
    deleted = 0
    try:
        if not dry_run:
            for start in range(0, len(keys), DELETE_BATCH):
                done = backend._run(
                    tx, sql.delete_keys(keys[start : start + DELETE_BATCH]), commit=False
                )
                deleted += sum(int(n) for n in done)
            backend._run(tx, [], commit=True)
    except BaseException:
        backend._rollback(tx)
        raise
    if dry_run:
        backend._rollback(tx)
        marked = backend.forget_markers_like(like, dry_run=True)  # the "started" mode's queued
        held_rows = total - len(keys)
        return {"records": len(keys) + marked, "held": held_rows, "deleted": 0, "dry_run": True}
    backend._finish(tx)
    gone = deleted + backend.forget_markers_like(like)
    return {"records": gone, "held": total - deleted, "deleted": gone, "dry_run": False}


def stats(backend: SQLBackend, prefix: str, namespace: str | None) -> dict[str, Any]:
    """Completed records and held rows per task (one pass over the prefix's rows)."""
    sql = admin_statements(backend)
    like = _like(prefix, namespace)
    rows = backend.autocommit([(sql.live, (like,)), (sql.unheld, (like,))])
    free = {key for (key,) in rows[1]}
    per_task: dict[str, dict[str, int]] = {}
    other = expired = 0
    for key, completed in rows[0]:
        parsed = names.parse_name(key, prefix)
        task = keyspace.task_of_slot(parsed[1]) if parsed is not None else None
        if task is None:
            other += 1
            continue
        counts = per_task.setdefault(task, {"completed": 0, IN_PROGRESS: 0})
        if key not in free:
            counts[IN_PROGRESS] += 1
        elif completed:
            counts["completed"] += 1
        else:
            expired += 1
    total = {
        "completed": sum(c["completed"] for c in per_task.values()),
        IN_PROGRESS: sum(c[IN_PROGRESS] for c in per_task.values()),
    }
    return {
        "table": backend.table,
        "prefix": prefix,
        "total": total,
        "tasks": dict(sorted(per_task.items())),
        "expired": expired,
        "other": other,
    }


_STATE_LINES = {
    KeyState.COMPLETED: "completed",
    KeyState.RUNNING: "in progress (a transaction holds the row)",
    KeyState.QUEUED: "queued (published, no delivery has committed it)",
    KeyState.ABSENT: "absent",
}


class SqlAdmin:
    """The :class:`~celery_idempotent.core.admin.KeyAdmin` of an SQL backend's table (any
    dialect), under ``prefix``; ``shown_url`` is the URL without its password. A held row
    is always kept (``can_force`` is false: no force takes a row lock from a live session).
    ``owned``: the admin made the backend, and :meth:`close` closes it."""

    can_force = False

    def __init__(
        self, backend: SQLBackend, prefix: str, shown_url: str, *, owned: bool = False
    ) -> None:
        self.backend = backend
        self.prefix = prefix
        self.shown_url = shown_url
        self.owned = owned

    @property
    def where(self) -> str:
        """``table T on URL``."""
        return f"table {self.backend.table} on {self.shown_url}"

    def status(self, key: str) -> IdempotencyStatus:
        """The key's state, read from its row (one read, and the row lock probed)."""
        return self._status(
            describe(self.backend, self.prefix, key, show_result=False, shown_url="")
        )

    @staticmethod
    def _status(doc: dict[str, Any]) -> IdempotencyStatus:
        state = KeyState.of(doc["state"])
        record, queued = doc["record"], doc.get("queued")
        if state == KeyState.RUNNING and record is None:
            # idempotency_publish_until="started": the running call, and the one behind it
            running = doc.get("running")
            return IdempotencyStatus(
                key=doc["key"],
                state=state,
                task_id=None if running is None else running["task_id"],
                queued_task_id=None if queued is None else queued["task_id"],
            )
        if record is not None:
            return IdempotencyStatus(
                key=doc["key"],
                state=state,
                age=record["age"],
                ttl=record["ttl"],
                fencing_token=record["fencing_token"],
                fingerprint=record["fingerprint"],
            )
        if queued is not None:
            return IdempotencyStatus(
                key=doc["key"],
                state=state,
                task_id=queued["task_id"],
                age=queued["age"],
                ttl=queued["ttl"],
                claimed=queued["claimed"],
            )
        return IdempotencyStatus(key=doc["key"], state=state)

    def forget(
        self, key: str, *, force: bool = False, include_fences: bool = False, dry_run: bool = False
    ) -> Forgotten:
        """Delete the key's row unless a running body holds it: then
        :class:`~celery_idempotent.IdempotencyKeyHeldError` (with or without ``force``).
        A row that holds no live record or marker (expired, or left by an ended claim) is
        deleted too, and the key reported ``absent``."""
        del include_fences  # a row has no fence key
        row = names.record_name(self.prefix, key)
        found, held = row_state(self.backend, row)
        state = _state(found, held)
        deleted = None if held else 0
        marked = 0
        if not held and not dry_run:
            marked = self.backend.forget_markers(row)  # the "started" mode's markers
        if found is not None and not held and not dry_run:
            deleted = _delete_row(self.backend, row)
        if deleted is None:
            raise IdempotencyKeyHeldError(
                key,
                None,
                None,
                "a running body's transaction holds the key's row"
                + (" (no force takes a row lock from a live session)" if force else ""),
            )
        if found is None:
            if marked:
                return Forgotten(key=key, state=KeyState.QUEUED, deleted=(row,))
            return Forgotten(key=key, state=state)
        if dry_run:
            return Forgotten(key=key, state=state, would_delete=(row,))
        return Forgotten(key=key, state=state, deleted=(row,) if deleted else ())

    def inspect(self, key: str, *, show_result: bool = False) -> KeyReport:
        """The key's row: its state, record columns, queued marker, row and table."""
        doc = describe(
            self.backend, self.prefix, key, show_result=show_result, shown_url=self.shown_url
        )
        status = self._status(doc)
        lines: list[tuple[str, str]] = [
            ("key", key),
            ("state", _STATE_LINES[KeyState.of(doc["state"])]),
        ]
        queued, running = doc.get("queued"), doc.get("running")
        if running is not None:  # idempotency_publish_until="started"
            lines.append(("running as", f"task {running['task_id']}"))
        if queued is not None:
            lines += [
                ("queued behind it" if running else "task id", str(queued["task_id"] or "-")),
                ("marker ttl left", format_duration(queued["ttl"])),
            ]
        rec = doc["record"]
        if rec is not None:
            lines += [
                ("age", format_duration(rec["age"])),
                ("ttl left", format_duration(rec["ttl"])),
                ("fencing token", str(rec["fencing_token"] or "-")),
                ("fingerprint", rec["fingerprint"] or "- (stored without input)"),
                ("result", f"{rec['content_type']}, {rec['encoding']}, {rec['size']} bytes"),
                ("lock", "held by a running transaction" if doc["held"] else "free"),
            ]
        lines += [("row", doc["row"]), ("table", self.backend.table)]
        shown = show_result and rec is not None
        return KeyReport(
            status,
            tuple(lines),
            doc,
            result=doc.get("result"),
            result_error=doc.get("result_error"),
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
        """Every record of ``namespace``; rows held by running bodies are kept (``force``
        cannot take them)."""
        doc = forget_task(self.backend, self.prefix, namespace, dry_run=dry_run)
        return NamespaceCount(records=int(doc["records"]), kept_locks=int(doc["held"]))

    def namespace_note(self, namespace: str) -> str | None:
        """Nothing to say: every row of a namespace is found by its key."""
        return None

    def stats(
        self, namespace: str | None, *, batch_size: int = 1000, progress: Progress | None = None
    ) -> StatsReport:
        """Completed records and held rows per task."""
        doc = stats(self.backend, self.prefix, namespace)
        notes = (f"({doc['expired']} expired row(s) await the sweep)",) if doc["expired"] else ()
        return StatsReport(
            header=f"table {doc['table']} (prefix {self.prefix!r}) on {self.shown_url}",
            columns=("completed", IN_PROGRESS),
            tasks=doc["tasks"],
            total=doc["total"],
            document={**doc, "url": self.shown_url},
            notes=notes,
        )

    def close(self) -> None:
        """Close the backend if the admin made it."""
        if self.owned:
            close = getattr(self.backend, "close", None)
            if callable(close):
                close()
