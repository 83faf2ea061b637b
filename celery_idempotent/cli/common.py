"""What the ``idempotency`` commands share: where the keys are (:class:`Target`), the output and
the error messages. The options are :mod:`celery_idempotent.cli.options`'s."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import difflib
import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import click

from celery_idempotent.admin import KeyAdmin, admin_for
from celery_idempotent.backends.redis import client as redis_client
from celery_idempotent.core.exceptions import IdempotencyError
from celery_idempotent.settings import (
    IdempotencySettings,
    resolve,
    result_accept,
)

__all__ = [
    "DEFAULT_BATCH",
    "SAMPLE",
    "Target",
    "connect",
    "emit_json",
    "iso",
    "print_pairs",
    "print_result",
    "print_table",
    "progress",
    "redis_errors",
]

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_BATCH = 1000
#: How many names a dry run or a summary lists.
SAMPLE = 10


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
    """Where the command works: the app, its resolved settings, the backend's admin (one
    :class:`~celery_idempotent.core.admin.KeyAdmin`, whatever the backend) and the prefix."""

    app: Any
    settings: IdempotencySettings
    admin: KeyAdmin
    prefix: str
    task: Any = None
    quiet: bool = False

    @property
    def client(self) -> Any:
        """The Redis client of a Redis admin (the SCAN walks of ``forget --task``)."""
        return getattr(self.admin, "client", None)

    def namespace(self, task_name: str) -> str:
        """What ``task_name``'s keys are namespaced by: its ``idempotency_namespace`` (the
        app's, for a task this app does not register), else the name itself."""
        return self.settings.namespace_for(task_name)

    @property
    def shown_url(self) -> str:
        """Where the keys are, without a password."""
        return str(getattr(self.admin, "shown_url", self.admin.where))

    def accept(self) -> list[str]:
        """The content types a stored result may be loaded from: as ``IdempotentTask``."""
        return result_accept(self.app.conf)


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


def _is_idempotent(task: Any) -> bool:
    from celery_idempotent.celery.task import IdempotentTask  # noqa: PLC0415

    return isinstance(task, IdempotentTask)


def unknown_task_message(app: Any, task_name: str) -> str:
    """Why ``--task task_name`` is refused (exit status 2): the app defines no idempotent task
    of that name. An operator asking "was this order charged?" must not read "absent" for a
    mistyped name; the message lists the names the app knows."""
    known = sorted(name for name, task in app.tasks.items() if _is_idempotent(task))
    close = difflib.get_close_matches(task_name, known, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    listed = ", ".join(known) if known else "none"
    return (
        f"--task {task_name!r}: this app defines no IdempotentTask of that name.{hint} "
        f"Its idempotent tasks: {listed}. (Keys of a task the app no longer defines: pass "
        "--any-task.)"
    )


def connect(
    ctx: click.Context,
    *,
    task_name: str | None,
    url: str | None,
    prefix: str | None,
    any_task: bool = False,
) -> Target:
    """Resolve the settings for ``task_name`` (or the app), apply overrides, make a client.
    A ``task_name`` the app does not define as an idempotent task is a usage error (exit
    status 2) naming the ones it does, unless ``any_task``."""
    app, quiet = _app_of(ctx)
    task = _find_task(app, task_name) if task_name else None
    if task_name and not any_task and not _is_idempotent(task):
        raise click.UsageError(unknown_task_message(app, task_name))
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
    try:
        admin = admin_for(
            cfg,
            accept=result_accept(app.conf),
            serializer=app.conf.get("result_serializer") or "json",
            task_name=task_name,
        )
    except (TypeError, ValueError) as exc:
        raise click.UsageError(str(exc)) from exc
    return Target(
        app=app,
        settings=cfg,
        admin=admin,
        prefix=cfg.idempotency_key_prefix,
        task=task,
        quiet=quiet,
    )


# --------------------------------------------------------------------------- output


def emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, sort_keys=False, default=repr))


def print_pairs(rows: Sequence[tuple[str, str]]) -> None:
    """Print ``label  value`` lines with the values aligned."""
    width = max((len(label) for label, _ in rows), default=0)
    for label, value in rows:
        click.echo(f"{label:<{width}}  {value}")


def print_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
    """Print an aligned table: the first column left-aligned, the others right-aligned."""
    cells = [list(map(str, headers))] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    for row in cells:
        parts = [
            row[i].ljust(widths[i]) if i == 0 else row[i].rjust(widths[i])
            for i in range(len(headers))
        ]
        click.echo("  ".join(parts).rstrip())


def print_result(result: Any, error: str | None) -> None:
    """A stored result after a blank line (JSON, indented), or on stderr why it is not shown."""
    click.echo("")
    if error is not None:
        click.echo(f"result not shown: {error}", err=True)
    else:
        click.echo(json.dumps(result, indent=2, default=repr))


def progress(target: Target, message: str) -> None:
    """A progress line on stderr (silenced by ``celery --quiet``)."""
    if not target.quiet:
        click.echo(message, err=True)


def iso(at: float | None) -> str:
    if at is None:
        return "-"
    moment = _dt.datetime.fromtimestamp(at, tz=_dt.timezone.utc)
    return moment.isoformat(timespec="seconds").replace("+00:00", "Z")


def redis_errors(fn: F) -> F:
    """Report an unreachable or failing Redis as a one-line error (exit status 1), and an
    admin that cannot reach the keys at all (``memory://``: they live in each worker process)
    as a usage error (exit status 2)."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        redis_mod = redis_client.import_redis()
        try:
            return fn(*args, **kwargs)
        except NotImplementedError as exc:
            raise click.UsageError(
                f"{exc}, where this command cannot see them (pass --url redis://...)"
            ) from exc
        except (redis_mod.exceptions.RedisError, IdempotencyError, OSError) as exc:
            raise click.ClickException(f"Redis failed: {exc}") from exc

    return wrapper  # type: ignore[return-value]
