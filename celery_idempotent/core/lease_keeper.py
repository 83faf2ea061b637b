"""The lease keeper: one thread that runs the due renewals of every running body's lease.

A thread per guarded call would cost a thread start on the hot path; one keeper with a heap of
due renewals costs a heap push. :mod:`celery_idempotent.core.renewal` says which keeper a lease is
kept on and why; this module is the keeper itself (:class:`LeaseKeeper`), one lease being kept
(:class:`Renewal`), and the relay of the keeper's log lines to the event loop's side under
gevent/eventlet (:func:`flush_log`).
"""

from __future__ import annotations

import _thread
import collections
import heapq
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

from celery_idempotent.core import green
from celery_idempotent.core.protocols import Lease, LockProvider

__all__ = [
    "LeaseKeeper",
    "Renew",
    "Renewal",
    "claim_report",
    "flush_log",
    "start_log_relay",
]

log = logging.getLogger("celery_idempotent")

#: Stopped renewals wait in the heap until the keeper wakes; past this many it is woken to
#: drop them, so that a high call rate with a long interval does not pile them up.
_DRAIN_AT = 4096
#: The shortest wait for one renewal attempt, even when the local estimate says the lease has
#: run out: that estimate counts from when the last renewal was sent, so the server may still
#: hold it a round trip longer, and only the server can tell.
_MIN_ATTEMPT = 0.02
#: A renewal that runs later than this fraction of the lease is reported (once per lease).
_LATE_FRACTION = 0.5

Renew = Callable[[Lease, float, float], bool]


class Renewal:
    """One lease being kept alive. ``lost`` turns true when the lease is known (or must be
    assumed) gone: the provider said it is not ours, or renewals failed until it expired;
    ``cause`` then says which, in words."""

    __slots__ = (
        "cancelled",
        "cause",
        "confirmed",
        "deadline",
        "error",
        "failures",
        "interval",
        "label",
        "late_reported",
        "lease",
        "loss_reports",
        "lost",
        "provider",
        "renew",
        "ttl",
    )

    def __init__(  # noqa: PLR0917 - made in one place, by the keeper
        self,
        provider: LockProvider,
        lease: Lease,
        ttl: float,
        interval: float,
        renew: Renew | None = None,
        label: object = None,
    ) -> None:
        self.provider = provider
        self.lease = lease
        self.ttl = ttl
        self.interval = interval
        self.renew = renew
        self.label = label or f"lock {lease.resource}"
        now = time.monotonic()
        # Local estimate of when the lease runs out if no renewal succeeds (counted from when
        # the last successful renewal was sent, so never later than the server's PX).
        self.deadline = now + ttl
        self.confirmed = now
        self.lost = False
        self.cancelled = False
        self.error: BaseException | None = None
        self.cause: str | None = None
        self.failures = 0
        self.late_reported = False
        # next() on it is atomic: whoever draws 0 (keeper or guard) logs the loss.
        self.loss_reports = itertools.count()


class _NativeCondition:
    """A condition variable made of two plain (OS) locks; one waiter, the keeper thread."""

    def __init__(self, allocate_lock: Callable[[], Any]) -> None:
        self._mutex = allocate_lock()
        self._signal = allocate_lock()
        self._signal.acquire()  # held: not signalled

    def __enter__(self) -> None:
        self._mutex.acquire()

    def __exit__(self, *exc_info: object) -> None:
        self._mutex.release()

    def wait(self, timeout: float) -> None:
        """With the mutex held: release it, sleep until notified or ``timeout``, retake it."""
        self._mutex.release()
        try:
            self._signal.acquire(True, min(max(timeout, 0.0), 60.0))
        finally:
            self._mutex.acquire()

    def notify(self, n: int = 1) -> None:
        """With the mutex held: wake the waiter (or make its next wait return at once)."""
        if self._signal.locked():
            self._signal.release()


class LeaseKeeper:
    """Runs due renewals on one thread, started on first use (and again after fork).

    ``native=True`` (the default): a real OS thread with OS locks, also under gevent/eventlet.
    ``native=False``: ``threading`` as it is, i.e. a greenlet when the process is patched.
    """

    def __init__(self, *, native: bool = True) -> None:
        self.native = native
        self.natives = green.natives() if native else None
        if self.natives is not None:
            self._cond: Any = _NativeCondition(self.natives.allocate_lock)
        else:
            self._cond = threading.Condition(threading.Lock())
        # Under gevent/eventlet the OS thread must not call logging (see the module doc).
        self._relay = self.natives is not None and self.natives.runtime is not None
        self._heap: list[tuple[float, int, Renewal]] = []
        self._seq = itertools.count()
        self._running = False
        # When the keeper, waiting, will wake up by itself; 0 while it is not waiting (it
        # looks at the heap again before it waits).
        self._wake_at = 0.0

    def keep(
        self,
        provider: LockProvider,
        lease: Lease,
        ttl: float,
        interval: float,
        *,
        renew: Renew | None = None,
        label: object = None,
    ) -> Renewal:
        """Start renewing ``lease`` every ``interval`` seconds, each time for ``ttl`` seconds,
        with ``renew(lease, ttl, timeout)`` when given, else ``provider.extend(lease, ttl)``.
        ``label`` names the lease in log lines (anything ``str()`` turns into its name, worked
        out when a line is written)."""
        renewal = Renewal(provider, lease, ttl, interval, renew, label)
        due = time.monotonic() + interval
        with self._cond:
            heapq.heappush(self._heap, (due, next(self._seq), renewal))
            if not self._running:
                self._running = True
                try:
                    self._start()
                except BaseException:
                    self._running = False
                    raise
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

    def _start(self) -> None:
        if self.natives is not None:
            self.natives.start_new_thread(self._run, ())
        else:
            threading.Thread(
                target=self._run, name="celery-idempotent-lease-keeper", daemon=True
            ).start()

    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as exc:  # pragma: no cover - a bug; the next keep() restarts it
            self._log(logging.ERROR, "celery-idempotent lease keeper stopped: %r", exc)
            with self._cond:
                self._running = False
            raise

    def _loop(self) -> None:
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
                            due, _, renewal = heapq.heappop(heap)
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
            try:
                next_due = self._renew(renewal, due)
            except Exception as exc:  # pragma: no cover - never expected; keep the others alive
                self._lose(renewal, f"the keeper failed to renew it: {exc!r}")
                next_due = None
            if next_due is not None and not renewal.cancelled:
                with self._cond:
                    heapq.heappush(heap, (next_due, next(self._seq), renewal))

    def _renew(self, renewal: Renewal, due: float) -> float | None:
        """One renewal attempt; returns when the next is due, or ``None`` (lost)."""
        start = time.monotonic()
        late = start - due
        if renewal.cancelled:  # the body ended meanwhile: its commit decides now
            return None
        timeout = max(renewal.deadline - start, _MIN_ATTEMPT)
        try:
            if renewal.renew is not None:
                ours = renewal.renew(renewal.lease, renewal.ttl, timeout)
            else:
                ours = renewal.provider.extend(renewal.lease, renewal.ttl)
        except Exception as exc:  # the backend's failure: try again until the lease runs out
            renewal.error = exc
            renewal.failures += 1
            now = time.monotonic()
            if now >= renewal.deadline:
                self._lose(
                    renewal,
                    f"renewals failed until it ran out ({renewal.failures} attempt(s) in "
                    f"{now - renewal.confirmed:.2f}s since the last confirmed renewal; "
                    f"last error: {exc!r})",
                )
                return None
            if renewal.failures == 1:
                self._log(
                    logging.WARNING,
                    "celery-idempotent: renewal of the lease of %s failed (%r); retrying "
                    "for the %.2fs it has left",
                    renewal.label,
                    exc,
                    renewal.deadline - now,
                )
            return now + min(renewal.interval, max(renewal.deadline - now, 0.0) / 2 + 0.01)
        if not ours:
            since = start - renewal.confirmed
            if late > renewal.interval and since >= renewal.ttl:
                why = (
                    f"it had run out: this renewal ran {late:.2f}s late, {since:.2f}s after "
                    f"the last confirmed one (lease {renewal.ttl:.3g}s); the keeper thread "
                    "could not run in time"
                )
            elif since >= renewal.ttl:
                why = (
                    f"it had run out: no renewal was confirmed for {since:.2f}s "
                    f"(lease {renewal.ttl:.3g}s)"
                )
            else:
                why = (
                    f"it was gone {since:.2f}s after the last confirmed renewal, before its "
                    f"{renewal.ttl:.3g}s were up: deleted or taken over (a forced release, "
                    "eviction, a Redis restart without persistence or a failover)"
                )
            self._lose(renewal, f"Redis answered that the lock is no longer held by it: {why}")
            return None
        renewal.deadline = start + renewal.ttl
        renewal.confirmed = start
        renewal.failures = 0
        if late > renewal.ttl * _LATE_FRACTION and not renewal.late_reported:
            renewal.late_reported = True
            self._log(
                logging.WARNING,
                "celery-idempotent: renewal of the lease of %s ran %.2fs late (lease %.3gs), "
                "and still found it held: the keeper thread could not run (a C call holding "
                "the GIL, a paused or overloaded process)",
                renewal.label,
                late,
                renewal.ttl,
            )
        return start + renewal.interval

    def _lose(self, renewal: Renewal, cause: str) -> None:
        renewal.cause = cause
        renewal.lost = True
        if renewal.cancelled:
            # The body ended while this renewal was under way: its commit may well have
            # released the lock before the renewal reached the server (then "not held" is
            # the commit's own doing, and the result *was* committed). The commit decides,
            # and the guard reports what it finds: a refused commit, or a loss it saw first.
            return
        if not claim_report(renewal):
            return  # the guard's commit found it first and said so
        self._log(
            logging.WARNING,
            "celery-idempotent: lease of %s (fencing token %s) lost: %s; its result will not "
            "be committed",
            renewal.label,
            renewal.lease.fencing_token,
            cause,
        )

    def _log(self, level: int, msg: str, *args: Any) -> None:
        if self._relay:
            _pending.append((level, msg, args))
        else:
            log.log(level, msg, *args)


# Log lines of the keeper thread waiting to be written from the event loop's side.
_pending: collections.deque[tuple[int, str, tuple[Any, ...]]] = collections.deque()
_pump_started = False


def flush_log() -> None:
    """Write the keeper thread's queued log lines (from the caller's thread)."""
    while _pending:
        try:
            level, msg, args = _pending.popleft()
        except IndexError:  # pragma: no cover - emptied by another caller meanwhile
            return
        log.log(level, msg, *args)


def _pump() -> None:  # pragma: no cover - runs as a greenlet for the life of the worker
    while True:
        time.sleep(1.0)  # green: yields to the event loop
        flush_log()


def start_log_relay() -> None:
    """Start the greenlet that writes the keeper thread's queued lines (once per process).

    With the patched ``_thread.start_new_thread``, which schedules the greenlet and returns:
    ``threading.Thread.start`` waits until the new thread has started, i.e. switches to the
    event loop, and a body blocking the loop (a CPU loop) would hold the caller there for as
    long as it runs, past the lease of the call being kept.
    """
    global _pump_started  # noqa: PLW0603 - once per process
    if not _pump_started:
        _pump_started = True
        # Looked up now, not at import: the module may have been imported before the patch.
        _thread.start_new_thread(_pump, ())


def claim_report(renewal: Renewal) -> bool:
    """True for the first caller only: that one logs the loss of ``renewal``'s lease."""
    return next(renewal.loss_reports) == 0


def _reset_after_fork() -> None:
    # The relay's greenlet does not survive fork; the parent's queued lines are its own.
    global _pump_started  # noqa: PLW0603 - per process
    _pump_started = False
    _pending.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_reset_after_fork)
