"""Inspect, forget and count the keys of the MySQL / MariaDB backend's table.

The reads and deletes of the ``celery idempotency`` commands on ``mysql://`` and ``django://``
on Django's MySQL engine (:mod:`celery_idempotent.cli.postgres` prints them), as the same
JSON-ready documents as :mod:`celery_idempotent.backends.postgres.admin`:

- :func:`describe`: the key's row: ``completed`` (an unexpired record), ``in_progress`` (a
  transaction holds the row: a body runs now), ``queued`` (the publish side's marker: a call
  was published and no delivery has committed it), or ``absent``.
- :func:`forget_one`, :func:`forget_task`: delete records; a key whose row a running body
  holds is kept (its transaction will commit or roll back by itself; no force can take a row
  lock away from a live session: end that session with ``KILL <id>`` if it must go).
- :func:`stats`: completed records by task, and rows held by running bodies. A key's very
  first run inserts its row inside its own transaction, invisible until it commits: such runs
  are not counted as in progress.

Every statement that could wait for a running body's row lock skips it (``SKIP LOCKED``,
``NOWAIT``) or waits at most ``lock_timeout``.
"""

from __future__ import annotations

import time
from typing import Any

from celery_idempotent import keyspace
from celery_idempotent.backends.mysql.backend import MySQLBackend
from celery_idempotent.backends.mysql.sql import LOCK_ERRORS, error_code, quote_table
from celery_idempotent.core import names
from celery_idempotent.core.states import IN_PROGRESS

__all__ = ["describe", "forget_one", "forget_task", "row_state", "stats"]


def row_state(backend: MySQLBackend, row: str) -> tuple[list[Any] | None, bool]:
    """(the row's fields or None, whether a transaction holds it now)."""
    t = quote_table(backend.table)
    fields = (
        "state, fencing_token, fingerprint, content_type, content_encoding, LENGTH(result), "
        "created_at, TIMESTAMPDIFF(MICROSECOND, UTC_TIMESTAMP(6), expires_at) / 1e6, result"
    )
    rows = backend.autocommit([(f"SELECT {fields} FROM {t} WHERE `key` = %s", (row,))])[0]
    held = backend.is_locked(row.replace("{", "lock:{", 1))
    return (list(rows[0]) if rows else None), held


def describe(
    backend: MySQLBackend, prefix: str, nkey: str, *, show_result: bool, shown_url: str
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


def forget_one(backend: MySQLBackend, prefix: str, nkey: str, *, dry_run: bool) -> dict[str, Any]:
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
        found_free = backend.autocommit(
            [
                (f"SELECT `key` FROM {t} WHERE `key` = %s FOR UPDATE NOWAIT", (row,)),
                (f"DELETE FROM {t} WHERE `key` = %s", (row,)),
            ]
        )
    except Exception as exc:
        if error_code(exc) in LOCK_ERRORS:
            doc["state"] = IN_PROGRESS
            return doc
        raise
    doc["deleted"] += int(found_free[1])
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
    backend: MySQLBackend, prefix: str, namespace: str, *, dry_run: bool
) -> dict[str, Any]:
    """Delete every record of one task's namespace; rows held by running bodies are kept."""
    t = quote_table(backend.table)
    like = _like(prefix, namespace)
    if dry_run:
        rows = backend.autocommit(
            [
                (f"SELECT count(*) FROM {t} WHERE `key` LIKE %s", (like,)),
                (f"SELECT `key` FROM {t} WHERE `key` LIKE %s FOR UPDATE SKIP LOCKED", (like,)),
            ]
        )
        total, free = int(rows[0][0][0]), len(rows[1])
        marked = backend.forget_markers_like(like, dry_run=True)
        return {"records": free + marked, "held": total - free, "deleted": 0, "dry_run": True}
    # A DELETE cannot skip locked rows: lock the free ones first, then delete those.
    tx, rows = backend._begin(
        "",
        [
            (f"SELECT count(*) FROM {t} WHERE `key` LIKE %s", (like,)),
            (f"SELECT `key` FROM {t} WHERE `key` LIKE %s FOR UPDATE SKIP LOCKED", (like,)),
        ],
    )
    total, keys = int(rows[0][0][0]), [k for (k,) in rows[1]]
    deleted = 0
    try:
        for start in range(0, len(keys), 500):
            batch = keys[start : start + 500]
            done = backend._run(tx, backend.sql.delete_keys(batch), commit=False)
            deleted += sum(int(n) for n in done)
        backend._run(tx, [], commit=True)
    except BaseException:
        backend._rollback(tx)
        raise
    backend._finish(tx)
    deleted_all = deleted + backend.forget_markers_like(like)  # the "started" mode's queued
    return {
        "records": deleted_all,
        "held": total - deleted,
        "deleted": deleted_all,
        "dry_run": False,
    }


def stats(backend: MySQLBackend, prefix: str, namespace: str | None) -> dict[str, Any]:
    """Completed records and held rows per task (one pass over the prefix's rows)."""
    t = quote_table(backend.table)
    like = _like(prefix, namespace)
    rows = backend.autocommit(
        [
            (
                f"SELECT `key`, state = 'completed' AND expires_at > UTC_TIMESTAMP(6) "
                f"FROM {t} WHERE `key` LIKE %s",
                (like,),
            ),
            (f"SELECT `key` FROM {t} WHERE `key` LIKE %s FOR UPDATE SKIP LOCKED", (like,)),
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
