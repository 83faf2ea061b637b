"""Every path through ``execute`` ends with the lease released by its holder, and only the
paths that complete the body commit anything."""

from __future__ import annotations

import threading

import pytest

from celery_idempotent import (
    CommitUnknownError,
    IdempotencyAbortedError,
    IdempotencyBackendError,
    IdempotencyMismatchError,
    LockLostError,
    MemoryIdempotencyStore,
    MemoryLockProvider,
)


class Boom(Exception):
    pass


class LedgerProvider(MemoryLockProvider):
    """Keeps a ledger of leases granted and released, to prove every one was given back."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.granted = []
        self.release_results = []

    def acquire(self, resource, ttl):
        lease = super().acquire(resource, ttl)
        if lease is not None:
            self.granted.append(lease)
        return lease

    def release(self, lease):
        ok = super().release(lease)
        self.release_results.append((lease, ok))
        return ok


@pytest.fixture
def ledger():
    return LedgerProvider()


@pytest.fixture
def lguard(make_guard, ledger):
    return make_guard(lock_provider=ledger)


def assert_all_released(ledger):
    assert ledger.granted, "the path under test never took the lock"
    released = [lease for lease, ok in ledger.release_results if ok]
    assert released == ledger.granted
    assert len(ledger) == 0


def raising(exc):
    def body():
        raise exc

    return body


@pytest.mark.parametrize(
    "exc",
    [Boom("x"), ValueError("bad"), KeyboardInterrupt(), SystemExit(3), GeneratorExit()],
    ids=lambda e: type(e).__name__,
)
def test_released_when_fn_raises_anything(lguard, ledger, store, exc):
    with pytest.raises(type(exc)) as info:
        lguard.execute("k", raising(exc))
    assert info.value is exc
    assert_all_released(ledger)
    assert len(store) == 0


def test_released_after_success(lguard, ledger):
    lguard.execute("k", lambda: 1)
    assert_all_released(ledger)


def test_released_after_replay(lguard, ledger):
    lguard.execute("k", lambda: 1)
    assert lguard.run("k", lambda: 2).replayed
    assert len(ledger.granted) == 2
    assert_all_released(ledger)


def test_released_after_mismatch(lguard, ledger):
    lguard.execute("k", lambda: 1, input="a")
    with pytest.raises(IdempotencyMismatchError):
        lguard.execute("k", lambda: 2, input="b")
    assert_all_released(ledger)


def test_released_when_aborted_between_attempts(make_guard, ledger, sleeps):
    guard = make_guard(lock_provider=ledger, retry_count=5, retry_base_delay=0.1)
    holder = ledger.acquire(guard.lock_resource("k"), 60)
    abort = threading.Event()

    def hook(i, _abort):
        if i == 0:  # the key frees up, but the abort comes first
            ledger.release(holder)
            abort.set()

    sleeps.hook = hook
    with pytest.raises(IdempotencyAbortedError):
        guard.execute("k", lambda: 1, abort=abort)
    assert ledger.granted == [holder]  # the guard never took the freed lock
    assert_all_released(ledger)


def test_released_when_the_lease_was_lost_is_a_refused_no_op(make_guard, ledger, store):
    guard = make_guard(lock_provider=ledger)

    def body():
        ledger.clear()
        return "r"

    with pytest.raises(LockLostError):
        guard.execute("k", body)
    # The guard tried, and the provider refused: it was no longer the holder.
    assert [ok for _, ok in ledger.release_results] == [False]
    assert len(store) == 0


@pytest.mark.parametrize("failing", ["get", "set"])
def test_released_when_the_store_fails(make_guard, ledger, failing):
    class BrokenStore(MemoryIdempotencyStore):
        def get(self, key):
            if failing == "get":
                raise OSError("store down")
            return super().get(key)

        def set(self, key, record, ttl):
            if failing == "set":
                raise OSError("store down")
            super().set(key, record, ttl)

    calls = []
    guard = make_guard(lock_provider=ledger, store=BrokenStore())
    if failing == "get":
        with pytest.raises(IdempotencyBackendError) as info:
            guard.execute("k", lambda: calls.append(1))
        assert isinstance(info.value.__cause__, OSError)
        assert calls == []
    else:
        # The body ran: its result must reach the caller although the commit failed.
        with pytest.raises(LockLostError) as lost:
            guard.execute("k", lambda: calls.append(1) or "charged")
        assert lost.value.result == "charged"
        assert isinstance(lost.value.__cause__, IdempotencyBackendError)
        assert isinstance(lost.value.__cause__.__cause__, OSError)
        assert calls == [1]
    assert_all_released(ledger)


def test_release_failure_does_not_mask_the_outcome(make_guard, store):
    class StickyProvider(MemoryLockProvider):
        def release(self, lease):
            raise ConnectionError("gone")

    guard = make_guard(lock_provider=StickyProvider())
    assert guard.execute("k", lambda: "committed") == "committed"
    with pytest.raises(Boom):
        guard.execute("k2", raising(Boom()))
    assert store.get(guard.record_key("k")).result == "committed"


def test_unfingerprintable_input_takes_no_lock(lguard, ledger):
    with pytest.raises(TypeError, match="set"):
        lguard.execute("k", lambda: 1, input={1, 2})
    assert ledger.granted == []


def test_fn_raising_then_running_again(lguard, store):
    attempts = []

    def body():
        attempts.append(1)
        if len(attempts) < 3:
            raise Boom(len(attempts))
        return len(attempts)

    for n in (1, 2):
        with pytest.raises(Boom) as info:
            lguard.execute("k", body)
        assert info.value.args == (n,)
        assert store.get(lguard.record_key("k")) is None
    assert lguard.execute("k", body) == 3
    assert lguard.execute("k", body) == 3
    assert len(attempts) == 3


def test_stale_lease_release_does_not_remove_the_new_holders_lock(clock):
    provider = MemoryLockProvider(clock=clock)
    old = provider.acquire("r", 5)
    clock.advance(5)
    new = provider.acquire("r", 5)
    assert new is not None
    assert new.token != old.token
    assert provider.release(old) is False
    assert provider.extend(old, 5) is False
    assert provider.is_locked("r")
    assert provider.release(new) is True
    assert not provider.is_locked("r")


@pytest.mark.parametrize("bad_key", ["", None, 5, b"k"])
def test_bad_keys_are_refused_before_any_lock(lguard, ledger, bad_key):
    with pytest.raises((TypeError, ValueError)):
        lguard.execute(bad_key, lambda: 1)
    assert ledger.granted == []


def test_bad_fn_and_abort_are_refused_before_any_lock(lguard, ledger):
    with pytest.raises(TypeError, match="fn"):
        lguard.execute("k", "not callable")
    with pytest.raises(TypeError, match="abort"):
        lguard.execute("k", lambda: 1, abort=True)
    assert ledger.granted == []


class FlakyExtendProvider(MemoryLockProvider):
    """A provider whose extend (the split path's commit check) loses its reply ``fails`` times."""

    def __init__(self, fails: int) -> None:
        super().__init__()
        self.fails = fails
        self.calls = 0

    def extend(self, lease, ttl):
        self.calls += 1
        if self.calls <= self.fails:
            raise ConnectionError("reply lost")
        return super().extend(lease, ttl)


def test_a_commit_whose_reply_is_lost_is_sent_again_until_answered(make_guard, store, sleeps):
    provider = FlakyExtendProvider(fails=3)
    guard = make_guard(lock_provider=provider, lock_ttl=10)
    assert guard.execute("k", lambda: "charged") == "charged"
    assert store.get(guard.record_key("k")).result == "charged"
    assert sleeps.delays == [0.05, 0.1, 0.2]  # back-off between the resent commits
    assert not provider.is_locked(guard.lock_resource("k"))


def test_a_commit_never_answered_is_reported_unknown_not_lost(make_guard, store, sleeps):
    provider = FlakyExtendProvider(fails=10**6)
    guard = make_guard(lock_provider=provider, lock_ttl=3)
    with pytest.raises(CommitUnknownError) as info:
        guard.execute("k", lambda: "charged")
    assert isinstance(info.value, LockLostError)  # still caught by except LockLostError
    assert info.value.result == "charged"
    assert "may or may not be stored" in str(info.value)
    assert sum(sleeps.delays) >= 3  # it kept asking for as long as the lease could be ours
    assert max(sleeps.delays) <= 1.0
