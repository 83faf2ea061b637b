"""An in-process store: for tests and for one process with many threads."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from celery_idempotent.backends.memory.expiring import ExpiringMap
from celery_idempotent.core.protocols import IdempotencyRecord
from celery_idempotent.core.validate import check_duration

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
        self._records: ExpiringMap[IdempotencyRecord] = ExpiringMap()

    def get(self, key: str) -> IdempotencyRecord | None:
        """The record under ``key`` unless it has expired."""
        with self._lock:
            entry = self._records.get(key)
            if entry is None:
                return None
            if entry[1] <= self._clock():
                self._records.pop(key)
                return None
            return entry[0]

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        """Store ``record`` under ``key`` for ``ttl`` seconds, replacing any earlier one."""
        ttl = check_duration("ttl", ttl)
        with self._lock:
            now = self._clock()
            self._records.sweep(now)
            self._records.put(key, record, now + ttl)

    def delete(self, key: str) -> bool:
        """Remove the record under ``key``; ``True`` when there was an unexpired one."""
        with self._lock:
            entry = self._records.pop(key)
            return entry is not None and entry[1] > self._clock()

    def clear(self) -> None:
        """Drop every record."""
        with self._lock:
            self._records.clear()

    def __len__(self) -> int:
        """How many records are kept now (expired ones not yet swept may count)."""
        return len(self._records)
