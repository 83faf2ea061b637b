"""A lock provider and a store that cannot decide together, as one :class:`AtomicBackend`.

The guard claims and commits through one :class:`~celery_idempotent.core.protocols.AtomicBackend`
whatever the backends. A store that shares a server with the lock provider offers its own
(``atomic_with``: one Redis script, one PostgreSQL transaction); any other pair, a store and a
lock of your own, the memory backends, a Redis store and lock on two servers, is wrapped in a
:class:`TwoStepBackend`, which makes the same two decisions in separate calls::

    claim   acquire the lock ──held──> neither
              └── ours: get the record ──found──> release the lock, return the record
                                  └── none ──> return the lease
    commit  extend the lease (the proof) ──lost──> False (nothing written)
              └── ours: set the record ──> release the lock ──> True

A commit whose reply was lost is sent again by the guard. Between two separate calls nothing
is atomic, so a resend looks before it writes: a record already there with this lease's
fencing token means the first write landed. A resend that finds the lease gone after such a
write cannot tell whether the write landed: :class:`CommitUnknownError`, not ``False``.
"""

from __future__ import annotations

import logging
import time
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

from celery_idempotent.core.exceptions import (
    CommitUnknownError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyError,
)
from celery_idempotent.core.fingerprint import key_digest
from celery_idempotent.core.protocols import (
    Claim,
    IdempotencyRecord,
    IdempotencyStore,
    Lease,
    LockProvider,
)

__all__ = ["TwoStepBackend", "backend_call", "release_quietly"]

T = TypeVar("T")
log = logging.getLogger("celery_idempotent")


def backend_call(key: str, op: str, method: Callable[..., T], *args: Any) -> T:
    """``method(*args)``, its failures as the library's: an :class:`IdempotencyError` for
    another key is re-keyed to ``key``, a connection failure or timeout becomes
    :class:`IdempotencyConnectionError`, anything else :class:`IdempotencyBackendError`
    (``"<op> failed: ..."``, the original chained)."""
    try:
        return method(*args)
    except IdempotencyError as exc:
        if exc.key == key:
            raise
        raise exc.with_key(key) from (exc.__cause__ or exc)
    except (ConnectionError, TimeoutError) as exc:
        raise IdempotencyConnectionError(key, f"{op} failed: {exc!r}") from exc
    except Exception as exc:
        raise IdempotencyBackendError(key, f"{op} failed: {exc!r}") from exc


class TwoStepBackend:
    """``lock_provider`` and ``store`` as one
    :class:`~celery_idempotent.core.protocols.AtomicBackend`: claim is acquire then get, commit is
    set while the lease holds then release.

    ``lock_ttl`` is the lease's length: a commit extends the lease by that much before it
    writes (so that the write lands inside the lease), and refuses to write when that proof
    took a whole lease to come back (by ``monotonic``).
    """

    def __init__(
        self,
        lock_provider: LockProvider,
        store: IdempotencyStore,
        lock_ttl: float,
        *,
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
        self.lock_provider = lock_provider
        self.store = store
        self.lock_ttl = lock_ttl
        self._monotonic = monotonic
        # The leases whose record write was sent and not confirmed (its reply lost): a resend
        # looks before it writes again. Weak: an entry goes with its lease when the guard's
        # call ends, however it ends. Each lease is one thread's, so no lock is needed.
        self._unconfirmed: weakref.WeakKeyDictionary[Lease, bool] = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.lock_provider!r}, {self.store!r})"

    def claim(self, resource: str, key: str, ttl: float) -> Claim:
        """Acquire ``resource`` for ``ttl`` seconds, then look ``key``'s record up: the lease
        when there is none, else the record (the lock given back); neither when held."""
        lease = backend_call(key, "lock acquire", self.lock_provider.acquire, resource, ttl)
        if lease is None:
            return Claim(None, None)
        try:
            record = backend_call(key, "store get", self.store.get, key)
        except BaseException:
            self._give_back(key, lease)
            raise
        if record is None:
            return Claim(lease, None)
        self._give_back(key, lease)
        return Claim(None, record)

    def commit(self, lease: Lease, key: str, record: IdempotencyRecord, ttl: float) -> bool:
        """Store ``record`` for ``ttl`` seconds (``0``: store nothing) while ``lease`` provably
        holds the lock, then release it. ``False`` when the lease is no longer held (nothing
        written); :class:`CommitUnknownError` when it was lost after a write whose reply was
        lost."""
        resent = bool(self._unconfirmed) and lease in self._unconfirmed
        # Prove the lease (and give it a full lock_ttl for the write) right before writing,
        # and write only while that proof holds.
        proved = self._monotonic()
        if not backend_call(key, "lock extend", self.lock_provider.extend, lease, self.lock_ttl):
            if resent:
                # An earlier write's reply was lost, so it may have landed even though the
                # lease is gone now. "Not stored" would be a guess.
                raise CommitUnknownError(
                    key,
                    None,
                    "the lease was lost after a write of the record whose outcome is unknown: "
                    "the result may or may not be stored; look it up before compensating",
                )
            return False
        if resent:
            # The first write may have landed, its reply lost. Writing again would replace
            # the record (and its TTL); look first.
            found = backend_call(key, "store get", self.store.get, key)
            if found is not None and found.fencing_token == lease.fencing_token:
                self._unconfirmed.pop(lease, None)
                self._give_back(key, lease)
                return True
        if not ttl:
            # idempotency_ttl=0: nothing is kept; the proven lease is given back, the key free.
            self._give_back(key, lease)
            return True
        if self._monotonic() - proved >= self.lock_ttl:
            # The proof's reply (or the look-up) came back after a whole lease: the lease may
            # have run out since, and the write must not land after it. Prove it again.
            raise IdempotencyConnectionError(
                key, f"the lease proof took longer than the lease ({self.lock_ttl}s)"
            )
        try:
            backend_call(key, "store set", self.store.set, key, record, ttl)
        except IdempotencyConnectionError:
            self._unconfirmed[lease] = True  # it may have landed: the guard sends it again
            raise
        if resent:
            self._unconfirmed.pop(lease, None)
        self._give_back(key, lease)
        return True

    def _give_back(self, key: str, lease: Lease) -> None:
        release_quietly(self.lock_provider, lease, key)


def release_quietly(lock_provider: LockProvider, lease: Lease, key: str) -> None:
    """Release ``lease``; a failure is logged (naming ``key`` by its digest), never raised:
    it must not mask what was decided, and the lease expires on its own."""
    try:
        lock_provider.release(lease)
    except Exception as exc:
        log.warning(
            "could not release the lock of key #%s (%r); it expires by itself",
            key_digest(key),
            exc,
        )
