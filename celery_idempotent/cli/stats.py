"""``celery -A proj idempotency stats``: keys by state and by task (one SCAN)."""

from __future__ import annotations

import click
from celery.bin.base import CeleryCommand

from celery_idempotent._health import eviction_policy, eviction_warning
from celery_idempotent.cli.common import (
    batch_size_option,
    common_options,
    connect,
    emit_json,
    print_table,
    progress,
    redis_errors,
)
from celery_idempotent.cli.scan import Scan, scan_names

__all__ = ["stats"]


@click.command(cls=CeleryCommand)
@click.option("--task", "task_name", metavar="NAME", help="Count only this task's keys.")
@batch_size_option("SCAN COUNT.")
@common_options
@click.pass_context
@redis_errors
def stats(
    ctx: click.Context,
    *,
    task_name: str | None,
    batch_size: int,
    url: str | None,
    prefix: str | None,
    as_json: bool,
) -> None:
    """Count keys by state (completed, in progress) and by task.

    One SCAN over the prefix; approximate on a busy server (SCAN may return a key twice
    while Redis resizes its table).
    """
    target = connect(ctx, task_name=task_name, url=url, prefix=prefix)
    if target.postgres is not None:
        from celery_idempotent.cli import postgres as pg_cli  # noqa: PLC0415

        space = None if task_name is None else target.namespace(task_name)
        doc = pg_cli.stats(target.postgres, target.prefix, space)
        if as_json:
            emit_json({**doc, "url": target.shown_url})
            return
        click.echo(f"table {doc['table']} (prefix {target.prefix!r}) on {target.shown_url}")
        rows = [[name, c["completed"], c["in_progress"]] for name, c in doc["tasks"].items()]
        rows.append(["TOTAL", doc["total"]["completed"], doc["total"]["in_progress"]])
        print_table(["TASK", "COMPLETED", "IN PROGRESS"], rows)
        if doc["expired"]:
            click.echo(f"({doc['expired']} expired row(s) await the sweep)")
        return
    per_task: dict[str, dict[str, int]] = {}
    scan = Scan()
    namespace = None if task_name is None else target.namespace(task_name)
    for found, (kind, task, _) in enumerate(scan_names(target, namespace, batch_size, scan), 1):
        counts = per_task.setdefault(task, {"completed": 0, "in_progress": 0})
        counts["completed" if kind == "record" else "in_progress"] += 1
        if found % (batch_size * 10) == 0:
            progress(target, f"counted {found} key(s)")
    other = scan.other
    total = {
        "completed": sum(c["completed"] for c in per_task.values()),
        "in_progress": sum(c["in_progress"] for c in per_task.values()),
    }
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
    rows = [[name, c["completed"], c["in_progress"]] for name, c in sorted(per_task.items())]
    rows.append(["TOTAL", total["completed"], total["in_progress"]])
    print_table(["TASK", "COMPLETED", "IN PROGRESS"], rows)
    if other:
        click.echo(f"({other} other key(s) under the prefix are not celery-idempotent's)")
