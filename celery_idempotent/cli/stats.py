"""``celery -A proj idempotency stats``: keys by state and by task (one SCAN)."""

from __future__ import annotations

import click
from celery.bin.base import CeleryCommand

from celery_idempotent.cli.common import connect, emit_json, print_table, progress, redis_errors
from celery_idempotent.cli.options import any_task_option, batch_size_option, common_options

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
    namespace = None if task_name is None else target.namespace(task_name)
    report = target.admin.stats(
        namespace, batch_size=batch_size, progress=lambda line: progress(target, line)
    )
    if as_json:
        emit_json(dict(report.document))
        return
    click.echo(report.header)
    for warning in report.warnings:
        click.echo(f"WARNING: {warning}", err=True)
    rows = [[name, *(counts[c] for c in report.columns)] for name, counts in report.tasks.items()]
    rows.append(["TOTAL", *(report.total[c] for c in report.columns)])
    print_table(["TASK", *(c.replace("_", " ").upper() for c in report.columns)], rows)
    for note in report.notes:
        click.echo(note)
