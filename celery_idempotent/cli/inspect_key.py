"""``celery -A proj idempotency inspect``: one key's state, record, lease and names."""

from __future__ import annotations

import click
from celery.bin.base import CeleryCommand

from celery_idempotent.cli.common import (
    connect,
    emit_json,
    print_pairs,
    print_result,
    redis_errors,
)
from celery_idempotent.cli.options import KeySelection, common_options, key_options

__all__ = ["inspect"]


@click.command(cls=CeleryCommand)
@key_options
@click.option(
    "--show-result",
    is_flag=True,
    help="Also decode the stored result (only content types the app accepts).",
)
@common_options
@click.pass_context
@redis_errors
def inspect(
    ctx: click.Context,
    *,
    selection: KeySelection,
    show_result: bool,
    url: str | None,
    prefix: str | None,
    as_json: bool,
) -> None:
    """Show one key: completed, in progress (locked), queued (published, not run yet) or absent.

    KEY is the user-level key (an explicit key such as payment-42, or a formatted one such as
    order:42) of the task given with --task.
    """
    target = connect(
        ctx,
        task_name=selection.task_name,
        url=url,
        prefix=prefix,
        any_task=selection.any_task,
    )
    report = target.admin.inspect(selection.resolve(target), show_result=show_result)
    if as_json:
        emit_json(dict(report.document))
    else:
        print_pairs(report.lines)
        if report.result_shown:
            print_result(report.result, report.result_error)
    if report.result_error is not None:
        ctx.exit(1)
