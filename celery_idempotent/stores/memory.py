"""An in-process store: for tests and for one process with many threads."""

from __future__ import annotations

import heapq
import threading
import time
from collections.abc import Callable

from celery_idempotent.protocols import IdempotencyRecord
from celery_idempotent.validate import check_duration

__all__ = ["MemoryIdempotencyStore"]


class MemoryIdempotencyStore:
    """Records with a TTL on an injectable clock; thread-safe.

    Results are kept as the objects the body returned (no serialization), so a replay returns
    the very same object. Expired records are dropped as new ones are stored, so memory stays
    bounded under an endless stream of distinct keys.
    """

    def __init__(self, *, clock: Callable[[], float] = time.monotonic) -> None:
        if not callable(clock):
            raise TypeError(f"clock must be callable, not {type(clock).__name__} ({clock!r})")
        self._clock = clock
        self._lock = threading.Lock()
        self._records: dict[str, tuple[IdempotencyRecord, float]] = {}
        self._expiry: list[tuple[float, int, str]] = []  # (expires_at, seq, key)
        self._seq = 0

    def get(self, key: str) -> IdempotencyRecord | None:
        """The record under ``key`` unless it has expired."""
        with self._lock:
            entry = self._records.get(key)
            if entry is None:
                return None
            if entry[1] <= self._clock():
                del self._records[key]
                return None
            return entry[0]

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        """Store ``record`` under ``key`` for ``ttl`` seconds, replacing any earlier one."""
        ttl = check_duration("ttl", ttl)
        with self._lock:
            now = self._clock()
            self._sweep(now)
            expires_at = now + ttl
            self._records[key] = (record, expires_at)
            self._seq += 1
            heapq.heappush(self._expiry, (expires_at, self._seq, key))

    def delete(self, key: str) -> bool:
        """Remove the record under ``key``; ``True`` when there was an unexpired one."""
        with self._lock:
            entry = self._records.pop(key, None)
            return entry is not None and entry[1] > self._clock()

    def clear(self) -> None:
        """Drop every record."""
        with self._lock:
            self._records.clear()
            self._expiry.clear()

    def __len__(self) -> int:
        """How many records are kept now (expired ones not yet swept may count)."""
        return len(self._records)

    def _sweep(self, now: float) -> None:
        expiry = self._expiry
        records = self._records
        while expiry and expiry[0][0] <= now:
            expires_at, _, key = heapq.heappop(expiry)
            entry = records.get(key)
            if entry is not None and entry[1] == expires_at:
                del records[key]
        # A key overwritten many times leaves stale heap entries; rebuild when they dominate.
        if len(expiry) > 2 * len(records) + 1024:
            self._expiry = [(exp, i, k) for i, (k, (_, exp)) in enumerate(records.items())]
            heapq.heapify(self._expiry)
            self._seq = len(self._expiry)
