"""MySQL / MariaDB backend: the key's lock is an InnoDB row lock, its record commits in the
body's transaction.

``idempotency_url = "mysql://user:password@host:3306/db"`` (PyMySQL, ``pip install
celery-idempotent[mysql]``; MySQL 8.0+ or MariaDB 10.6+, for ``NOWAIT`` and ``SKIP LOCKED``)
or ``"django://<alias>"`` on Django's MySQL engine. One delivery goes, as on PostgreSQL::

    SET TRANSACTION ISOLATION LEVEL READ COMMITTED; START TRANSACTION
    INSERT the key's row ... ON DUPLICATE KEY UPDATE (an X row lock: wait at most lock_timeout)
    fencing token = AUTO_INCREMENT of <table>_fencing
        ├── a completed, unexpired record ──> ROLLBACK, replay it
        └── ours: the body runs on current_connection(), inside this transaction
              ├── raises / killed / connection lost ──> ROLLBACK (by us or by the server):
              │       the body's writes and the claim vanish together
              └── returns ──> UPDATE the row to 'completed' with the result; COMMIT:
                      the body's writes and the record become visible at once

**Isolation.** Every transaction of the guard is READ COMMITTED, set for that transaction
only (the session's level is left alone): the claim's reads are locking reads of one primary
key, right at any level, but under InnoDB's REPEATABLE READ the sweep's range scan would take
gap locks that every first claim (whose new row sorts first in ``expires_at``) would queue
behind. The body runs in the same transaction, so at READ COMMITTED too: PostgreSQL's
default, and Django's for MySQL.

**Fencing tokens** come from the ``AUTO_INCREMENT`` counter of ``<table>_fencing`` (a row
inserted after the key's row lock is ours and deleted in the same transaction): never rolled
back, persisted across restarts, so tokens strictly increase across the successive holders of
a key, also across rollbacks and record expiry (``TRUNCATE`` of that table resets it: never
do it).

**Expired rows** are replaced in place by the next claim of their key; the others are
deleted by a bounded sweep, at most once per ``cleanup_interval`` per process, after a
commit: ``SELECT ... WHERE expires_at < now ORDER BY expires_at LIMIT n FOR UPDATE SKIP
LOCKED`` then ``DELETE`` of those keys, on the ``expires_at`` index.

**A lost commit reply** is checked before ``CommitUnknownError``: the row with this lease's
token (committed), or the sending session gone from ``information_schema.PROCESSLIST``
without it (rolled back); while that session exists the outcome stays open.

**Round trips** (one multi-statement query per step): a first execution costs 1 to claim
and 1 to commit, the same two a plain ``START TRANSACTION ... COMMIT`` costs; a duplicate of
a completed key 2 (claim, ROLLBACK).

**Differences from PostgreSQL** (documented in docs/mysql.md, tested in tests/mysql):
``lock_timeout`` is whole seconds (default 1); row names are at most 700 characters; the server
ends a silent (cut-off) worker's session, and its row locks, only when its own TCP keepalive
(the OS's, or MariaDB's ``tcp_keepalive_time``) or ``wait_timeout`` notices, not after 25 s
as the PostgreSQL backend configures per session; connections accept several statements per
``execute`` (``CLIENT_MULTI_STATEMENTS``, as mysqlclient's do by default).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from celery_idempotent.backends.mysql.backend import MySQLBackend
from celery_idempotent.backends.mysql.sql import DEFAULT_TABLE, ddl

__all__ = ["DEFAULT_TABLE", "MySQLBackend", "backend_from_url", "ddl", "django_backend_for"]


def backend_from_url(
    url: str, *, serializer: str = "json", accept: Iterable[str] | None = ("json",)
) -> MySQLBackend:
    """The backend a ``mysql://`` ``idempotency_url`` stands for."""
    return MySQLBackend(url, serializer=serializer, accept=accept)


def django_backend_for(alias: str, **options: Any) -> MySQLBackend:
    """The backend of ``django://<alias>`` when that alias is on Django's MySQL engine."""
    from celery_idempotent.backends.mysql.django_backend import DjangoMySQLBackend  # noqa: PLC0415

    return DjangoMySQLBackend(alias, **options)
