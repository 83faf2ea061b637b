"""An in-process lock provider: for tests and for one process with many threads."""

from __future__ import annotations

import heapq
import itertools
import secrets
import threading
import time
from collections.abc import Callable

from celery_idempotent.protocols import Lease
from celery_idempotent.validate import check_duration

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
        # resource -> (token, expires_at)
        self._held: dict[str, tuple[str, float]] = {}
        self._expiry: list[tuple[float, str, str]] = []  # (expires_at, resource, token)
        self._fence = itertools.count(1)

    def acquire(self, resource: str, ttl: float) -> Lease | None:
        """Take ``resource`` for ``ttl`` seconds; ``None`` while another live lease holds it."""
        ttl = check_duration("ttl", ttl)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            held = self._held.get(resource)
            if held is not None and held[1] > now:
                return None
            token = secrets.token_hex(16)
            expires_at = now + ttl
            self._held[resource] = (token, expires_at)
            heapq.heappush(self._expiry, (expires_at, resource, token))
            return Lease(resource=resource, token=token, fencing_token=next(self._fence))

    def extend(self, lease: Lease, ttl: float) -> bool:
        """Give the lease ``ttl`` more seconds from now, if it still holds the lock."""
        ttl = check_duration("ttl", ttl)
        with self._lock:
            now = self._clock()
            if not self._holds(lease, now):
                return False
            expires_at = now + ttl
            self._held[lease.resource] = (lease.token, expires_at)
            heapq.heappush(self._expiry, (expires_at, lease.resource, lease.token))
            return True

    def release(self, lease: Lease) -> bool:
        """Release the lock if ``lease`` still holds it; a stale lease changes nothing."""
        with self._lock:
            if not self._holds(lease, self._clock()):
                return False
            del self._held[lease.resource]
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
            self._expiry.clear()

    def __len__(self) -> int:
        """How many resources are held now (expired ones not yet swept may count)."""
        return len(self._held)

    def _holds(self, lease: Lease, now: float) -> bool:
        held = self._held.get(lease.resource)
        return held is not None and held[0] == lease.token and held[1] > now

    def _sweep(self, now: float) -> None:
        # Each heap entry is one (resource, token, expiry) the map once had; it is dropped from
        # the map only if the map still says exactly that (a later extend pushed a newer entry).
        expiry = self._expiry
        while expiry and expiry[0][0] <= now:
            expires_at, resource, token = heapq.heappop(expiry)
            if self._held.get(resource) == (token, expires_at):
                del self._held[resource]
        # Released locks and extensions leave stale heap entries; rebuild when they dominate.
        if len(expiry) > 2 * len(self._held) + 1024:
            self._expiry = [(exp, res, tok) for res, (tok, exp) in self._held.items()]
            heapq.heapify(self._expiry)
