"""The output helpers of the commands that walk a key namespace (``forget --task``)."""

from __future__ import annotations

import click

from celery_idempotent.core.admin import NamespaceCount

__all__ = ["deleted_doc", "note_unattributed"]


def deleted_doc(done: NamespaceCount, include_fences: bool) -> dict[str, int]:
    """What was deleted, as ``forget --json`` reports it."""
    deleted = {"records": done.records, "locks": done.locks}
    if include_fences:
        deleted["fences"] = done.fences
    return deleted


def note_unattributed(unattributed: int) -> None:
    """The stderr note about shortened names that may be the task's (left alone)."""
    if unattributed:
        click.echo(
            f"{unattributed} shortened key(s) may belong to this task but cannot be "
            "attributed (its name is too long); they were left alone",
            err=True,
        )
