"""``celery -A proj idempotency stats``: keys by state and by task (one SCAN)."""

from __future__ import annotations

from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_idempotent.backends.redis import keyspace
from celery_idempotent.backends.redis.health import eviction_policy, eviction_warning
from celery_idempotent.cli.common import connect, emit_json, print_table, progress, redis_errors
from celery_idempotent.cli.options import any_task_option, batch_size_option, common_options
from celery_idempotent.cli.scan import Scan, scan_names
from celery_idempotent.core.states import IN_PROGRESS

__all__ = ["stats"]


@click.command(cls=CeleryCommand)
@click.option("--task", "task_name", metavar="NAME", help="Count only this task's keys.")
@any_task_option
@batch_size_option("SCAN COUNT.")
@common_options
@click.pass_context
@redis_errors
def stats(
    ctx: click.Context,
    *,
    task_name: str | None,
    any_task: bool,
    batch_size: int,
    url: str | None,
    prefix: str | None,
    as_json: bool,
) -> None:
    """Count keys by state (completed, in progress, queued at publish) and by task.

    One SCAN over the prefix; approximate on a busy server (SCAN may return a key twice
    while Redis resizes its table).
    """
    target = connect(ctx, task_name=task_name, url=url, prefix=prefix, any_task=any_task)
    if target.postgres is not None:
        from celery_idempotent.cli.postgres import admin_of  # noqa: PLC0415

        pg_admin = admin_of(target.postgres)

        space = None if task_name is None else target.namespace(task_name)
        doc = pg_admin.stats(target.postgres, target.prefix, space)
        if as_json:
            emit_json({**doc, "url": target.shown_url})
            return
        click.echo(f"table {doc['table']} (prefix {target.prefix!r}) on {target.shown_url}")
        rows = [[name, c["completed"], c[IN_PROGRESS]] for name, c in doc["tasks"].items()]
        rows.append(["TOTAL", doc["total"]["completed"], doc["total"][IN_PROGRESS]])
        print_table(["TASK", "COMPLETED", "IN PROGRESS"], rows)
        if doc["expired"]:
            click.echo(f"({doc['expired']} expired row(s) await the sweep)")
        return
    per_task: dict[str, dict[str, int]] = {}
    scan = Scan()
    namespace = None if task_name is None else target.namespace(task_name)
    records: list[tuple[str, bytes]] = []

    def count_records() -> None:
        for (task, _), state in zip(records, _record_states(target.client, records)):
            if state is not None:
                per_task[task][state] += 1
        records.clear()

    for found, (kind, task, raw) in enumerate(scan_names(target, namespace, batch_size, scan), 1):
        counts = per_task.setdefault(task, {"completed": 0, IN_PROGRESS: 0, "queued": 0})
        if kind == "record":
            records.append((task, raw))
            if len(records) >= batch_size:
                count_records()
        else:
            counts[IN_PROGRESS] += 1
        if found % (batch_size * 10) == 0:
            progress(target, f"counted {found} key(s)")
    count_records()
    other = scan.other
    total = {state: sum(c[state] for c in per_task.values()) for state in STATES}
    policy, policy_error = eviction_policy(target.client)
    if as_json:
        emit_json(
            {
                "prefix": target.prefix,
                "url": target.shown_url,
                "maxmemory_policy": policy,
                "total": total,
                "tasks": dict(sorted(per_task.items())),
                "other": other,
                "scanned": scan.scanned,
            }
        )
        return
    click.echo(
        f"prefix {target.prefix!r} on {target.shown_url}, maxmemory-policy {policy or 'unknown'}"
    )
    warning = eviction_warning(target.shown_url, policy, policy_error)
    if warning is not None:
        click.echo(f"WARNING: {warning}", err=True)
    rows = [[name, *(c[state] for state in STATES)] for name, c in sorted(per_task.items())]
    rows.append(["TOTAL", *(total[state] for state in STATES)])
    print_table(["TASK", "COMPLETED", "IN PROGRESS", "QUEUED"], rows)
    if other:
        click.echo(f"({other} other key(s) under the prefix are not celery-idempotent's)")


#: What ``stats`` counts per task (Redis): completed records, held locks (a body running),
#: and queued markers (published by ``apply_async``, not committed yet; a queued call whose
#: body runs counts in "in_progress" too, by its lock).
STATES = ("completed", IN_PROGRESS, "queued")
_QUEUED_HEAD = keyspace.QUEUED_HEAD.encode()


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
