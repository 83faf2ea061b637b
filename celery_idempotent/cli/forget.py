"""``celery -A proj idempotency forget``: one key, or every key of a task (SCAN in batches)."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_idempotent.admin import ForgottenAll, forget_all
from celery_idempotent.cli.common import Target, connect, emit_json, progress, redis_errors
from celery_idempotent.cli.options import (
    KeySelection,
    batch_size_option,
    common_options,
    key_options,
)
from celery_idempotent.cli.scan import deleted_doc, note_unattributed
from celery_idempotent.core.admin import FORCE_HINT, NamespaceCount
from celery_idempotent.core.exceptions import IdempotencyKeyHeldError
from celery_idempotent.core.states import KeyState

__all__ = ["forget"]


@click.command(cls=CeleryCommand)
@key_options
@click.option(
    "--all",
    "all_tasks",
    is_flag=True,
    help="Every key of every idempotent task of the app, each where its settings put it.",
)
@click.option("--dry-run", is_flag=True, help="Show what would be deleted; delete nothing.")
@click.option("--yes", "-y", is_flag=True, help="Do not ask for confirmation.")
@click.option(
    "--force",
    is_flag=True,
    help="Also delete held locks. A held lock means a delivery is running the body now: "
    "deleting it lets a duplicate run the body at the same time.",
)
@click.option(
    "--include-fences",
    is_flag=True,
    help="Also delete the fence keys (a key's last fencing token, written only while the "
    "server clock is behind it, and gone by itself once the clock passes it; 0.1.0's lived 7 "
    "days). Safe: one is deleted only once the server clock has passed its token.",
)
@batch_size_option("SCAN COUNT and names deleted per pipelined round trip.")
@common_options
@click.pass_context
@redis_errors
def forget(
    ctx: click.Context,
    *,
    selection: KeySelection,
    all_tasks: bool,
    dry_run: bool,
    yes: bool,
    force: bool,
    include_fences: bool,
    batch_size: int,
    url: str | None,
    prefix: str | None,
    as_json: bool,
) -> None:
    """Delete one key's record, every key of a task (--task NAME without KEY), or every key
    of every idempotent task of the app (--all).

    The next delivery of a forgotten key runs the body again. Held locks (a body running now)
    are kept unless --force. Fence keys are kept unless --include-fences: they expire by
    themselves, and fencing tokens keep increasing without them (a token is never below the
    server's time in µs).
    """
    task_name = selection.task_name
    if all_tasks:
        if selection.names_a_key or task_name is not None:
            raise click.UsageError("--all names every key already: pass no KEY and no --task")
        _forget_all(
            ctx,
            dry_run=dry_run,
            yes=yes,
            force=force,
            include_fences=include_fences,
            batch_size=batch_size,
            url=url,
            prefix=prefix,
            as_json=as_json,
        )
        return
    if not selection.names_a_key:
        if task_name is None:
            raise click.UsageError(
                "pass --task NAME (every key of that task) and/or a KEY, or --all"
            )
        target = connect(
            ctx, task_name=task_name, url=url, prefix=prefix, any_task=selection.any_task
        )
        _forget_task(
            target,
            target.namespace(task_name),
            dry_run=dry_run,
            yes=yes,
            force=force,
            include_fences=include_fences,
            batch_size=batch_size,
            as_json=as_json,
        )
        return
    target = connect(ctx, task_name=task_name, url=url, prefix=prefix, any_task=selection.any_task)
    _forget_one(
        ctx,
        target,
        selection.resolve(target),
        dry_run=dry_run,
        yes=yes,
        force=force,
        include_fences=include_fences,
        as_json=as_json,
    )


def _held(
    ctx: click.Context,
    target: Target,
    doc: dict[str, Any],
    exc: IdempotencyKeyHeldError,
    *,
    as_json: bool,
) -> None:
    """A running body holds the key. Where ``--force`` could take the lock, that is a refusal
    (exit status 1, saying how to force it); where nothing can take it (a row lock of a live
    SQL session), the key is reported kept (exit status 0)."""
    nkey = doc["key"]
    doc["state"] = KeyState.RUNNING.json_name
    if not target.admin.can_force:
        doc["kept"] = [str(exc.message or exc)]
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"key {nkey} is in progress: nothing deleted ({exc.message or exc})")
        return
    doc["refused"] = str(exc.message or exc).replace(FORCE_HINT, "pass --force")
    if as_json:
        emit_json(doc)
    else:
        click.echo(f"refused: {doc['refused']}", err=True)
    ctx.exit(1)


def _forget_one(
    ctx: click.Context,
    target: Target,
    nkey: str,
    *,
    dry_run: bool,
    yes: bool,
    force: bool,
    include_fences: bool,
    as_json: bool,
) -> None:
    """Forget one key: what would go is read first (and shown with ``--dry-run``), then
    confirmed (unless ``--yes``), then deleted."""
    admin = target.admin
    doc: dict[str, Any] = {
        "key": nkey,
        "prefix": target.prefix,
        "url": target.shown_url,
        "state": KeyState.ABSENT.json_name,
        "dry_run": dry_run,
        "deleted": [],
        "refused": None,
    }
    try:
        plan = admin.forget(nkey, force=force, include_fences=include_fences, dry_run=True)
    except IdempotencyKeyHeldError as exc:
        _held(ctx, target, doc, exc, as_json=as_json)
        return
    state = KeyState.of(plan.state)
    doc["state"] = state.json_name
    if not plan.would_delete:
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"nothing to forget: {nkey} is {state.json_name.replace('_', ' ')}")
        return
    if dry_run:
        doc["would_delete"] = list(plan.would_delete)
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"would delete ({state.json_name.replace('_', ' ')}):")
            for name in plan.would_delete:
                click.echo(f"  {name}")
        return
    if not yes:
        what = " and its HELD lock" if state == KeyState.RUNNING else ""
        click.confirm(
            f"Forget {nkey}{what} on {target.shown_url}? Its next delivery runs the body again",
            abort=True,
            err=True,
        )
    # Redis: one script, the lock compared with the token that was read (a lease taken since
    # is someone else's and stays); a fence key is deleted only once the server clock has
    # passed it. SQL: the row, unless a running body has taken it since.
    try:
        done = admin.forget(nkey, force=force, include_fences=include_fences)
    except IdempotencyKeyHeldError as exc:
        _held(ctx, target, doc, exc, as_json=as_json)
        return
    doc["deleted"] = list(done.deleted)
    if done.kept:
        doc["kept"] = list(done.kept)
    if as_json:
        emit_json(doc)
        return
    if done.deleted:
        click.echo(f"deleted key {nkey}:")
    for name in done.deleted:
        click.echo(f"  {name}")
    for why in done.kept:
        click.echo(f"kept {why}", err=True)
    if not done.deleted:
        click.echo("nothing deleted: the key changed since it was read")


def _forget_task(
    target: Target,
    task: str,
    *,
    dry_run: bool,
    yes: bool,
    force: bool,
    include_fences: bool,
    batch_size: int,
    as_json: bool,
) -> None:
    """Forget every key of one namespace: counted first (the count is the dry run), confirmed
    (unless ``--yes``), then deleted."""
    admin = target.admin
    note = admin.namespace_note(task)
    if note is not None and not target.quiet:
        click.echo(f"note: {note}", err=True)
    where = f"task {task} under {admin.where}"
    doc: dict[str, Any] = {
        "task": task,
        "prefix": target.prefix,
        "url": target.shown_url,
        "dry_run": dry_run,
    }
    options: dict[str, Any] = {
        "force": force,
        "include_fences": include_fences,
        "batch_size": batch_size,
        "progress": lambda line: progress(target, line),
    }
    if dry_run or not yes:
        found = admin.forget_namespace(task, dry_run=True, **options)
        held = found.locks + found.kept_locks
        doc.update(
            records=found.records,
            held_locks=held,
            unattributed=found.unattributed,
            sample=list(found.sample),
        )
        if include_fences:
            doc["fences"] = found.fences
        to_delete = found.records + found.locks + found.fences
        kept = ""
        if found.kept_locks:
            kept = f"; {found.kept_locks} held lock(s) (bodies running now) are kept"
            if admin.can_force:
                kept += ", --force deletes them"
        fenced = f", {found.fences} fence(s)" if include_fences else ""
        summary = f"{found.records} record(s){fenced} and {held} held lock(s) of {where}{kept}"
        if dry_run:
            if as_json:
                emit_json(doc)
                return
            click.echo(f"would forget {summary}")
            for name in found.sample:
                click.echo(f"  {name}")
            if to_delete > len(found.sample):
                click.echo(f"  ... and {to_delete - len(found.sample)} more")
            note_unattributed(found.unattributed)
            return
        if to_delete == 0:
            if as_json:
                doc.update(deleted=deleted_doc(NamespaceCount(), include_fences))
                emit_json(doc)
            else:
                click.echo(f"nothing to forget: {summary}")
            return
        click.confirm(
            f"Forget {summary}? Their next deliveries run the body again", abort=True, err=True
        )
    done = admin.forget_namespace(task, **options)
    doc.update(
        deleted=deleted_doc(done, include_fences),
        kept_locks=done.kept_locks,
        unattributed=done.unattributed,
        scanned=done.scanned,
    )
    if as_json:
        emit_json(doc)
        return
    fenced = f", {done.fences} fence(s)" if include_fences else ""
    line = f"deleted {done.records} record(s){fenced} and {done.locks} lock(s) of {where}"
    if done.kept_locks:
        line += f"; {done.kept_locks} held lock(s) (bodies running now) are kept"
    click.echo(line)
    note_unattributed(done.unattributed)


def _forget_all(
    ctx: click.Context,
    *,
    dry_run: bool,
    yes: bool,
    force: bool,
    include_fences: bool,
    batch_size: int,
    url: str | None,
    prefix: str | None,
    as_json: bool,
) -> None:
    """``forget --all``: every idempotent task's keys (:func:`admin.forget_all`), counted
    first, then confirmed (unless ``--yes``), then deleted."""
    app = getattr(ctx.obj, "app", None)
    if app is None:
        raise click.UsageError("run it as `celery -A proj idempotency ...` (no Celery app found)")
    quiet = bool(getattr(ctx.obj, "quiet", False))

    def progress(line: str) -> None:
        if not quiet:
            click.echo(line, err=True)

    options: dict[str, Any] = {
        "force": force,
        "include_fences": include_fences,
        "batch_size": batch_size,
        "url": url,
        "prefix": prefix,
        "progress": progress,
    }
    try:
        found = forget_all(app, dry_run=True, **options)
    except (TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    if not found.namespaces:
        raise click.UsageError("the app registers no IdempotentTask: nothing to forget")
    if dry_run or not yes:
        if as_json and dry_run:
            emit_json(_all_doc(found))
            return
        if not as_json or dry_run:
            _print_all(found, "would forget")
        if dry_run:
            return
        if not found.records + found.locks + sum(each.fences for each in found.namespaces):
            if as_json:
                emit_json(_all_doc(found))
            else:
                click.echo("nothing to forget")
            return
        click.confirm(
            f"Forget {found.records} record(s)"
            + (f" and {found.locks} held lock(s)" if force else "")
            + f" of {len(found.namespaces)} task namespace(s)? Their next deliveries run the "
            "body again",
            abort=True,
            err=True,
        )
    done = forget_all(app, **options)
    if as_json:
        emit_json(_all_doc(done))
        return
    _print_all(done, "forgot")


def _all_doc(result: ForgottenAll) -> dict[str, Any]:
    return {
        "dry_run": result.dry_run,
        "records": result.records,
        "locks": result.locks,
        "kept_locks": result.kept_locks,
        "namespaces": [dataclasses.asdict(each) for each in result.namespaces],
    }


def _print_all(result: ForgottenAll, verb: str) -> None:
    for each in result.namespaces:
        tasks = ", ".join(each.tasks)
        shown = each.namespace if each.tasks == (each.namespace,) else f"{each.namespace} ({tasks})"
        if each.skipped is not None:
            click.echo(f"skipped {shown}: {each.skipped}")
            continue
        line = f"{verb} {each.records} record(s)"
        if each.locks:
            line += f" and {each.locks} held lock(s)"
        if each.fences:
            line += f", {each.fences} fence(s)"
        line += f" of {shown} under {each.prefix!r} on {each.where}"
        if each.kept_locks:
            line += f"; {each.kept_locks} held lock(s) kept (bodies running now; --force)"
        click.echo(line)
        if each.unattributed:
            click.echo(
                f"  {each.unattributed} shortened key(s) may be {each.namespace}'s but cannot "
                "be attributed; left alone",
                err=True,
            )
    click.echo(
        f"total: {result.records} record(s), {result.locks} held lock(s)"
        + (f", {result.kept_locks} kept" if result.kept_locks else "")
    )
