"""The ``celery idempotency`` commands on the PostgreSQL backend (``postgresql://``, ``django://``).

``celery_idempotent.cli`` resolves the app's settings and the key as for Redis, then hands a
``postgresql://`` target to :func:`backend_for`; ``inspect``, ``forget`` and ``stats`` read and
delete through :mod:`celery_idempotent.backends.postgres.admin` (``--force`` cannot take a row lock
away from a live session) and print what it returns. ``sql`` prints the DDL (no connection).
``django://`` URLs need the Django project configured (``DJANGO_SETTINGS_MODULE``), as the
worker has it.
"""

from __future__ import annotations

import json
from types import ModuleType
from typing import Any

import click

from celery_idempotent.backends import sql_backend_from_url
from celery_idempotent.backends.postgres import DEFAULT_TABLE, ddl
from celery_idempotent.backends.postgres.connections import split_url
from celery_idempotent.backends.sql.backend import SQLBackend
from celery_idempotent.core.states import IN_PROGRESS

__all__ = ["admin_of", "backend_for", "inspect", "sql_command"]


@click.command(name="sql")
@click.option(
    "--table", default=None, metavar="NAME", help=f"Table name (default: {DEFAULT_TABLE})."
)
@click.option("--url", default=None, metavar="URL", help="Take the table name from this URL.")
@click.option(
    "--dialect",
    type=click.Choice(["postgresql", "mysql"]),
    default=None,
    help="The database's DDL (default: mysql for a mysql:// --url, else postgresql).",
)
def sql_command(table: str | None, url: str | None, dialect: str | None = None) -> None:
    """Print the DDL of the SQL backend's tables (PostgreSQL: table, index and sequence;
    MySQL / MariaDB: ``--dialect mysql`` or a ``mysql://`` ``--url``).

    For teams that do not let applications run DDL: run it once, then set
    ``?table=...`` in idempotency_url if the name is not the default, and the backend finds
    the table (it creates it on first use otherwise).
    """
    name = table
    if name is None and url:
        name = split_url(url)[1].get("table")
    make_ddl = ddl
    if dialect == "mysql" or (dialect is None and (url or "").startswith("mysql://")):
        from celery_idempotent.backends.mysql.sql import ddl as make_ddl  # noqa: PLC0415
    try:
        click.echo(make_ddl(name or DEFAULT_TABLE), nl=False)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--table") from exc


def admin_of(backend: SQLBackend) -> ModuleType:
    """The admin module of ``backend``'s database: PostgreSQL's, or MySQL's."""
    if getattr(backend, "dialect", "postgresql") == "mysql":
        from celery_idempotent.backends.mysql import admin as mysql_admin  # noqa: PLC0415

        return mysql_admin
    from celery_idempotent.backends.postgres import admin as pg_admin  # noqa: PLC0415

    return pg_admin


def backend_for(cfg: Any, accept: list[str]) -> SQLBackend:
    """The backend of the app's ``idempotency_url``, loading results with ``accept``."""
    url: str = cfg.backend_url
    if url.startswith("django://"):
        import django  # noqa: PLC0415

        django.setup()
    return sql_backend_from_url(url, accept=accept or ["json"])


def inspect(
    backend: SQLBackend,
    prefix: str,
    nkey: str,
    *,
    show_result: bool,
    as_json: bool,
    shown_url: str,
) -> int:
    """Print one key's state; returns the exit status."""
    describe = admin_of(backend).describe
    doc = describe(backend, prefix, nkey, show_result=show_result, shown_url=shown_url)
    state, held, row = doc["state"], doc["held"], doc["row"]
    record = doc["record"]
    result, error = doc.get("result"), doc.get("result_error")
    if as_json:
        click.echo(json.dumps(doc, default=repr))
    else:
        from celery_idempotent.admin import format_duration  # noqa: PLC0415
        from celery_idempotent.cli.common import print_pairs, print_result  # noqa: PLC0415

        states = {
            "completed": "completed",
            IN_PROGRESS: "in progress (a transaction holds the row)",
            "queued": "queued (published, no delivery has committed it)",
            "absent": "absent",
        }
        pairs = [("key", nkey), ("state", states[state])]
        if doc.get("queued") is not None:
            pairs += [
                ("task id", str(doc["queued"]["task_id"] or "-")),
                ("marker ttl left", format_duration(doc["queued"]["ttl"])),
            ]
        if record is not None:
            rec = doc["record"]
            pairs += [
                ("age", format_duration(rec["age"])),
                ("ttl left", format_duration(rec["ttl"])),
                ("fencing token", str(rec["fencing_token"] or "-")),
                ("fingerprint", rec["fingerprint"] or "- (stored without input)"),
                ("result", f"{rec['content_type']}, {rec['encoding']}, {rec['size']} bytes"),
                ("lock", "held by a running transaction" if held else "free"),
            ]
        pairs += [("row", row), ("table", backend.table)]
        print_pairs(pairs)
        if show_result and record is not None:
            print_result(result, error)
    return 1 if error is not None else 0
