"""PostgreSQL backend: the key's lock is a row lock, its record commits in the body's transaction.

``idempotency_url = "postgresql://user@host:5432/db"`` (psycopg 3, ``pip install
celery-idempotent[postgres]``) or ``"django://<alias>"`` (Django's connection for that alias).
One delivery goes::

    BEGIN; lock the key's row (wait at most lock_timeout); fencing token = nextval(sequence)
        ├── a completed, unexpired record ──> ROLLBACK, replay it
        └── ours: the body runs on current_connection(), inside this transaction
              ├── raises / killed / connection lost ──> ROLLBACK (by us or by the server):
              │       the body's writes and the claim vanish together
              └── returns ──> UPDATE the row to 'completed' with the result; COMMIT:
                      the body's writes and the record become visible at once

The lease is the transaction itself: it ends when the transaction does, never by a timer, so
``lock_ttl`` and renewals have nothing to do here (``extend`` only checks the connection). A
worker that dies or is cut off has its transaction rolled back by the server: at once when the
socket closes (a SIGKILL, a crash), after the TCP keepalive probes (set on both ends of every
connection, see :data:`KEEPALIVES`) when the network goes silent.

Table (name configurable, created on first use unless ``create_table=False``; ``celery
idempotency sql`` prints the DDL): one row per key with its state, result, fingerprint,
fencing token and ``expires_at``. Fencing tokens come from one sequence: ``nextval`` is never
rolled back, and it is called only after the row lock is taken, so tokens strictly increase
across the successive holders of a key, also across rollbacks and record expiry.

Expired rows are replaced in place by the next claim of their key; the others are deleted by
a bounded sweep that runs at most once per ``cleanup_interval`` per process, after a commit:
``DELETE ... WHERE ctid = ANY(ARRAY(SELECT ctid ... WHERE expires_at < now() ORDER BY
expires_at LIMIT n FOR UPDATE SKIP LOCKED))``, which walks the ``expires_at`` index, touches
at most ``n`` rows and skips rows a claim holds: never a full-table scan on the hot path.

Round trips (psycopg pipeline mode): a first execution costs 1 to claim (BEGIN, lock, token and
record look-up in one flight) and 1 to commit (UPDATE and COMMIT in one flight): the same two a
plain ``BEGIN ... COMMIT`` transaction costs with psycopg, which sends BEGIN on its own. A
duplicate of a completed key costs 2 (claim, ROLLBACK).
"""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit

from celery_idempotent.backends.postgres.backend import PostgresBackend
from celery_idempotent.backends.postgres.connections import KEEPALIVES, split_url
from celery_idempotent.backends.postgres.django_backend import DjangoBackend
from celery_idempotent.backends.postgres.sql import DEFAULT_TABLE, ddl
from celery_idempotent.setting_checks import POSTGRES_SCHEMES

__all__ = [
    "DEFAULT_TABLE",
    "KEEPALIVES",
    "POSTGRES_SCHEMES",
    "DjangoBackend",
    "PostgresBackend",
    "backend_from_url",
    "ddl",
]


def backend_from_url(
    url: str, *, serializer: str = "json", accept: Iterable[str] | None = ("json",)
) -> PostgresBackend:
    """The PostgreSQL backend an ``idempotency_url`` of this module's schemes stands for
    (``django://`` as PostgreSQL: :func:`celery_idempotent.backends.sql_backend_from_url` picks
    the MySQL backend for ``mysql://`` and ``django://`` on Django's MySQL engine)."""
    if url.startswith("mysql://"):
        raise ValueError(
            "a mysql:// URL is the MySQL backend's: build it with "
            "celery_idempotent.backends.sql_backend_from_url (or backends.mysql.backend_from_url)"
        )
    if url.startswith("django://"):
        rest, options = split_url(url)
        alias = urlsplit(rest).netloc or "default"
        return DjangoBackend(
            alias,
            table=options.get("table"),
            lock_timeout=options.get("lock_timeout"),
            serializer=serializer,
            accept=accept,
        )
    if url.startswith("postgres://"):
        url = "postgresql://" + url[len("postgres://") :]
    return PostgresBackend(url, serializer=serializer, accept=accept)
