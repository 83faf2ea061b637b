"""The registry of open guarded transactions, behind :func:`current_connection`.

Kept apart from :mod:`celery_idempotent.backends.postgres` so that importing the package (and
calling ``current_connection()`` in a body guarded by another backend) never imports psycopg.
"""

from __future__ import annotations

from typing import Any

from celery_idempotent.core.guard import current_lease

__all__ = ["current_connection", "lent", "register", "unregister"]

#: lease token -> the connection whose transaction the lease is (one entry per running body).
_OPEN: dict[str, Any] = {}


def register(token: str, connection: Any) -> None:
    _OPEN[token] = connection


#: lease tokens whose connection :func:`current_connection` has handed to the body: only those
#: connections can carry session state the body left (the backend resets them before reuse).
_LENT: set[str] = set()


def unregister(token: str) -> Any:
    _LENT.discard(token)
    return _OPEN.pop(token, None)


def lent(token: str) -> bool:
    """Whether the body of the lease ``token`` has been handed its connection."""
    return token in _LENT


def current_connection() -> Any:
    """The connection of the transaction the current guarded body runs in, or ``None``.

    With the PostgreSQL backend (``idempotency_url = "postgresql://..."``) it is a psycopg 3
    ``Connection`` whose transaction holds the key's row lock and will commit the body's
    record: whatever the body writes through it commits together with the record, or not at
    all. With ``django://<alias>`` it is Django's ``connections[alias]`` (the ORM uses it
    anyway). Outside a guarded body, or under a backend without transactions (Redis,
    memory), it is ``None``.

    Do not commit or roll back this transaction yourself (psycopg and Django refuse it inside
    the guard's transaction block); use nested ``conn.transaction()`` / ``atomic()`` blocks,
    which become savepoints. A body that ends it anyway (raw ``COMMIT`` / ``ROLLBACK`` SQL)
    has its commit refused (``LockLostError`` saying so; nothing recorded). Session state the
    body leaves on a pooled psycopg connection (``SET``, ``SET ROLE``, temporary tables,
    advisory locks, prepared statements, cursors) is reset before the connection is reused.
    """
    lease = current_lease()
    if lease is None:
        return None
    connection = _OPEN.get(lease.token)
    if connection is not None:
        _LENT.add(lease.token)
    return connection
