"""Lease renewal: one daemon thread per process keeps every running body's lease alive.

A thread per guarded call would cost a thread start on the hot path; one keeper with a heap of
due renewals costs a heap push. Renewals happen every ``interval`` seconds (a third of the lease
by default), so two renewals can fail in a row before a lease runs out.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import os
import threading
import time

from celery_idempotent.protocols import Lease, LockProvider

__all__ = ["LeaseKeeper", "Renewal", "keeper"]

log = logging.getLogger("celery_idempotent")

#: Stopped renewals wait in the heap until the keeper wakes; past this many it is woken to
#: drop them, so that a high call rate with a long interval does not pile them up.
_DRAIN_AT = 4096


class Renewal:
    """One lease being kept alive. ``lost`` turns true when the lease is known (or must be
    assumed) gone: the provider said it is not ours, or renewals failed until it expired."""

    __slots__ = ("cancelled", "deadline", "error", "interval", "lease", "lost", "provider", "ttl")

    def __init__(self, provider: LockProvider, lease: Lease, ttl: float, interval: float) -> None:
        self.provider = provider
        self.lease = lease
        self.ttl = ttl
        self.interval = interval
        # Local estimate of when the lease runs out if no renewal succeeds; the server's TTL is
        # what counts, this only decides when to stop hoping after errors.
        self.deadline = time.monotonic() + ttl
        self.lost = False
        self.cancelled = False
        self.error: BaseException | None = None


class LeaseKeeper:
    """Runs due renewals on one daemon thread, started on first use (and again after fork)."""

    def __init__(self) -> None:
        self._cond = threading.Condition(threading.Lock())
        self._heap: list[tuple[float, int, Renewal]] = []
        self._seq = itertools.count()
        self._thread: threading.Thread | None = None
        # When the keeper, waiting, will wake up by itself; 0 while it is not waiting (it
        # looks at the heap again before it waits).
        self._wake_at = 0.0

    def keep(self, provider: LockProvider, lease: Lease, ttl: float, interval: float) -> Renewal:
        """Start renewing ``lease`` every ``interval`` seconds, each time for ``ttl`` seconds."""
        renewal = Renewal(provider, lease, ttl, interval)
        due = time.monotonic() + interval
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), renewal))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="celery-idempotent-lease-keeper", daemon=True
                )
                self._thread.start()
            elif due < self._wake_at or (
                len(self._heap) > _DRAIN_AT and self._heap[0][2].cancelled
            ):
                # Only when the keeper would sleep past this renewal, or to drop a pile of
                # stopped ones: waking it for every guarded call costs a thread switch each.
                self._cond.notify()
        return renewal

    @staticmethod
    def stop(renewal: Renewal) -> None:
        """Stop renewing; the entry is dropped from the heap when it comes due."""
        renewal.cancelled = True

    def _run(self) -> None:
        heap = self._heap
        while True:
            with self._cond:
                while True:
                    # Drop the stopped renewals on top. When that empties the heap, sleep until
                    # the last one dropped would have been due rather than until woken: the
                    # renewals started meanwhile (same interval, so due later) then need no
                    # notify, and a stream of short guarded calls wakes the keeper about once
                    # per interval instead of once per call.
                    dropped_due = 0.0
                    while heap and heap[0][2].cancelled:
                        dropped_due = heapq.heappop(heap)[0]
                    now = time.monotonic()
                    if heap:
                        wake_at = heap[0][0]
                        if wake_at <= now:
                            renewal = heapq.heappop(heap)[2]
                            break
                    elif dropped_due > now:
                        wake_at = dropped_due
                    else:
                        wake_at = now + 30.0
                    self._wake_at = wake_at
                    try:
                        self._cond.wait(wake_at - now)
                    finally:
                        self._wake_at = 0.0
            self._renew(renewal)

    def _renew(self, renewal: Renewal) -> None:
        now = time.monotonic()
        try:
            ours = renewal.provider.extend(renewal.lease, renewal.ttl)
        except Exception as exc:  # the backend's failure: try again until the lease runs out
            renewal.error = exc
            if time.monotonic() >= renewal.deadline:
                renewal.lost = True
                log.warning(
                    "lease %s lost: renewals failed until it expired", renewal.lease.resource
                )
                return
            log.warning("lease renewal of %s failed (%r); retrying", renewal.lease.resource, exc)
            next_due = now + min(renewal.interval, max(renewal.deadline - now, 0.0) / 2 + 0.01)
        else:
            if not ours:
                renewal.lost = True
                return
            renewal.deadline = now + renewal.ttl
            next_due = now + renewal.interval
        if renewal.cancelled:
            return
        with self._cond:
            heapq.heappush(self._heap, (next_due, next(self._seq), renewal))


_keeper = LeaseKeeper()


def keeper() -> LeaseKeeper:
    """The process's keeper."""
    return _keeper


def _reset_after_fork() -> None:
    # The keeper thread does not survive fork, and its condition may have been held by it.
    global _keeper  # noqa: PLW0603 - the one process-wide keeper is replaced in the child
    _keeper = LeaseKeeper()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
