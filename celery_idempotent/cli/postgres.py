"""``celery idempotency sql``: the SQL backends' DDL (PostgreSQL, MySQL / MariaDB).

``inspect``, ``forget`` and ``stats`` are the same commands on every backend (the SQL
backends' admin is :class:`~celery_idempotent.backends.sql.admin.SqlAdmin`); ``sql``, the
one command of the SQL backends only, prints the DDL (no connection).
"""

from __future__ import annotations

import click

from celery_idempotent.backends.postgres import DEFAULT_TABLE, ddl
from celery_idempotent.backends.postgres.connections import split_url

__all__ = ["sql_command"]


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
