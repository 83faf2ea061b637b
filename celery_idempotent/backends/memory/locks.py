"""An in-process lock provider: for tests and for one process with many threads."""

from __future__ import annotations

import itertools
import secrets
import threading
import time
from collections.abc import Callable

from celery_idempotent.backends.memory.expiring import ExpiringMap
from celery_idempotent.core.protocols import Lease
from celery_idempotent.core.validate import check_duration

__all__ = ["MemoryLockProvider"]


class MemoryLockProvider:
    """A lock map with TTL expiry on an injectable clock; thread-safe.

    Every acquisition gets its own random token, and only the lease carrying it may extend or
    release the lock. Fencing tokens come from one counter shared by all resources, so they
    strictly increase per resource without keeping a counter for every resource ever locked.
    Expired locks are swept as new ones are taken, so memory stays bounded.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not callable(clock):
            raise TypeError(f"clock must be callable, not {type(clock).__name__} ({clock!r})")
        self._clock = clock
        self._lock = threading.Lock()
        self._held: ExpiringMap[str] = ExpiringMap()  # resource -> (token, expires_at)
        self._fence = itertools.count(1)

    def acquire(self, resource: str, ttl: float) -> Lease | None:
        """Take ``resource`` for ``ttl`` seconds; ``None`` while another live lease holds it."""
        ttl = check_duration("ttl", ttl)
        with self._lock:
            now = self._clock()
            self._held.sweep(now)
            held = self._held.get(resource)
            if held is not None and held[1] > now:
                return None
            token = secrets.token_hex(16)
            self._held.put(resource, token, now + ttl)
            return Lease(resource=resource, token=token, fencing_token=next(self._fence))

    def extend(self, lease: Lease, ttl: float) -> bool:
        """Give the lease ``ttl`` more seconds from now, if it still holds the lock."""
        ttl = check_duration("ttl", ttl)
        with self._lock:
            now = self._clock()
            if not self._holds(lease, now):
                return False
            self._held.put(lease.resource, lease.token, now + ttl)
            return True

    def release(self, lease: Lease) -> bool:
        """Release the lock if ``lease`` still holds it; a stale lease changes nothing."""
        with self._lock:
            if not self._holds(lease, self._clock()):
                return False
            self._held.pop(lease.resource)
            return True

    def is_locked(self, resource: str) -> bool:
        """Whether an unexpired lease holds ``resource``."""
        with self._lock:
            held = self._held.get(resource)
            return held is not None and held[1] > self._clock()

    def clear(self) -> None:
        """Forget every lock (fencing tokens keep increasing)."""
        with self._lock:
            self._held.clear()

    def __len__(self) -> int:
        """How many resources are held now (expired ones not yet swept may count)."""
        return len(self._held)

    def _holds(self, lease: Lease, now: float) -> bool:
        held = self._held.get(lease.resource)
        return held is not None and held[0] == lease.token and held[1] > now
