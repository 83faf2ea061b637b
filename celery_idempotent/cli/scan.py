"""Walking a prefix's names with SCAN for the commands (``forget --task``, ``forget --all``,
``stats``): :mod:`celery_idempotent.backends.redis.scan`'s walk, with the progress lines on
stderr, and the commands' own output helpers."""

from __future__ import annotations

import click

from celery_idempotent.backends.redis.scan import (
    Scan,
    decode_name,
    scan_names,
    tagged_task,
)
from celery_idempotent.backends.redis.scan import count_task as _count_task
from celery_idempotent.backends.redis.scan import delete_task as _delete_task
from celery_idempotent.cli.common import Target, progress

__all__ = [
    "Scan",
    "count_task",
    "decode_name",
    "delete_task",
    "deleted_doc",
    "note_unattributed",
    "scan_names",
    "tagged_task",
]


def count_task(
    target: Target, task: str, batch_size: int, force: bool, fences: bool = False
) -> Scan:
    """Count a task's records and held locks (and fences), progress on stderr."""
    return _count_task(
        target, task, batch_size, force, fences, progress=lambda line: progress(target, line)
    )


def delete_task(
    target: Target, task: str, batch_size: int, force: bool, fences: bool = False
) -> Scan:
    """Delete a task's records (with ``force`` its held locks, with ``fences`` its fences)
    in pipelined batches, progress on stderr."""
    return _delete_task(
        target, task, batch_size, force, fences, progress=lambda line: progress(target, line)
    )


def deleted_doc(done: Scan, include_fences: bool) -> dict[str, int]:
    deleted = {"records": done.records, "locks": done.locks}
    if include_fences:
        deleted["fences"] = done.fences
    return deleted


def note_unattributed(found: Scan) -> None:
    if found.unattributed:
        click.echo(
            f"{found.unattributed} shortened key(s) may belong to this task but cannot be "
            "attributed (its name is too long); they were left alone",
            err=True,
        )
