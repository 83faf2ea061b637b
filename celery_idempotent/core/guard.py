"""The distributed idempotency guard: lock, then look up, then run once and commit.

It knows only the :mod:`~celery_idempotent.core.protocols`: neither Celery nor Redis is imported
here. One call of :meth:`DistributedIdempotencyGuard.execute` goes::

    attempt lock ──held──> back off (abort wakes it) ──> ... ──> LockAcquisitionError
        │ ours
        ├── record stored? ── fingerprints differ ──> IdempotencyMismatchError
        │        └── yes ───────────────────────────> return the stored result (fn not called)
        └── no: run fn (lease renewed meanwhile, current_lease() set)
                 ├── raised ──> nothing stored, exception propagates
                 ├── lease lost ──> nothing stored, LockLostError(result=...)
                 └── commit while still the holder ──> return the result
    finally: release the lease, only if it is still ours.

"Attempt lock + look up" is one call of an :class:`~celery_idempotent.core.protocols.AtomicBackend`
and "commit + release" another: the store's own (``atomic_with``: the Redis store paired with
the Redis lock provider, PostgreSQL), else the two backends in separate calls
(:class:`~celery_idempotent.core.two_step.TwoStepBackend`).
"""

from __future__ import annotations

import logging
import random as _random
import time
from collections.abc import Callable
from typing import Any, TypeVar

from celery_idempotent.core import renewal
from celery_idempotent.core.backoff import ExponentialJitterBackoff, Sleep, event_sleep
from celery_idempotent.core.commit import commit_lease
from celery_idempotent.core.exceptions import (
    IdempotencyAbortedError,
    IdempotencyBackendError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
)
from celery_idempotent.core.fingerprint import KeyLabel, fingerprint_payload, key_digest
from celery_idempotent.core.names import DEFAULT_PREFIX, lock_name, record_name
from celery_idempotent.core.outcome import (
    ABSENT,
    GuardEvent,
    Outcome,
    current_lease,
    require_lease,
    running_under,
)
from celery_idempotent.core.protocols import (
    AtomicBackend,
    Claim,
    IdempotencyRecord,
    IdempotencyStore,
    Lease,
    LockProvider,
    PairsAtomically,
    check_implements,
)
from celery_idempotent.core.two_step import TwoStepBackend, backend_call, release_quietly
from celery_idempotent.core.validate import check_count, check_delay, check_duration, check_ttl

__all__ = [
    "ABSENT",
    "DistributedIdempotencyGuard",
    "GuardEvent",
    "Outcome",
    "current_lease",
    "require_lease",
]

T = TypeVar("T")
log = logging.getLogger("celery_idempotent")


class DistributedIdempotencyGuard:
    """Runs a function at most once per key, and replays its stored result to duplicates.

    ``store`` keeps results for ``ttl`` seconds (``0``: nothing is kept; the commit only
    proves the lease and releases it, so the key is free, and runs again, once a body
    ends); ``lock_provider`` serializes callers of one
    key across threads, processes and machines, with leases of ``lock_ttl`` seconds that are
    renewed every ``renew_interval`` (a third of ``lock_ttl`` by default) while the body runs.
    A key that is held is tried ``1 + retry_count`` times, waiting
    ``retry_base_delay * 2**i + uniform(0, retry_base_delay)`` before retry ``i``, each wait
    capped at ``retry_max_delay`` when given. ``fingerprint_fn`` hashes ``input`` for mismatch
    detection; ``key_prefix`` namespaces lock and record names. ``clock`` stamps records;
    ``sleep`` and ``random`` drive the back-off (inject fakes in tests); ``on_event`` receives
    :class:`GuardEvent` s (its errors are logged, never raised); when it also has a
    ``wants(kind) -> bool`` method, an event is built only for a kind it wants (no work on the
    hot path for events nobody listens to).

    Durations are seconds (int, float or ``datetime.timedelta``). One instance is safe to share
    between threads.
    """

    def __init__(
        self,
        *,
        store: IdempotencyStore,
        lock_provider: LockProvider,
        ttl: Any = 86_400,
        lock_ttl: Any = 10,
        retry_count: int = 3,
        retry_base_delay: Any = 0.1,
        retry_max_delay: Any = None,
        renew_interval: Any = None,
        fingerprint_fn: Callable[[Any], str] = fingerprint_payload,
        key_prefix: str = DEFAULT_PREFIX,
        clock: Callable[[], float] = time.time,
        sleep: Sleep = event_sleep,
        random: Callable[[], float] = _random.random,
        on_event: Callable[[GuardEvent], None] | None = None,
    ) -> None:
        check_implements("store", store, IdempotencyStore)
        check_implements("lock_provider", lock_provider, LockProvider)
        for name, fn in (
            ("fingerprint_fn", fingerprint_fn),
            ("clock", clock),
            ("sleep", sleep),
            ("random", random),
        ):
            if not callable(fn):
                raise TypeError(f"{name} must be callable, not {type(fn).__name__} ({fn!r})")
        if on_event is not None and not callable(on_event):
            raise TypeError(
                f"on_event must be callable, not {type(on_event).__name__} ({on_event!r})"
            )
        if not isinstance(key_prefix, str):
            raise TypeError(
                f"key_prefix must be a str, not {type(key_prefix).__name__} ({key_prefix!r})"
            )
        if "{" in key_prefix or "}" in key_prefix:
            raise ValueError(
                f"key_prefix must not contain braces (Redis hash tags), got {key_prefix!r}"
            )
        self.store = store
        self.lock_provider = lock_provider
        self.ttl = check_ttl("ttl", ttl)
        self.lock_ttl = check_duration("lock_ttl", lock_ttl)
        self.retry_count = check_count("retry_count", retry_count)
        self.retry_base_delay = check_delay("retry_base_delay", retry_base_delay)
        self.retry_max_delay = (
            None if retry_max_delay is None else check_delay("retry_max_delay", retry_max_delay)
        )
        self.renew_interval = (
            self.lock_ttl / 3
            if renew_interval is None
            else check_duration("renew_interval", renew_interval)
        )
        if self.renew_interval >= self.lock_ttl:
            raise ValueError(
                f"renew_interval must be shorter than lock_ttl ({self.lock_ttl}), "
                f"got {renew_interval!r}"
            )
        self.fingerprint_fn = fingerprint_fn
        self.key_prefix = key_prefix
        self.clock = clock
        self._sleep = sleep
        self._backoff = ExponentialJitterBackoff(
            self.retry_base_delay, self.retry_max_delay, random
        )
        self._on_event = on_event
        wants = getattr(on_event, "wants", None)
        self._wants: Callable[[str], bool] | None = wants if callable(wants) else None
        paired = store.atomic_with(lock_provider) if isinstance(store, PairsAtomically) else None
        #: What claims and commits: the store's own atomic backend for ``lock_provider``, else
        #: a :class:`~celery_idempotent.core.two_step.TwoStepBackend` of the two.
        self.backend: AtomicBackend = (
            paired
            if paired is not None
            else TwoStepBackend(lock_provider, store, self.lock_ttl, monotonic=time.monotonic)
        )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(store={self.store!r}, lock_provider={self.lock_provider!r}, "
            f"ttl={self.ttl}, lock_ttl={self.lock_ttl}, retry_count={self.retry_count})"
        )

    def lock_resource(self, key: str) -> str:
        """The name of ``key``'s lock: ``{key_prefix}lock:{<key>}`` (braces: a hash tag)."""
        return lock_name(self.key_prefix, key)

    def record_key(self, key: str) -> str:
        """The name of ``key``'s record in the store: ``{key_prefix}{<key>}``."""
        return record_name(self.key_prefix, key)

    def execute(
        self,
        key: str,
        fn: Callable[[], T],
        *,
        input: Any = ABSENT,
        abort: Any = None,
    ) -> T:
        """Run ``fn()`` once for ``key`` and return its result; replay it to later calls.

        ``input`` is the payload the key stands for: its fingerprint is stored with the result,
        and a later call of the same key with a payload of another fingerprint raises
        :class:`IdempotencyMismatchError` instead of replaying. ``abort``, a
        ``threading.Event``, stops the lock attempts (not a running ``fn``).

        Raises :class:`LockAcquisitionError` when the key stays held through every attempt,
        :class:`IdempotencyAbortedError`, :class:`IdempotencyMismatchError`,
        :class:`LockLostError` (``fn`` ran but its lease was lost: nothing committed), a
        :class:`IdempotencyBackendError` when the store or lock fails, and whatever ``fn``
        raises (nothing is stored then).
        """
        return self.run(key, fn, input=input, abort=abort).value

    def run(
        self,
        key: str,
        fn: Callable[[], T],
        *,
        input: Any = ABSENT,
        abort: Any = None,
        fingerprint: str | None = None,
        task_id: str | None = None,
        ttl: float | None = None,
    ) -> Outcome[T]:
        """Like :meth:`execute`, but says whether the value was replayed (an :class:`Outcome`).

        ``fingerprint``, when given, is used as the fingerprint of ``input`` instead of calling
        ``fingerprint_fn`` (for a caller that has computed it already). ``task_id`` is stored
        with the result (``IdempotencyRecord.task_id``). ``ttl``: this call's record TTL in
        seconds, instead of the guard's (a per-call ``idempotency_ttl``).
        """
        record_ttl = self.ttl if ttl is None else check_ttl("ttl", ttl)
        if not isinstance(key, str):
            raise TypeError(f"key must be a str, not {type(key).__name__} ({key!r})")
        if not key:
            raise ValueError("key must not be empty")
        if not callable(fn):
            raise TypeError(f"fn must be callable, not {type(fn).__name__} ({fn!r})")
        if abort is not None and not (
            callable(getattr(abort, "is_set", None)) and callable(getattr(abort, "wait", None))
        ):
            raise TypeError(
                f"abort must be a threading.Event, not {type(abort).__name__} ({abort!r})"
            )
        if fingerprint is None and input is not ABSENT:
            fingerprint = self.fingerprint_fn(input)
        started = self.clock()
        resource = lock_name(self.key_prefix, key)
        rkey = record_name(self.key_prefix, key)

        lease, record, attempts = self._claim(key, resource, rkey, abort, started)
        if lease is None:
            if record is None:  # pragma: no cover - a claim without lease returns a record
                raise IdempotencyBackendError(key, "claim returned neither a lease nor a record")
            return self._replay(key, record, fingerprint, attempts, started)

        committed = False
        try:
            value, kept = self._run_body(key, fn, lease, started)
            # Whole µs: the Redis store writes those compactly (see keyspace).
            stamp = round(self.clock(), 6)
            new = IdempotencyRecord(value, fingerprint, stamp, lease.fencing_token, task_id)
            commit_lease(
                self.backend,
                key,
                rkey,
                lease,
                new,
                ttl=record_ttl,
                lock_ttl=self.lock_ttl,
                sleep=self._sleep,
                kept=kept,
                lost=lambda: self._emit("lease_lost", key, 0, started, lease.fencing_token),
            )
            committed = True  # the commit released the lock
            self._emit("committed", key, 0, started, lease.fencing_token)
            return Outcome(value, False, lease.fencing_token, attempts)
        finally:
            if not committed:
                release_quietly(self.lock_provider, lease, key)

    # -- steps ------------------------------------------------------------------------------

    def _claim(
        self, key: str, resource: str, rkey: str, abort: Any, started: float
    ) -> tuple[Lease | None, IdempotencyRecord | None, int]:
        """Attempt the lock up to ``1 + retry_count`` times. Returns (lease, record, attempts):
        a lease and no record, or a record and no lease."""
        attempts = 0
        total = 1 + self.retry_count
        while True:
            if abort is not None and abort.is_set():
                raise IdempotencyAbortedError(key, attempts)
            attempts += 1
            sent = self.clock()
            claim: Claim = backend_call(
                key, "claim", self.backend.claim, resource, rkey, self.lock_ttl
            )
            lease, record = claim.lease, claim.record
            if lease is not None and not self._still_ours(key, lease, sent):
                pass  # it ran out before its reply came: claim again (an attempt like any)
            elif lease is not None or record is not None:
                return lease, record, attempts
            self._emit("contention", key, attempts, started)
            if attempts >= total:
                raise LockAcquisitionError(key, attempts)
            delay = self._backoff.delay(attempts - 1)
            if self._sleep(delay, abort):
                raise IdempotencyAbortedError(key, attempts)

    def _still_ours(self, key: str, lease: Lease, sent: float) -> bool:
        """Whether a lease whose claim was sent at ``sent`` (guard clock) is still ours.

        Its reply can come long after Redis took the lock: under gevent or eventlet a body
        that blocks the event loop holds every other greenlet, this claim's reader included,
        and the lease is not renewed before the guard knows it. A reply that took a renewal
        interval or more is checked with one extend before the body may run.
        """
        waited = self.clock() - sent
        if waited < self.renew_interval:
            return True
        ours = bool(
            backend_call(key, "lock extend", self.lock_provider.extend, lease, self.lock_ttl)
        )
        if not ours:
            log.warning(
                "celery-idempotent: the claim of key #%s was answered %.2fs after it was sent, "
                "after its %gs lease had run out: the body did not run; claiming again",
                key_digest(key),
                waited,
                self.lock_ttl,
            )
        return ours

    def _replay(
        self,
        key: str,
        record: IdempotencyRecord,
        fingerprint: str | None,
        attempts: int,
        started: float,
    ) -> Outcome[Any]:
        if (
            fingerprint is not None
            and record.fingerprint is not None
            and record.fingerprint != fingerprint
        ):
            raise IdempotencyMismatchError(key, record.fingerprint, fingerprint)
        self._emit("replay", key, attempts, started, record.fencing_token)
        return Outcome(record.result, True, record.fencing_token, attempts)

    def _run_body(
        self, key: str, fn: Callable[[], T], lease: Lease, started: float
    ) -> tuple[T, renewal.Renewal]:
        kept = renewal.keep(
            self.lock_provider,
            lease,
            self.lock_ttl,
            self.renew_interval,
            label=KeyLabel(key),
        )
        try:
            with running_under(lease):
                value = fn()
        finally:
            renewal.stop(kept)
        if kept.lost:
            if renewal.claim_report(kept):
                # The keeper learnt it after the body ended, so it left the telling to us.
                log.warning(
                    "celery-idempotent: lease of key #%s (fencing token %s) lost: %s; its "
                    "result is not committed",
                    key_digest(key),
                    lease.fencing_token,
                    kept.cause,
                )
            self._emit("lease_lost", key, 0, started, lease.fencing_token)
            raise LockLostError(
                key, value, f"lease lost while the body ran: {kept.cause}; not committed"
            ) from kept.error
        return value, kept

    def _emit(
        self, kind: str, key: str, attempt: int, started: float, fencing: int | None = None
    ) -> None:
        on_event = self._on_event
        if on_event is None or (self._wants is not None and not self._wants(kind)):
            return
        try:
            on_event(GuardEvent(kind, key, attempt, self.clock() - started, fencing))
        except Exception:
            log.exception("on_event handler failed for %s of key #%s", kind, key_digest(key))
