"""A map whose entries expire: what the in-process lock provider and store keep their state in."""

from __future__ import annotations

import heapq
from typing import Generic, TypeVar

__all__ = ["ExpiringMap"]

V = TypeVar("V")


class ExpiringMap(Generic[V]):
    """``name -> (value, expires_at)``, with the expired entries dropped by :meth:`sweep`.

    A heap of expiry times makes a sweep cost only the entries that have expired, so memory
    stays bounded under an endless stream of distinct names. Each heap entry is one expiry an
    entry once had; the entry is dropped only if it still has that expiry (a later
    :meth:`put` of the same name pushed a newer one). Not thread-safe: the owner holds its
    own lock around every call.
    """

    def __init__(self) -> None:
        self._entries: dict[str, tuple[V, float]] = {}
        self._heap: list[tuple[float, int, str]] = []  # (expires_at, seq, name)
        self._seq = 0

    def get(self, name: str) -> tuple[V, float] | None:
        """``(value, expires_at)`` of ``name``, expired or not, or ``None``."""
        return self._entries.get(name)

    def put(self, name: str, value: V, expires_at: float) -> None:
        """Set ``name`` to ``value`` until ``expires_at``, replacing what it had."""
        self._entries[name] = (value, expires_at)
        self._seq += 1
        heapq.heappush(self._heap, (expires_at, self._seq, name))

    def pop(self, name: str) -> tuple[V, float] | None:
        """Remove ``name``; what it had, or ``None``."""
        return self._entries.pop(name, None)

    def sweep(self, now: float) -> None:
        """Drop the entries that expired at or before ``now``."""
        heap, entries = self._heap, self._entries
        while heap and heap[0][0] <= now:
            expires_at, _, name = heapq.heappop(heap)
            entry = entries.get(name)
            if entry is not None and entry[1] == expires_at:
                del entries[name]
        # Names replaced or removed leave stale heap entries; rebuild when they dominate.
        if len(heap) > 2 * len(entries) + 1024:
            self._heap = [(exp, i, name) for i, (name, (_, exp)) in enumerate(entries.items())]
            heapq.heapify(self._heap)
            self._seq = len(self._heap)

    def clear(self) -> None:
        """Drop every entry."""
        self._entries.clear()
        self._heap.clear()

    def heap_size(self) -> int:
        """How many expiry times are waiting in the heap (stale ones included)."""
        return len(self._heap)

    def __len__(self) -> int:
        """How many entries there are (expired ones not yet swept count)."""
        return len(self._entries)
