"""What a guarded SQL transaction is, whichever the dialect: its connection and how it ends.

:class:`ConnectionPool` is the per-process pool of idle connections under each dialect's
transactions class, :class:`Transaction` is one open lease's transaction (the dialects'
transactions classes make and end them), :class:`Rollback` ends a Django ``atomic`` block by
rolling it back,
:func:`ended_by_body` is the error of a commit refused because the body ended the transaction
itself, :func:`split_url` takes the backend's own query parameters off an SQL URL.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from celery_idempotent.core.exceptions import IdempotencyBackendError
from celery_idempotent.core.protocols import Lease

__all__ = ["OURS", "ConnectionPool", "Rollback", "Transaction", "ended_by_body", "split_url"]

log = logging.getLogger("celery_idempotent")


class Rollback(Exception):
    """Passed to a transaction block's ``__exit__`` to make it roll back."""


class Transaction:
    """One open guarded transaction (a lease): its connection and how to end it."""

    __slots__ = ("block", "conn", "key", "lease", "lent", "pid", "raw", "xid")

    def __init__(self, conn: Any, block: Any, key: str, raw: Any) -> None:
        self.conn = conn
        self.block = block
        self.key = key
        self.lease: Lease | None = None
        self.raw = raw  # the psycopg connection (conn itself, or under Django's wrapper)
        self.pid: int | None = raw.info.backend_pid if raw is not None else None
        #: the transaction id the claim was made in (the body must end in the same one)
        self.xid: int | None = None
        #: whether the body was handed the connection (current_connection()): then whatever
        #: session state it left is reset before the connection is pooled again
        self.lent = False


class ConnectionPool:
    """A per-process pool of at most ``max_idle`` idle connections, the table made sure of
    (created unless ``create_table=False``) on the first connection; the base of each
    dialect's transactions class, which says how to connect (:meth:`_connect`), whether a
    connection may be pooled again (:meth:`_reusable`), how to close one (:meth:`_close`) and
    how to make sure of the table (:meth:`_ensure_table`).

    After a fork the parent's connections are never used nor closed in the child (nor its
    open transactions): the first :meth:`_get` there starts afresh.
    """

    url: str | None
    table: str
    create_table: bool
    max_idle: int

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._ddl_lock = threading.Lock()
        self._idle: list[Any] = []
        self._pid = os.getpid()
        self._ready = False
        self._open: dict[str, Transaction] = {}

    def _connect(self) -> Any:
        """A new connection (``ConnectionError`` when the server cannot be reached)."""
        raise NotImplementedError

    def _reusable(self, conn: Any) -> bool:
        """Whether ``conn`` is open, healthy and outside any transaction."""
        raise NotImplementedError

    def _close(self, conn: Any) -> None:
        """Close ``conn`` (a failure to is only logged)."""
        raise NotImplementedError

    def _ensure_table(self, conn: Any) -> None:
        """Make sure the table exists on ``conn``'s server, then set ``_ready``."""
        raise NotImplementedError

    def _get(self) -> Any:
        with self._lock:
            if self._pid != os.getpid():
                # Connections made before a fork belong to the parent: never use or close
                # them here (psycopg itself does not end a connection of another process
                # when it is garbage collected: tests/postgres/test_postgres_backend.py).
                self._idle = []
                self._open = {}
                self._pid = os.getpid()
            conn = self._idle.pop() if self._idle else None
        if conn is None:
            conn = self._connect()
        if not self._ready:
            with self._ddl_lock:
                if not self._ready:
                    try:
                        self._ensure_table(conn)
                    except BaseException:
                        conn.close()
                        raise
        return conn

    def _put(self, conn: Any) -> None:
        if self._reusable(conn) and self._pid == os.getpid():
            with self._lock:
                if len(self._idle) < self.max_idle:
                    self._idle.append(conn)
                    return
        self._close(conn)

    def close(self) -> None:
        """Close the idle connections (open transactions are left to their holders)."""
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            self._close(conn)


def ended_by_body(aborted: bool) -> Exception:
    """The error a commit is refused with when the body did not leave the guard's transaction
    as it found it (``aborted``: a statement of the body failed, and the body went on)."""
    if aborted:
        what = (
            "a statement of the body failed and aborted the guard's transaction, and the body "
            "carried on (the error was caught): PostgreSQL will commit none of it"
        )
    else:
        what = (
            "the body ended the guard's transaction itself (a COMMIT or ROLLBACK sent on "
            "current_connection(), raw SQL or a driver call): what it wrote before that was "
            "committed or rolled back without the record, and the key's row lock was released "
            "while the body still ran"
        )
    return IdempotencyBackendError(
        None, f"{what}; the record is not committed and the key is free to run again"
    )


OURS = ("table", "lock_timeout")


def split_url(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without this backend's own query parameters, and those parameters."""
    parts = urlsplit(url)
    query = parse_qsl(parts.query, keep_blank_values=True)
    ours = {k: v for k, v in query if k in OURS}
    rest = [(k, v) for k, v in query if k not in OURS]
    # quote, not quote_plus: libpq reads '+' in a URI as a plus sign, not a space, so
    # '?options=-c%20work_mem%3D3MB' must not come out as '-c+work_mem=3MB'.
    return urlunsplit(parts._replace(query=urlencode(rest, quote_via=quote))), ours
