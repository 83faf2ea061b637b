"""``celery -A proj idempotency inspect``: one key's state, record, lease and names."""

from __future__ import annotations

import time
from typing import Any

import click
from celery.bin.base import CeleryCommand

from celery_idempotent.admin import KeyInfo, format_duration, read_key
from celery_idempotent.backends.redis import keyspace
from celery_idempotent.cli.common import (
    Target,
    connect,
    emit_json,
    iso,
    print_pairs,
    print_result,
    redis_errors,
)
from celery_idempotent.cli.options import KeySelection, common_options, key_options
from celery_idempotent.core.exceptions import RecordDecodeError
from celery_idempotent.core.states import IN_PROGRESS

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
    nkey = selection.resolve(target)
    if target.postgres is not None:
        from celery_idempotent.cli import postgres as pg_cli  # noqa: PLC0415

        status = pg_cli.inspect(
            target.postgres,
            target.prefix,
            nkey,
            show_result=show_result,
            as_json=as_json,
            shown_url=target.shown_url,
        )
        ctx.exit(status)
    info = read_key(target.client, target.prefix, nkey, with_data=show_result)
    now = time.time()
    result: Any = None
    result_error: str | None = None
    if show_result and info.record is not None:
        result, result_error = _decode_result(target, info)

    if as_json:
        doc = info.as_json(now)
        doc["prefix"] = target.prefix
        doc["url"] = target.shown_url
        if show_result and info.record is not None:
            doc["result"] = result
            doc["result_error"] = result_error
        emit_json(doc)
    else:
        _print_key(info, now, show_result=show_result, result=result, error=result_error)
    if result_error is not None:
        ctx.exit(1)


def _decode_result(target: Target, info: KeyInfo) -> tuple[Any, str | None]:
    """The stored result decoded with the app's accept list, or the reason it was refused."""
    from celery_idempotent.backends.redis.store import RedisIdempotencyStore  # noqa: PLC0415

    accept = target.accept()
    conf = target.app.conf
    try:
        store = RedisIdempotencyStore(
            target.client, serializer=conf.get("result_serializer") or "json", accept=accept
        )
        if info.layout == keyspace.V1_VERSION:
            return store.decode_v1(info.key, info.raw).result, None
        return store.decode(info.key, info.raw).result, None
    except (RecordDecodeError, TypeError, ValueError) as exc:
        return None, str(exc)


def _print_key(
    info: KeyInfo, now: float, *, show_result: bool, result: Any, error: str | None
) -> None:
    states = {
        "completed": "completed",
        IN_PROGRESS: "in progress (locked)",
        "queued": "queued (published, not run yet)",
        "absent": "absent",
    }
    rows: list[tuple[str, str]] = [("key", info.key), ("state", states[info.state])]
    running = info.running_task_id
    if running is not None and info.queued_behind:  # idempotency_publish_until="started"
        rows.append(("running as", f"task {running}"))
    if info.queued_task_id is not None:
        label = "queued behind it" if info.queued_behind else "queued as"
        rows.append((label, f"task {info.queued_task_id}"))
        age = info.queued_age(now)
        rows.append(("queued for", "-" if age is None else format_duration(age)))
        rows.append(("marker ttl", format_duration(info.queued_ttl)))
        claimed = "yes (a delivery claimed it)" if info.queued_claimed else "no delivery yet"
        rows.append(("claimed", claimed))
    rec = info.record
    if rec is not None:
        rows += [
            ("age", f"{format_duration(info.age(now))} (committed {iso(rec['committed_at'])})"),
            ("ttl left", format_duration(info.record_ttl)),
            ("fencing token", str(rec["fencing_token"] or "-")),
            ("fingerprint", rec["fingerprint"] or "- (stored without input)"),
            ("result", f"{rec['content_type']}, {rec['encoding']}, {rec['size']} bytes"),
        ]
    if info.lock_token is not None:
        rows += [
            ("holder", info.holder or "-"),
            ("lease left", format_duration(info.lock_ttl)),
        ]
        if rec is None:
            rows.append(("fencing token", f"{info.lease_fence or '-'} (current lease)"))
    elif rec is not None:
        rows.append(("lock", "free"))
    if rec is None and info.lock_token is None and info.fence_value is not None:
        rows.append(
            ("last fence", f"{info.fence_value} (expires in {format_duration(info.fence_ttl)})")
        )
    rows += [("record name", info.record_name), ("lock name", info.lock_name)]
    print_pairs(rows)
    if show_result and rec is not None:
        print_result(result, error)
