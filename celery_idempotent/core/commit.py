"""The commit of a lease: sent again after a lost reply until it is confirmed, then judged.

A connection error leaves a commit's outcome open: the request may have reached the server and
only its reply been lost. A commit is safe to send again (the backend answers "stored" when
this lease's record is already there, "not the holder" otherwise), so it is sent again with
back-off (:data:`COMMIT_RESEND`) for up to ``lock_ttl`` seconds before its outcome is reported
unknown::

    commit ──stored──> done (the lock released with it)
      ├── not the holder ──> LockLostError (nothing stored)
      ├── refused (a backend error, not a lost reply) ──> LockLostError (nothing stored)
      ├── reply lost ──> back off, send it again ... for lock_ttl ──> CommitUnknownError
      └── lease lost after a write whose reply was lost (two steps) ──> CommitUnknownError
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from celery_idempotent.core import renewal
from celery_idempotent.core.backoff import ExponentialJitterBackoff, Sleep
from celery_idempotent.core.exceptions import (
    CommitUnknownError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    LockLostError,
)
from celery_idempotent.core.fingerprint import key_digest
from celery_idempotent.core.protocols import AtomicBackend, IdempotencyRecord, Lease
from celery_idempotent.core.two_step import backend_call

__all__ = ["COMMIT_RESEND", "commit_lease"]

log = logging.getLogger("celery_idempotent")

#: Between resends of a commit whose reply was lost: 0.05 s, doubling, at most 1 s, no jitter
#: (one caller, nobody to fall out of step with).
COMMIT_RESEND = ExponentialJitterBackoff(0.05, 1.0, jitter="none")


def commit_lease(
    backend: AtomicBackend,
    key: str,
    rkey: str,
    lease: Lease,
    record: IdempotencyRecord,
    *,
    ttl: float,
    lock_ttl: float,
    sleep: Sleep,
    kept: renewal.Renewal | None,
    lost: Callable[[], None],
) -> None:
    """Store ``record`` under ``rkey`` for ``ttl`` seconds and release the lock, while
    ``lease`` still holds it; returns once stored. Otherwise ``lost()`` is called and
    :class:`LockLostError` or :class:`CommitUnknownError` raised (``result``: the body's).
    ``kept`` is the lease's renewal, whose loss the keeper may have logged already."""
    waited, resends = 0.0, 0
    unknown: CommitUnknownError | None = None
    while True:
        try:
            ok = backend_call(key, "commit", backend.commit, lease, rkey, record, ttl)
            break
        except CommitUnknownError as exc:
            # A two-step backend lost the lease after a write whose reply was lost.
            ok, unknown = False, exc
            break
        except IdempotencyConnectionError as exc:
            if waited >= lock_ttl:
                lost()
                raise CommitUnknownError(
                    key,
                    record.result,
                    f"the commit could not be confirmed for {waited:.1f}s ({exc}): the "
                    "result may or may not be stored; look it up before compensating",
                ) from exc
            log.warning(
                "commit of key #%s unconfirmed (%s); sending it again", key_digest(key), exc
            )
            delay = COMMIT_RESEND.delay(resends)
            sleep(delay, None)
            waited += delay
            resends += 1
        except IdempotencyBackendError as exc:
            # The backend refused the commit (not a lost reply): nothing was stored. The
            # body's side effects happened, so the caller still gets its result.
            log.warning(
                "celery-idempotent: commit of key #%s refused by the backend (%s); its "
                "result is not committed",
                key_digest(key),
                exc,
            )
            lost()
            raise LockLostError(
                key, record.result, f"the commit failed: {exc}; the result is not stored"
            ) from exc
    if ok:
        return
    cause = "the commit found the lock no longer held by this lease (ran out or taken)"
    if kept is None or renewal.claim_report(kept):
        log.warning(
            "celery-idempotent: lease of key #%s (fencing token %s) lost: %s; its result "
            "is not committed",
            key_digest(key),
            lease.fencing_token,
            cause,
        )
    lost()
    if unknown is not None:
        raise CommitUnknownError(key, record.result, unknown.message) from None
    raise LockLostError(key, record.result, f"lease lost: {cause}; not committed")
