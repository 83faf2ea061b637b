"""Inspect, forget and count the keys of the PostgreSQL backend's table.

The reads and deletes of the ``celery idempotency`` commands on ``postgresql://`` and
``django://`` (:mod:`celery_idempotent.cli.postgres` prints them), as JSON-ready documents:

- :func:`describe`: the key's row: ``completed`` (an unexpired record), ``in_progress`` (a
  transaction holds the row: a body runs now), ``queued`` (the publish side's marker: a call
  was published and no delivery has committed it), or ``absent``.
- :func:`forget_one`, :func:`forget_task`: delete records; a key whose row a running body
  holds is kept (its transaction will commit or roll back by itself; no force can take a row
  lock away from a live session: end that session with ``pg_terminate_backend`` if it must
  go).
- :func:`stats`: completed records by task, and rows held by running bodies. A key's very
  first run inserts its row inside its own transaction, invisible until it commits: such runs
  are not counted as in progress.

Every statement that could wait for a running body's row lock waits at most ``lock_timeout``.
"""

from __future__ import annotations

import time
from typing import Any

from celery_idempotent import keyspace
from celery_idempotent.backends.postgres.backend import PostgresBackend
from celery_idempotent.backends.postgres.sql import quote_table
from celery_idempotent.core import names
from celery_idempotent.core.states import IN_PROGRESS

__all__ = ["describe", "forget_one", "forget_task", "row_state", "stats"]


def row_state(backend: PostgresBackend, row: str) -> tuple[list[Any] | None, bool]:
    """(the row's fields or None, whether a transaction holds it now)."""
    t = quote_table(backend.table)
    fields = (
        "state, fencing_token, fingerprint, content_type, content_encoding, octet_length(result), "
        "created_at, extract(epoch FROM expires_at - statement_timestamp()), result"
    )
    rows = backend.autocommit([(f"SELECT {fields} FROM {t} WHERE key = %s", (row,))])[0]
    held = backend.is_locked(row.replace("{", "lock:{", 1))
    return (list(rows[0]) if rows else None), held


def describe(
    backend: PostgresBackend, prefix: str, nkey: str, *, show_result: bool, shown_url: str
) -> dict[str, Any]:
    """One key's row as a JSON-ready document: ``state`` (``completed``, ``in_progress``: a
    transaction holds the row, or ``absent``), ``record`` (its columns, age and ttl) and, with
    ``show_result``, the decoded ``result`` or why it could not be (``result_error``)."""
    row = names.record_name(prefix, nkey)
    found, held = row_state(backend, row)
    record = None
    if found is not None and found[0] == "completed" and float(found[7]) > 0:
        record = found
    queued = found is not None and found[0] == "queued" and float(found[7]) > 0
    if record is not None:
        state = "completed"
    elif held:
        state = IN_PROGRESS
    else:
        state = "queued" if queued else "absent"
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
        "state": state,
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
            # subclass without that statement, MySQL, does not say: ``None``)
            "age": None if found[6] is None else max(0.0, now - float(found[6])),
            "claimed": (found[3] == "requeued") if hasattr(backend.sql, "queued_info") else None,
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


def _lock_timeout(backend: PostgresBackend) -> tuple[str, tuple[str]]:
    return backend.sql.lock_timeout, (f"{max(1, round(backend.lock_timeout * 1000))}ms",)


def forget_one(
    backend: PostgresBackend, prefix: str, nkey: str, *, dry_run: bool
) -> dict[str, Any]:
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
    t = quote_table(backend.table)
    try:
        deleted = backend.autocommit(
            [_lock_timeout(backend), (f"DELETE FROM {t} WHERE key = %s", (row,))]
        )[1]
    except Exception as exc:
        if "lock timeout" in str(exc):
            doc["state"] = IN_PROGRESS
            return doc
        raise
    doc["deleted"] += int(deleted)
    return doc


def _started_slots(backend: Any, doc: dict[str, Any], row: str, held: bool) -> None:
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


def _like(prefix: str, namespace: str | None) -> str:
    escaped = prefix.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    if namespace is None:
        return escaped + "%"
    ns = namespace.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped + "{" + ns + ":%"


def forget_task(
    backend: PostgresBackend, prefix: str, namespace: str, *, dry_run: bool
) -> dict[str, Any]:
    """Delete every record of one task's namespace; rows held by running bodies are kept."""
    t = quote_table(backend.table)
    like = _like(prefix, namespace)
    if dry_run:
        rows = backend.autocommit(
            [
                (f"SELECT count(*) FROM {t} WHERE key LIKE %s", (like,)),
                (
                    f"SELECT count(*) FROM (SELECT 1 FROM {t} WHERE key LIKE %s "
                    "FOR UPDATE SKIP LOCKED) free",
                    (like,),
                ),
            ]
        )
        total, free = int(rows[0][0][0]), int(rows[1][0][0])
        marked = backend.forget_markers_like(like, dry_run=True)
        return {"records": free + marked, "held": total - free, "deleted": 0, "dry_run": True}
    rows = backend.autocommit(
        [
            (f"SELECT count(*) FROM {t} WHERE key LIKE %s", (like,)),
            (
                f"DELETE FROM {t} WHERE ctid = ANY(ARRAY(SELECT ctid FROM {t} WHERE key LIKE %s "
                "FOR UPDATE SKIP LOCKED))",
                (like,),
            ),
        ]
    )
    total, deleted = int(rows[0][0][0]), int(rows[1])
    deleted_all = deleted + backend.forget_markers_like(like)  # the "started" mode's queued
    return {
        "records": deleted_all,
        "held": total - deleted,
        "deleted": deleted_all,
        "dry_run": False,
    }


def stats(backend: PostgresBackend, prefix: str, namespace: str | None) -> dict[str, Any]:
    """Completed records and held rows per task (one pass over the prefix's rows)."""
    t = quote_table(backend.table)
    like = _like(prefix, namespace)
    rows = backend.autocommit(
        [
            (
                f"SELECT key, state = 'completed' AND expires_at > statement_timestamp() "
                f"FROM {t} WHERE key LIKE %s",
                (like,),
            ),
            (f"SELECT key FROM {t} WHERE key LIKE %s FOR SHARE SKIP LOCKED", (like,)),
        ]
    )
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
