"""The backends: one package each (memory, Redis, PostgreSQL, MySQL).

Each backend package imports the core and none of the layers above it; the PostgreSQL and MySQL
backends build on the protocol steps of ``backends.sql`` (which imports neither), so which of
the two an SQL URL stands for is decided here, above both.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:
    from celery_idempotent.backends.sql.backend import SQLBackend

__all__ = ["sql_backend_from_url"]


def sql_backend_from_url(
    url: str, *, serializer: str = "json", accept: Iterable[str] | None = ("json",)
) -> SQLBackend:
    """The SQL backend an ``idempotency_url`` stands for: ``mysql://``, or ``django://`` on
    Django's MySQL engine, is the MySQL backend; ``postgresql://``, ``postgres://`` and any other
    ``django://`` the PostgreSQL one. Each backend's driver is imported only when used."""
    if url.startswith("mysql://"):
        from celery_idempotent.backends import mysql  # noqa: PLC0415 - PyMySQL only when used

        return mysql.backend_from_url(url, serializer=serializer, accept=accept)
    from celery_idempotent.backends import postgres  # noqa: PLC0415
    from celery_idempotent.backends.sql.connections import split_url  # noqa: PLC0415

    if url.startswith("django://"):
        rest, options = split_url(url)
        alias = urlsplit(rest).netloc or "default"
        if _django_vendor(alias) == "mysql":
            from celery_idempotent.backends import mysql  # noqa: PLC0415

            return mysql.django_backend_for(
                alias,
                table=options.get("table"),
                lock_timeout=options.get("lock_timeout"),
                serializer=serializer,
                accept=accept,
            )
    return postgres.backend_from_url(url, serializer=serializer, accept=accept)


def _django_vendor(alias: str) -> str | None:
    """The engine vendor of Django's database ``alias`` (``None`` when Django cannot say:
    the PostgreSQL backend then reports the problem on first use, as before)."""
    try:
        from django.db import connections  # noqa: PLC0415 - Django is optional

        return str(connections[alias].vendor)
    except Exception:
        return None
