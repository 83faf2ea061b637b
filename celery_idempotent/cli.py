"""``celery -A proj idempotency ...``: inspect, forget and count idempotency keys in Redis.

Installed as a ``celery.commands`` entry point, so Celery's own ``celery`` program gains the
``idempotency`` group; ``ctx.obj.app`` is the app given with ``-A``. Where the keys live comes
from that app's settings (``idempotency_url``, else a Redis ``broker_url``;
``idempotency_key_prefix``), with the task's own options when ``--task`` names a registered
task; ``--url`` and ``--prefix`` override both::

    celery -A proj idempotency inspect payment-42 --task proj.tasks.charge
    celery -A proj idempotency inspect --task proj.tasks.charge --args '[42, 999]'
    celery -A proj idempotency inspect --task proj.tasks.report --task-id 3f2a...
    celery -A proj idempotency inspect --raw 'proj.tasks.charge:args:9f86d0...'
    celery -A proj idempotency forget payment-42 --task proj.tasks.charge
    celery -A proj idempotency forget --task proj.tasks.charge --dry-run
    celery -A proj idempotency stats --json

Keys are named as :class:`~celery_idempotent.IdempotentTask` names them:
``<task>:key:<explicit or formatted key>``, ``<task>:id:<task id>`` or
``<task>:args:<sha256 of the bound arguments>``. In Redis (see ``celery_idempotent._redis``)
a key ``k`` becomes the record ``<prefix>{k}``, the lock ``<prefix>lock:{k}`` and the fence
``<prefix>lock:{k}:fence``, where ``k`` is shortened to its first 64 characters plus a sha256
when it is longer than 200 characters or contains a brace.

What the commands never do: deserialize a stored result unless ``inspect --show-result`` asks
(and then only with the app's accept list), use ``KEYS`` (every scan is ``SCAN`` in batches),
or delete a held lock without ``--force``. Fence keys are left to expire by themselves: they
keep fencing tokens increasing across a ``forget``.

Limitation: a key longer than 200 characters (or with a brace) is stored under a shortened
name that keeps only its first 64 characters. ``forget --task NAME`` and ``stats --task NAME``
still find such keys when NAME has fewer than 64 characters (plain ``stats`` counts those whose
head ends before the ``:args:``/``:id:``/``:key:`` marker as ``(shortened)``). For a task name
of 64 characters or more, its shortened keys (every argument-hash key once the name passes 130
characters, long explicit keys) cannot be told apart from other tasks' sharing those 64
characters: ``forget --task`` reports and skips them. One key named with KEY, ``--task-id``,
``--args`` or ``--raw`` is always reached.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import functools
import json
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import click
from celery.bin.base import CeleryCommand

from celery_idempotent import _redis, keyspace
from celery_idempotent._health import eviction_policy, eviction_warning
from celery_idempotent.admin import (
    KeyInfo,
    forget_key,
    forget_plan,
    format_duration,
    held_lock_reason,
    read_key,
)
from celery_idempotent.exceptions import (
    IdempotencyError,
    IdempotencyKeyHeldError,
    IdempotencyKeyMissingError,
    RecordDecodeError,
)
from celery_idempotent.keyspace import (
    HEAD_CHARS,
    MAX_READABLE_KEY,
    SHORTENED_MARK,
    task_key,
)
from celery_idempotent.settings import IdempotencySettings, make_client_from, resolve
from celery_idempotent.urls import redact

if TYPE_CHECKING:
    import redis

__all__ = [
    "KeyInfo",
    "format_duration",
    "idempotency",
    "parse_redis_name",
    "read_key",
    "task_of_slot",
]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_BATCH = 1000
#: How many names a dry run or a summary lists.
SAMPLE = 10


# --------------------------------------------------------------------------- names


def parse_redis_name(name: str, prefix: str) -> tuple[str, str] | None:
    """``(kind, slot)`` of a Redis name under ``prefix``, or ``None`` for a foreign name
    (see ``celery_idempotent.keyspace.parse_name``)."""
    return keyspace.parse_name(name, prefix)


def task_of_slot(slot: str) -> str | None:
    """The task name at the start of a slot, or ``None``
    (see ``celery_idempotent.keyspace.task_of_slot``)."""
    return keyspace.task_of_slot(slot)


def _tagged_task(task: str) -> str:
    """How ``task`` appears in slots: braces become parentheses (such keys are shortened)."""
    return task.replace("{", "(").replace("}", ")")


def _scan_pattern(prefix: str, task: str | None) -> str:
    """SCAN MATCH for every name under ``prefix``, or for ``task``'s records and locks.

    ``<prefix>*{<task>:*`` with prefix and task glob-escaped: one walk of the keyspace finds
    ``<prefix>{...}`` and ``<prefix>lock:{...}``; callers check each name exactly. For a task
    name of 64 characters or more, the pattern holds only the part that survives shortening.
    """
    if task is None:
        return _redis.glob_escape(prefix) + "*"
    head = ("{" + _tagged_task(task) + ":")[: HEAD_CHARS + 1]
    return _redis.glob_escape(prefix) + "*" + _redis.glob_escape(head) + "*"


def _decode_name(name: Any) -> str:
    return name.decode("utf-8", "backslashreplace") if isinstance(name, bytes) else str(name)


# --------------------------------------------------------------------------- settings


class _UrlOverride:
    """Reads like the app for ``settings.resolve`` (which only calls ``app.conf.get``), with
    ``idempotency_url`` replaced by ``--url``: a non-Redis broker then needs no setting."""

    def __init__(self, app: Any, url: str) -> None:
        self._conf = app.conf
        self._url = url
        self.conf = self

    def get(self, name: str, default: Any = None) -> Any:
        if name == "idempotency_url":
            return self._url
        if name == "idempotency_client":
            return None
        return self._conf.get(name, default)


class _AppLevel:
    """Stands for "no particular task" in ``settings.resolve``: app settings only."""

    name = "<celery idempotency>"


@dataclass
class Target:
    """Where the command works: the app, its resolved settings, a client and the prefix."""

    app: Any
    settings: IdempotencySettings
    client: redis.Redis
    url: str
    prefix: str
    task: Any = None
    quiet: bool = False
    #: The PostgreSQL backend when idempotency_url is postgresql:// or django:// (``client``
    #: is then unused; see :mod:`celery_idempotent._pgcli`).
    postgres: Any = None

    def namespace(self, task_name: str) -> str:
        """What ``task_name``'s keys are namespaced by: its ``idempotency_namespace`` (the
        app's, for a task this app does not register), else the name itself."""
        return self.settings.idempotency_namespace or task_name

    @property
    def shown_url(self) -> str:
        """The URL without its password."""
        return redact(self.url)

    def accept(self) -> list[str]:
        """The content types a stored result may be loaded from: as ``IdempotentTask``."""
        conf = self.app.conf
        found = conf.get("result_accept_content") or conf.get("accept_content") or ["json"]
        return list(found)


def _app_of(ctx: click.Context) -> tuple[Any, bool]:
    """The Celery app (and the global ``--quiet``) from Celery's CLI context (``ctx.obj``)."""
    app = getattr(ctx.obj, "app", None)
    if app is None:
        raise click.UsageError("run it as `celery -A proj idempotency ...` (no Celery app found)")
    return app, bool(getattr(ctx.obj, "quiet", False))


def _find_task(app: Any, name: str) -> Any:
    """The registered task ``name`` (importing the app's task modules first), or ``None``."""
    app.loader.import_default_modules()
    return app.tasks.get(name)


def connect(
    ctx: click.Context, *, task_name: str | None, url: str | None, prefix: str | None
) -> Target:
    """Resolve the settings for ``task_name`` (or the app), apply overrides, make a client."""
    app, quiet = _app_of(ctx)
    task = _find_task(app, task_name) if task_name else None
    source: Any = app if url is None else _UrlOverride(app, url)
    try:
        cfg = resolve(source, task if task is not None else _AppLevel())
    except (TypeError, ValueError) as exc:
        hint = " (or pass --url)" if url is None and "idempotency_url" in str(exc) else ""
        raise click.UsageError(f"{exc}{hint}") from exc
    if url is not None:
        cfg = dataclasses.replace(cfg, idempotency_url=url, idempotency_client=None)
    if prefix is not None:
        if not prefix or "{" in prefix or "}" in prefix:
            raise click.BadParameter(
                f"must be a non-empty string without braces, got {prefix!r}", param_hint="--prefix"
            )
        cfg = dataclasses.replace(cfg, idempotency_key_prefix=prefix)
    if cfg.in_postgres:
        from celery_idempotent import _pgcli  # noqa: PLC0415 - psycopg only when used

        conf = app.conf
        accept = list(conf.get("result_accept_content") or conf.get("accept_content") or [])
        return Target(
            app=app,
            settings=cfg,
            client=None,  # type: ignore[arg-type]
            url=cfg.backend_url,
            prefix=cfg.idempotency_key_prefix,
            task=task,
            quiet=quiet,
            postgres=_pgcli.backend_for(cfg, accept),
        )
    if cfg.in_memory:
        raise click.UsageError(
            "idempotency_url is memory://: its keys live inside each worker process, where "
            "this command cannot see them (pass --url redis://...)"
        )
    try:
        if cfg.idempotency_client is not None:
            client = make_client_from(cfg.idempotency_client, task_name=task_name)
            backend = _client_label(client)
        else:
            backend = cfg.backend_url
            client = _redis.make_client(None, backend, "--url / idempotency_url")
    except (TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    return Target(
        app=app,
        settings=cfg,
        client=client,
        url=backend,
        prefix=cfg.idempotency_key_prefix,
        task=task,
        quiet=quiet,
    )


def _client_label(client: Any) -> str:
    """Where an ``idempotency_client`` points, for the output (no password)."""
    pool: Any = getattr(client, "connection_pool", None)
    service = getattr(pool, "service_name", None)
    if service:
        return f"sentinel master {service!r} (db {pool.connection_kwargs.get('db', 0)})"
    if getattr(client, "nodes_manager", None) is not None:  # RedisCluster
        names = sorted(node.name for node in client.get_primaries())
        more = ", ..." if len(names) > 3 else ""
        return f"cluster of {len(names)} primaries ({', '.join(names[:3])}{more})"
    kwargs = getattr(pool, "connection_kwargs", {}) or {}
    if kwargs.get("path"):
        return f"unix://{kwargs['path']}?db={kwargs.get('db', 0)}"
    if "host" in kwargs:
        return f"redis://{kwargs['host']}:{kwargs.get('port', 6379)}/{kwargs.get('db', 0)}"
    return type(client).__name__


# --------------------------------------------------------------------------- output


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=repr))


def _pairs(rows: Sequence[tuple[str, str]]) -> None:
    """Print ``label  value`` lines with the values aligned."""
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        click.echo(f"{label:<{width}}  {value}")


def _table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print an aligned table: the first column left-aligned, the others right-aligned."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i])
            for i in range(len(headers))
        ]
        click.echo("  ".join(parts).rstrip())


def _progress(target: Target, message: str) -> None:
    """A progress line on stderr (silenced by ``celery --quiet``)."""
    if not target.quiet:
        click.echo(message, err=True)


def _iso(at: float | None) -> str:
    if at is None:
        return "-"
    moment = _dt.datetime.fromtimestamp(at, tz=_dt.timezone.utc)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


# --------------------------------------------------------------------------- options


def _common(f: F) -> F:
    """``--url``, ``--prefix`` and ``--json``: on every subcommand."""
    f = click.option(
        "--json", "as_json", is_flag=True, help="Print one JSON document (for scripts)."
    )(f)
    f = click.option(
        "--prefix",
        metavar="PREFIX",
        help="Key prefix instead of the idempotency_key_prefix setting.",
    )(f)
    return click.option(
        "--url",
        metavar="URL",
        help="Redis URL instead of the idempotency_url setting (or the Redis broker_url).",
    )(f)


def _key_selection(f: F) -> F:
    """The ways to name one key: KEY + ``--task``, ``--raw``, ``--task-id``, ``--args``."""
    f = click.option(
        "--kwargs",
        "kwargs_json",
        metavar="JSON",
        help="With --args: keyword arguments as a JSON object.",
    )(f)
    f = click.option(
        "--args",
        "args_json",
        metavar="JSON",
        help="The key a call with these arguments (a JSON array) uses; the task must be "
        "registered in the app.",
    )(f)
    f = click.option(
        "--task-id", metavar="ID", help='The key of an idempotency_key="task_id" task.'
    )(f)
    f = click.option(
        "--raw",
        is_flag=True,
        help="KEY is a namespaced key (<task>:args:<sha>, <task>:id:<id>, <task>:key:<key>) "
        "or a Redis name (<prefix>{...}).",
    )(f)
    return click.option(
        "--task",
        "task_name",
        metavar="NAME",
        help="The task's name: keys are namespaced by it.",
    )(f)


def _json_arg(value: str | None, option: str, kind: type[Any]) -> Any:
    if value is None:
        return kind()
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc}", param_hint=option) from exc
    if not isinstance(parsed, kind):
        raise click.BadParameter(f"must be a JSON {kind.__name__}", param_hint=option)
    return parsed


def _one_key(
    target: Target,
    *,
    key: str | None,
    task_name: str | None,
    raw: bool,
    task_id: str | None,
    args_json: str | None,
    kwargs_json: str | None,
) -> str:
    """The namespaced key that KEY, ``--raw``, ``--task-id`` or ``--args`` names."""
    by_args = args_json is not None or kwargs_json is not None
    if [key is not None, task_id is not None, by_args].count(True) != 1:
        raise click.UsageError("name one key: KEY, --task-id ID or --args JSON")
    if raw:
        if key is None:
            raise click.UsageError("--raw needs KEY (the namespaced key or a Redis name)")
        # A Redis name (record, lock or fence) carries the slot, and slot_key(slot) == slot:
        # the slot reaches the same names, shortened keys included.
        parsed = parse_redis_name(key, target.prefix)
        return parsed[1] if parsed is not None else key
    if task_name is None:
        raise click.UsageError(
            "--task NAME is needed: keys are namespaced by task name (or pass --raw with the "
            "namespaced key)"
        )
    namespace = target.namespace(task_name)
    if key is not None:
        return task_key(namespace, "key", key)
    if task_id is not None:
        return task_key(namespace, "id", task_id)
    return _args_key(target, task_name, args_json, kwargs_json)


def _args_key(
    target: Target, task_name: str, args_json: str | None, kwargs_json: str | None
) -> str:
    """The key the registered task derives for a call with these arguments."""
    task = target.task
    if task is None or not callable(getattr(task, "idempotency_key_for", None)):
        raise click.UsageError(
            f"--args needs {task_name!r} to be a registered IdempotentTask of this app"
        )
    if target.settings.idempotency_key == "task_id":
        raise click.UsageError(f"{task_name} is keyed by task id: use --task-id")
    args = _json_arg(args_json, "--args", list)
    kwargs = _json_arg(kwargs_json, "--kwargs", dict)
    try:
        return str(task.idempotency_key_for(tuple(args), kwargs))
    except (TypeError, ValueError, IdempotencyKeyMissingError) as exc:
        raise click.BadParameter(str(exc), param_hint="--args/--kwargs") from exc


def _redis_errors(fn: F) -> F:
    """Report an unreachable or failing Redis as a one-line error (exit status 1)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        redis_mod = _redis.import_redis()
        try:
            return fn(*args, **kwargs)
        except (redis_mod.exceptions.RedisError, IdempotencyError, OSError) as exc:
            raise click.ClickException(f"Redis failed: {exc}") from exc

    return wrapper  # type: ignore[return-value]


# --------------------------------------------------------------------------- the group


@click.group(name="idempotency")
@click.pass_context
def idempotency(ctx: click.Context) -> None:
    """Inspect, forget and count idempotency keys (celery-idempotent).

    Settings come from the app (-A): idempotency_url (or a Redis broker_url) and
    idempotency_key_prefix; a registered task's own options apply with --task.
    """


# --------------------------------------------------------------------------- inspect


@idempotency.command(cls=CeleryCommand)
@click.argument("key", required=False)
@_key_selection
@click.option(
    "--show-result",
    is_flag=True,
    help="Also decode the stored result (only content types the app accepts).",
)
@_common
@click.pass_context
@_redis_errors
def inspect(
    ctx: click.Context,
    *,
    key: str | None,
    task_name: str | None,
    raw: bool,
    task_id: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    show_result: bool,
    url: str | None,
    prefix: str | None,
    as_json: bool,
) -> None:
    """Show one key: completed, in progress (locked) or absent.

    KEY is the user-level key (an explicit key such as payment-42, or a formatted one such as
    order:42) of the task given with --task.
    """
    target = connect(ctx, task_name=task_name, url=url, prefix=prefix)
    nkey = _one_key(
        target,
        key=key,
        task_name=task_name,
        raw=raw,
        task_id=task_id,
        args_json=args_json,
        kwargs_json=kwargs_json,
    )
    if target.postgres is not None:
        from celery_idempotent import _pgcli  # noqa: PLC0415

        status = _pgcli.inspect(
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
        _emit_json(doc)
    else:
        _print_key(info, now, show_result=show_result, result=result, error=result_error)
    if result_error is not None:
        ctx.exit(1)


def _decode_result(target: Target, info: KeyInfo) -> tuple[Any, str | None]:
    """The stored result decoded with the app's accept list, or the reason it was refused."""
    from celery_idempotent.stores.redis import RedisIdempotencyStore  # noqa: PLC0415

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
    states = {"completed": "completed", "in_progress": "in progress (locked)", "absent": "absent"}
    rows: list[tuple[str, str]] = [("key", info.key), ("state", states[info.state])]
    rec = info.record
    if rec is not None:
        rows += [
            ("age", f"{format_duration(info.age(now))} (committed {_iso(rec['committed_at'])})"),
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
    _pairs(rows)
    if show_result and rec is not None:
        click.echo("")
        if error is not None:
            click.echo(f"result not shown: {error}", err=True)
        else:
            click.echo(json.dumps(result, indent=2, default=repr))


# --------------------------------------------------------------------------- forget


@idempotency.command(cls=CeleryCommand)
@click.argument("key", required=False)
@_key_selection
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
    help="Also delete the fence keys (the last fencing token of each key, kept 7 days; they "
    "name the key). Safe: a new token is never below the server's clock in µs.",
)
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=DEFAULT_BATCH,
    show_default=True,
    help="SCAN COUNT and names deleted per pipelined round trip.",
)
@_common
@click.pass_context
@_redis_errors
def forget(
    ctx: click.Context,
    *,
    key: str | None,
    task_name: str | None,
    raw: bool,
    task_id: str | None,
    args_json: str | None,
    kwargs_json: str | None,
    dry_run: bool,
    yes: bool,
    force: bool,
    include_fences: bool,
    batch_size: int,
    url: str | None,
    prefix: str | None,
    as_json: bool,
) -> None:
    """Delete one key's record, or every key of a task (--task NAME without KEY).

    The next delivery of a forgotten key runs the body again. Held locks (a body running now)
    are kept unless --force. Fence keys are kept unless --include-fences: they expire by
    themselves, and fencing tokens keep increasing without them (a token is never below the
    server's time in µs).
    """
    if all(v is None for v in (key, task_id, args_json, kwargs_json)) and not raw:
        if task_name is None:
            raise click.UsageError("pass --task NAME (every key of that task) and/or a KEY")
        target = connect(ctx, task_name=task_name, url=url, prefix=prefix)
        if target.postgres is not None:
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
    target = connect(ctx, task_name=task_name, url=url, prefix=prefix)
    nkey = _one_key(
        target,
        key=key,
        task_name=task_name,
        raw=raw,
        task_id=task_id,
        args_json=args_json,
        kwargs_json=kwargs_json,
    )
    if target.postgres is not None:
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
    from celery_idempotent import _pgcli  # noqa: PLC0415

    where = f"table {target.postgres.table} on {target.shown_url}"
    if not dry_run and not yes and not as_json:
        what = f"key {nkey}" if nkey is not None else f"every record of task {namespace}"
        click.confirm(f"Delete {what} from {where}?", abort=True)
    if nkey is not None:
        doc = _pgcli.forget_one(target.postgres, target.prefix, nkey, dry_run=dry_run)
        done = (
            f"{'would delete' if dry_run else 'deleted'} key {nkey}"
            if doc["state"] == "completed" and (dry_run or doc["deleted"])
            else f"key {nkey} is {doc['state'].replace('_', ' ')}: nothing deleted"
        )
    else:
        doc = _pgcli.forget_task(target.postgres, target.prefix, namespace or "", dry_run=dry_run)
        verb = "would delete" if dry_run else "deleted"
        done = f"{verb} {doc['records']} record(s) of task {namespace} from {where}"
        if doc["held"]:
            done += f"; {doc['held']} row(s) held by running bodies are kept"
    if as_json:
        _emit_json(doc)
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
            _emit_json(doc)
        else:
            click.echo(f"refused: {doc['refused']}", err=True)
        ctx.exit(1)
    if not plan:
        if as_json:
            _emit_json(doc)
        else:
            click.echo(f"nothing to forget: {nkey} is absent")
        return
    if dry_run:
        doc["would_delete"] = plan
        if as_json:
            _emit_json(doc)
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
        _emit_json(doc)
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


@dataclass
class _Scan:
    """What a scan found (or deleted)."""

    records: int = 0
    locks: int = 0
    fences: int = 0
    #: Names under the prefix that are not records, locks or fences.
    other: int = 0
    #: Shortened names that may belong to the task but cannot be told apart.
    unattributed: int = 0
    scanned: int = 0
    sample: list[str] = field(default_factory=list)


def _names(
    target: Target,
    task: str | None,
    batch_size: int,
    scan: _Scan,
    *,
    fences: bool = False,
) -> Iterator[tuple[str, str, bytes]]:
    """``(kind, task, raw name)`` of every record and lock (and fence, with ``fences``)
    under the prefix, or of ``task``'s only: SCAN in batches (see :func:`_scan_pattern`),
    each name then checked exactly.

    ``kind`` is ``"record"``, ``"lock"`` or ``"fence"``; the task is ``"(shortened)"`` for a
    shortened key whose head ends before its kind marker, ``"(no task)"`` for a key that is
    not task-namespaced (a guard used directly).
    """
    tagged = None if task is None else _tagged_task(task)
    pattern = _scan_pattern(target.prefix, task)
    for raw in target.client.scan_iter(match=pattern, count=batch_size):
        scan.scanned += 1
        parsed = parse_redis_name(_decode_name(raw), target.prefix)
        if parsed is None:
            scan.other += 1
            continue
        kind, slot = parsed
        if kind == "fence" and not fences:
            continue
        owner = task_of_slot(slot)
        shortened = SHORTENED_MARK in slot
        if owner is None and shortened and tagged is not None:
            if slot.partition(SHORTENED_MARK)[0].startswith(tagged + ":"):
                owner = tagged  # the head ends inside the kind marker: still this task's
            else:
                scan.unattributed += 1
                continue
        if tagged is not None and owner != tagged:
            continue
        yield kind, owner or ("(shortened)" if shortened else "(no task)"), raw


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
    if len(_tagged_task(task)) >= HEAD_CHARS and not target.quiet:
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
        found = _count_task(target, task, batch_size, force, include_fences)
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
                _emit_json(doc)
                return
            click.echo(f"would forget {summary}")
            for name in found.sample:
                click.echo(f"  {name}")
            if to_delete > len(found.sample):
                click.echo(f"  ... and {to_delete - len(found.sample)} more")
            _note_unattributed(found)
            return
        if to_delete == 0:
            if as_json:
                doc.update(deleted=_deleted_doc(_Scan(), include_fences))
                _emit_json(doc)
            else:
                click.echo(f"nothing to forget: {summary}")
            return
        click.confirm(
            f"Forget {summary}? Their next deliveries run the body again", abort=True, err=True
        )
    done = _delete_task(target, task, batch_size, force, include_fences)
    doc.update(
        deleted=_deleted_doc(done, include_fences),
        unattributed=done.unattributed,
        scanned=done.scanned,
    )
    if as_json:
        _emit_json(doc)
        return
    fenced = f", {done.fences} fence(s)" if include_fences else ""
    click.echo(f"deleted {done.records} record(s){fenced} and {done.locks} lock(s) of {where}")
    _note_unattributed(done)


def _deleted_doc(done: _Scan, include_fences: bool) -> dict[str, int]:
    deleted = {"records": done.records, "locks": done.locks}
    if include_fences:
        deleted["fences"] = done.fences
    return deleted


def _note_unattributed(found: _Scan) -> None:
    if found.unattributed:
        click.echo(
            f"{found.unattributed} shortened key(s) may belong to this task but cannot be "
            "attributed (its name is too long); they were left alone",
            err=True,
        )


def _count_task(
    target: Target, task: str, batch_size: int, force: bool, fences: bool = False
) -> _Scan:
    """Count a task's records and held locks (and fences); SCAN may count a key twice while
    Redis resizes its table; the deletion that follows counts exactly."""
    found = _Scan()
    names = _names(target, task, batch_size, found, fences=fences)
    for matched, (kind, _, raw) in enumerate(names, 1):
        if kind == "record":
            found.records += 1
        elif kind == "fence":
            found.fences += 1
            continue  # not sampled: a fence is not what a user forgets
        else:
            found.locks += 1
        if len(found.sample) < SAMPLE and (force or kind == "record"):
            found.sample.append(_decode_name(raw))
        if matched % batch_size == 0:
            _progress(target, f"counting: {matched} key(s) of {task} so far")
    return found


def _delete_task(
    target: Target, task: str, batch_size: int, force: bool, fences: bool = False
) -> _Scan:
    """Delete a task's records (with ``force`` its held locks, with ``fences`` its fences)
    in pipelined batches."""
    done = _Scan()
    batch: list[tuple[str, bytes]] = []
    batches = 0

    drop_fence = target.client.register_script(_redis.DROP_FENCE)

    def flush() -> None:
        nonlocal batches
        # One DEL per name: on a cluster the names live in different slots. A fence key is
        # deleted by a script of its own, only once the server clock has passed it (fence
        # keys are rare in layout v2: 0.1.0's, or a token ahead of a clock that stepped back).
        pipe = target.client.pipeline(transaction=False)
        for kind, raw in batch:
            if kind != "fence":
                pipe.delete(raw)
        replies = iter(pipe.execute())
        results = [
            drop_fence(keys=[raw]) if kind == "fence" else next(replies) for kind, raw in batch
        ]
        for (kind, _), gone in zip(batch, results):
            if gone and kind == "record":
                done.records += 1
            elif gone and kind == "fence":
                done.fences += 1
            elif gone:
                done.locks += 1
        batch.clear()
        batches += 1

    for kind, _, raw in _names(target, task, batch_size, done, fences=fences):
        if kind == "lock" and not force:
            continue
        batch.append((kind, raw))
        if len(batch) >= batch_size:
            flush()
            _progress(
                target,
                f"deleting: batch {batches}, {done.records + done.locks + done.fences} "
                f"key(s) deleted ({done.scanned} scanned)",
            )
    if batch:
        flush()
    return done


def _describe_key_argument(command: click.Command, text: str) -> None:
    # Click 8.5.1 lists arguments among the options; set the help where it is read
    # (older Click has no ``help`` for arguments and ignores the attribute).
    for param in command.params:
        if isinstance(param, click.Argument) and param.name == "key":
            param.help = text


_KEY_HELP = (
    "The key as the task used it: payment-42 (explicit), order:42 (formatted); with --raw "
    "a namespaced key or a Redis name."
)
_describe_key_argument(inspect, _KEY_HELP)
_describe_key_argument(
    forget, _KEY_HELP + " Without KEY, --task-id or --args: every key of --task."
)


# --------------------------------------------------------------------------- stats


@idempotency.command(cls=CeleryCommand)
@click.option("--task", "task_name", metavar="NAME", help="Count only this task's keys.")
@click.option(
    "--batch-size",
    type=click.IntRange(1, 100_000),
    default=DEFAULT_BATCH,
    show_default=True,
    help="SCAN COUNT.",
)
@_common
@click.pass_context
@_redis_errors
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
        from celery_idempotent import _pgcli  # noqa: PLC0415

        space = None if task_name is None else target.namespace(task_name)
        doc = _pgcli.stats(target.postgres, target.prefix, space)
        if as_json:
            _emit_json({**doc, "url": target.shown_url})
            return
        click.echo(f"table {doc['table']} (prefix {target.prefix!r}) on {target.shown_url}")
        table = [[name, c["completed"], c["in_progress"]] for name, c in doc["tasks"].items()]
        table.append(["TOTAL", doc["total"]["completed"], doc["total"]["in_progress"]])
        _table(["TASK", "COMPLETED", "IN PROGRESS"], table)
        if doc["expired"]:
            click.echo(f"({doc['expired']} expired row(s) await the sweep)")
        return
    per_task: dict[str, dict[str, int]] = {}
    scan = _Scan()
    namespace = None if task_name is None else target.namespace(task_name)
    for found, (kind, task, _) in enumerate(_names(target, namespace, batch_size, scan), 1):
        counts = per_task.setdefault(task, {"completed": 0, "in_progress": 0})
        counts["completed" if kind == "record" else "in_progress"] += 1
        if found % (batch_size * 10) == 0:
            _progress(target, f"counted {found} key(s)")
    other = scan.other
    total = {
        "completed": sum(c["completed"] for c in per_task.values()),
        "in_progress": sum(c["in_progress"] for c in per_task.values()),
    }
    policy, policy_error = eviction_policy(target.client)
    if as_json:
        _emit_json(
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
    _table(["TASK", "COMPLETED", "IN PROGRESS"], rows)
    if other:
        click.echo(f"({other} other key(s) under the prefix are not celery-idempotent's)")


# --------------------------------------------------------------------------- PostgreSQL DDL


def _add_sql_command() -> None:
    from celery_idempotent._pgcli import sql_command  # noqa: PLC0415 - no psycopg import

    idempotency.add_command(sql_command)


_add_sql_command()
