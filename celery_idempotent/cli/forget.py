"""``celery -A proj idempotency forget``: one key, or every key of a task (SCAN in batches)."""

from __future__ import annotations

import dataclasses
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_idempotent.admin import (
    ForgottenAll,
    forget_all,
    forget_key,
    forget_plan,
    held_lock_reason,
    read_key,
)
from celery_idempotent.cli.common import Target, connect, emit_json, redis_errors
from celery_idempotent.cli.options import (
    KeySelection,
    batch_size_option,
    common_options,
    key_options,
)
from celery_idempotent.cli.scan import (
    Scan,
    count_task,
    delete_task,
    deleted_doc,
    note_unattributed,
    tagged_task,
)
from celery_idempotent.core.exceptions import IdempotencyKeyHeldError
from celery_idempotent.core.names import HEAD_CHARS, MAX_READABLE_KEY

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
        if not target.admin.can_force:
            _pg_forget(
                target,
                target.namespace(task_name),
                None,
                dry_run=dry_run,
                yes=yes,
                as_json=as_json,
            )
            return
        _forget_task(
            ctx,
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
    nkey = selection.resolve(target)
    if not target.admin.can_force:
        _pg_forget(target, None, nkey, dry_run=dry_run, yes=yes, as_json=as_json)
        return
    _forget_one(
        ctx,
        target,
        nkey,
        dry_run=dry_run,
        yes=yes,
        force=force,
        include_fences=include_fences,
        as_json=as_json,
    )


def _pg_forget(
    target: Target,
    namespace: str | None,
    nkey: str | None,
    *,
    dry_run: bool,
    yes: bool,
    as_json: bool,
) -> None:
    """``forget`` on the PostgreSQL backend: rows a running body holds are always kept."""
    from celery_idempotent.backends.postgres import admin as sql_admin  # noqa: PLC0415

    backend: Any = getattr(target.admin, "backend", None)
    where = target.admin.where
    if not dry_run and not yes and not as_json:
        what = f"key {nkey}" if nkey is not None else f"every record of task {namespace}"
        click.confirm(f"Delete {what} from {where}?", abort=True)
    if nkey is not None:
        doc = sql_admin.forget_one(backend, target.prefix, nkey, dry_run=dry_run)
        done = (
            f"{'would delete' if dry_run else 'deleted'} key {nkey}"
            if doc["state"] == "completed" and (dry_run or doc["deleted"])
            else f"key {nkey} is {doc['state'].replace('_', ' ')}: nothing deleted"
        )
    else:
        doc = sql_admin.forget_task(backend, target.prefix, namespace or "", dry_run=dry_run)
        verb = "would delete" if dry_run else "deleted"
        done = f"{verb} {doc['records']} record(s) of task {namespace} from {where}"
        if doc["held"]:
            done += f"; {doc['held']} row(s) held by running bodies are kept"
    if as_json:
        emit_json(doc)
    else:
        click.echo(done)


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
    info = read_key(target.client, target.prefix, nkey)
    doc: dict[str, Any] = {
        "key": nkey,
        "prefix": target.prefix,
        "url": target.shown_url,
        "state": info.state,
        "dry_run": dry_run,
        "deleted": [],
        "refused": None,
    }
    try:
        plan = forget_plan(info, force=force, include_fences=include_fences)
    except IdempotencyKeyHeldError:
        doc["refused"] = held_lock_reason(info, force_hint="pass --force")
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"refused: {doc['refused']}", err=True)
        ctx.exit(1)
    if not plan:
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"nothing to forget: {nkey} is absent")
        return
    if dry_run:
        doc["would_delete"] = plan
        if as_json:
            emit_json(doc)
        else:
            click.echo(f"would delete ({info.state.replace('_', ' ')}):")
            for name in plan:
                click.echo(f"  {name}")
        return
    if not yes:
        what = " and its HELD lock" if info.lock_token is not None else ""
        click.confirm(
            f"Forget {nkey}{what} on {target.shown_url}? Its next delivery runs the body again",
            abort=True,
            err=True,
        )
    # One script (admin.forget_key): the lock is compared with the token that was shown (a
    # lease taken since is someone else's and stays); a fence key is deleted only once the
    # server clock has passed it; a fencing token ahead of the clock is kept in the fence key.
    deleted = list(
        forget_key(target.client, info, force=force, include_fences=include_fences).deleted
    )
    if info.lock_token is not None and info.lock_name not in deleted:
        doc["lock_changed"] = True
    if include_fences and info.fence_value is not None and info.fence_name not in deleted:
        doc["fence_kept"] = True
    doc["deleted"] = deleted
    if as_json:
        emit_json(doc)
        return
    for name in deleted:
        click.echo(f"deleted {name}")
    if doc.get("lock_changed"):
        click.echo(f"kept {info.lock_name}: it changed hands since it was read", err=True)
    if doc.get("fence_kept"):
        click.echo(
            f"kept {info.fence_name}: the server clock is behind its fencing token", err=True
        )
    if not deleted:
        click.echo("nothing deleted: the key changed since it was read")


def _forget_task(
    ctx: click.Context,
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
    if len(tagged_task(task)) >= HEAD_CHARS and not target.quiet:
        click.echo(
            f"note: keys of {task} longer than {MAX_READABLE_KEY} characters are stored under a "
            f"shortened name that keeps only their first {HEAD_CHARS} characters; those that "
            "cannot be told apart from other tasks' are reported, not deleted (use --raw)",
            err=True,
        )
    where = f"task {task} under prefix {target.prefix!r} on {target.shown_url}"
    doc: dict[str, Any] = {
        "task": task,
        "prefix": target.prefix,
        "url": target.shown_url,
        "dry_run": dry_run,
    }
    if dry_run or not yes:
        found = count_task(target, task, batch_size, force, include_fences)
        doc.update(
            records=found.records,
            held_locks=found.locks,
            unattributed=found.unattributed,
            sample=found.sample,
        )
        if include_fences:
            doc["fences"] = found.fences
        to_delete = found.records + (found.locks if force else 0) + found.fences
        kept = (
            ""
            if force or not found.locks
            else (
                f"; {found.locks} held lock(s) (bodies running now) are kept, --force deletes them"
            )
        )
        fenced = f", {found.fences} fence(s)" if include_fences else ""
        summary = (
            f"{found.records} record(s){fenced} and {found.locks} held lock(s) of {where}{kept}"
        )
        if dry_run:
            if as_json:
                emit_json(doc)
                return
            click.echo(f"would forget {summary}")
            for name in found.sample:
                click.echo(f"  {name}")
            if to_delete > len(found.sample):
                click.echo(f"  ... and {to_delete - len(found.sample)} more")
            note_unattributed(found)
            return
        if to_delete == 0:
            if as_json:
                doc.update(deleted=deleted_doc(Scan(), include_fences))
                emit_json(doc)
            else:
                click.echo(f"nothing to forget: {summary}")
            return
        click.confirm(
            f"Forget {summary}? Their next deliveries run the body again", abort=True, err=True
        )
    done = delete_task(target, task, batch_size, force, include_fences)
    doc.update(
        deleted=deleted_doc(done, include_fences),
        unattributed=done.unattributed,
        scanned=done.scanned,
    )
    if as_json:
        emit_json(doc)
        return
    fenced = f", {done.fences} fence(s)" if include_fences else ""
    click.echo(f"deleted {done.records} record(s){fenced} and {done.locks} lock(s) of {where}")
    note_unattributed(done)


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
