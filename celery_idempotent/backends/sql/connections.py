"""What a guarded SQL transaction is, whichever the dialect: its connection and how it ends.

:class:`Transaction` is one open lease's transaction (the dialects' transactions classes make
and end them), :class:`Rollback` ends a Django ``atomic`` block by rolling it back,
:func:`ended_by_body` is the error of a commit refused because the body ended the transaction
itself, :func:`split_url` takes the backend's own query parameters off an SQL URL.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from celery_idempotent.core.exceptions import IdempotencyBackendError
from celery_idempotent.core.protocols import Lease

__all__ = ["OURS", "Rollback", "Transaction", "ended_by_body", "split_url"]


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
