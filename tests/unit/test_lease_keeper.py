"""The lease keeper wakes only when a renewal needs it, and still renews every live lease in time.

Real threads and short real sleeps: the subject is the keeper thread itself.
"""

from __future__ import annotations

import threading
import time

from celery_idempotent.core.protocols import Lease
from celery_idempotent.core.renewal import LeaseKeeper


class CountingProvider:
    """A lock provider whose extend always succeeds and is counted per lease token."""

    def __init__(self) -> None:
        self.extends: dict[str, int] = {}
        self._lock = threading.Lock()

    def extend(self, lease: Lease, ttl: float) -> bool:
        with self._lock:
            self.extends[lease.token] = self.extends.get(lease.token, 0) + 1
        return True

    def acquire(self, resource, ttl):  # pragma: no cover - not used by the keeper
        raise NotImplementedError

    def release(self, lease):  # pragma: no cover - not used by the keeper
        raise NotImplementedError


def count_notifies(keeper: LeaseKeeper) -> list[int]:
    calls = [0]
    notify = keeper._cond.notify

    def counting(n: int = 1) -> None:
        calls[0] += 1
        notify(n)

    keeper._cond.notify = counting  # type: ignore[method-assign]
    return calls


def wait_for(predicate, timeout: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_a_stream_of_short_calls_does_not_wake_the_keeper_per_call():
    keeper = LeaseKeeper()
    provider = CountingProvider()
    notifies = count_notifies(keeper)
    for i in range(500):
        renewal = keeper.keep(provider, Lease("r", f"t{i}", i + 1), ttl=30.0, interval=10.0)
        LeaseKeeper.stop(renewal)
        if i == 0:  # let the keeper thread start and go to sleep on the first renewal
            assert wait_for(lambda: keeper._wake_at > 0)
    assert notifies[0] <= 1
    assert provider.extends == {}


def test_a_renewal_started_after_the_heap_drained_is_renewed():
    keeper = LeaseKeeper()
    provider = CountingProvider()
    short = keeper.keep(provider, Lease("r", "short", 1), ttl=0.3, interval=0.05)
    LeaseKeeper.stop(short)
    # The keeper wakes when "short" is due, drops it and sleeps until then at most.
    assert wait_for(lambda: not keeper._heap)
    live = keeper.keep(provider, Lease("r", "live", 2), ttl=0.3, interval=0.05)
    try:
        assert wait_for(lambda: provider.extends.get("live", 0) >= 3, timeout=3.0)
    finally:
        LeaseKeeper.stop(live)
    assert "short" not in provider.extends


def test_a_shorter_interval_than_the_keeper_sleeps_for_wakes_it():
    keeper = LeaseKeeper()
    provider = CountingProvider()
    slow = keeper.keep(provider, Lease("r", "slow", 1), ttl=60.0, interval=20.0)
    assert wait_for(lambda: keeper._wake_at > 0)
    LeaseKeeper.stop(slow)
    started = time.monotonic()
    fast = keeper.keep(provider, Lease("r", "fast", 2), ttl=0.3, interval=0.05)
    try:
        assert wait_for(lambda: provider.extends.get("fast", 0) >= 1, timeout=3.0)
    finally:
        LeaseKeeper.stop(fast)
    # Renewed about when due, not when the keeper's earlier sleep (20 s) would have ended.
    assert time.monotonic() - started < 3.0
    assert "slow" not in provider.extends


def test_after_draining_the_keeper_sleeps_until_the_last_dropped_renewal_was_due():
    keeper = LeaseKeeper()
    provider = CountingProvider()
    first = keeper.keep(provider, Lease("r", "a", 1), ttl=3.0, interval=0.05)
    LeaseKeeper.stop(first)
    second = keeper.keep(provider, Lease("r", "b", 2), ttl=30.0, interval=10.0)
    LeaseKeeper.stop(second)
    # Woken when "a" is due, it drops both (stopped) and then sleeps until "b" would have
    # been due, so that renewals started meanwhile need no notify.
    assert wait_for(lambda: not keeper._heap and keeper._wake_at > time.monotonic() + 5)
    notifies = count_notifies(keeper)
    for i in range(50):
        LeaseKeeper.stop(keeper.keep(provider, Lease("r", f"c{i}", 3 + i), ttl=30.0, interval=10.0))
    assert notifies[0] == 0


def test_stopped_renewals_do_not_pile_up_past_the_drain_threshold(monkeypatch):
    monkeypatch.setattr("celery_idempotent.core.lease_keeper._DRAIN_AT", 64)
    keeper = LeaseKeeper()
    provider = CountingProvider()
    LeaseKeeper.stop(keeper.keep(provider, Lease("r", "first", 1), ttl=60.0, interval=20.0))
    assert wait_for(lambda: keeper._wake_at > 0)
    for i in range(1000):
        LeaseKeeper.stop(keeper.keep(provider, Lease("r", f"t{i}", 2 + i), ttl=60.0, interval=20.0))
    assert wait_for(lambda: len(keeper._heap) <= 65)
    assert provider.extends == {}


# --------------------------------------------------------------------------- bounds, losses


def test_each_renewal_attempt_waits_at_most_the_leases_remaining_time():
    keeper = LeaseKeeper()
    timeouts: list[float] = []

    def renew(lease: Lease, ttl: float, timeout: float) -> bool:
        timeouts.append(timeout)
        return True

    renewal = keeper.keep(
        CountingProvider(), Lease("r", "t", 1), ttl=0.3, interval=0.1, renew=renew
    )
    assert wait_for(lambda: len(timeouts) >= 3)
    LeaseKeeper.stop(renewal)
    assert all(0 < t <= 0.3 for t in timeouts), timeouts
    assert not renewal.lost


def test_a_renewal_that_hangs_is_given_up_when_the_lease_runs_out(caplog):
    """A renewer that never answers (a stalled network) is bounded by its timeout; once the
    lease has run out the loss is logged once, with the last error."""
    keeper = LeaseKeeper()

    def hangs(lease: Lease, ttl: float, timeout: float) -> bool:
        time.sleep(timeout)
        raise TimeoutError("no reply")

    with caplog.at_level("WARNING", logger="celery_idempotent"):
        started = time.monotonic()
        renewal = keeper.keep(
            CountingProvider(), Lease("r", "t", 1), ttl=0.3, interval=0.1, renew=hangs
        )
        assert wait_for(lambda: renewal.lost, timeout=3)
        lost_after = time.monotonic() - started
        time.sleep(0.2)
    assert lost_after < 1.0  # the lease (0.3 s) plus one bounded attempt, not a socket timeout
    assert "renewals failed until it ran out" in str(renewal.cause)
    assert "no reply" in str(renewal.cause)
    lost = [r.getMessage() for r in caplog.records if " lost: " in r.getMessage()]
    assert len(lost) == 1, lost
    assert "lock r" in lost[0]


def test_a_renewal_answered_not_ours_is_logged_once_with_its_cause(caplog):
    keeper = LeaseKeeper()
    answers: list[float] = []

    def not_ours(lease: Lease, ttl: float, timeout: float) -> bool:
        answers.append(timeout)
        return False

    with caplog.at_level("WARNING", logger="celery_idempotent"):
        renewal = keeper.keep(
            CountingProvider(),
            Lease("r", "t", 7),
            ttl=0.3,
            interval=0.05,
            renew=not_ours,
            label="key #abc",
        )
        assert wait_for(lambda: renewal.lost)
        time.sleep(0.2)
    assert len(answers) == 1  # no renewal after the loss
    assert "no longer held" in str(renewal.cause)
    assert "before its 0.3s were up" in str(renewal.cause)  # gone early: not expiry
    lost = [r.getMessage() for r in caplog.records if " lost: " in r.getMessage()]
    assert len(lost) == 1
    assert lost[0].startswith("celery-idempotent: lease of key #abc (fencing token 7) lost: ")
