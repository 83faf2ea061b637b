"""TwoStepBackend: a lock provider and a store that cannot decide together, as one AtomicBackend.

The guard claims and commits through it whenever the store offers no atomic backend of its
own (memory backends, a store and lock on two servers). Each test drives it directly with the
memory backends on a fake clock; lost replies are a store whose ``set`` writes and then raises.
"""

from __future__ import annotations

from typing import Any

import pytest

from celery_idempotent import (
    CommitUnknownError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyRecord,
    MemoryIdempotencyStore,
    MemoryLockProvider,
)
from celery_idempotent.core.protocols import Lease
from celery_idempotent.core.two_step import TwoStepBackend

LOCK, KEY = "p:lock:{k}", "p:{k}"


class LossyStore(MemoryIdempotencyStore):
    """A store whose next ``set`` lands and then loses its reply; counts writes and reads."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.lose_next_reply = False
        self.fail_get = False
        self.sets = 0
        self.gets = 0

    def set(self, key: str, record: IdempotencyRecord, ttl: float) -> None:
        self.sets += 1
        super().set(key, record, ttl)
        if self.lose_next_reply:
            self.lose_next_reply = False
            raise ConnectionError("reply lost")

    def get(self, key: str) -> IdempotencyRecord | None:
        self.gets += 1
        if self.fail_get:
            raise RuntimeError("store down")
        return super().get(key)


@pytest.fixture
def locks(clock: Any) -> MemoryLockProvider:
    return MemoryLockProvider(clock=clock)


@pytest.fixture
def records(clock: Any) -> LossyStore:
    return LossyStore(clock=clock)


@pytest.fixture
def pair(locks: MemoryLockProvider, records: LossyStore, clock: Any) -> TwoStepBackend:
    return TwoStepBackend(locks, records, 10.0, monotonic=clock)


def record(fence: int | None, result: Any = "r") -> IdempotencyRecord:
    return IdempotencyRecord(result, None, 1.0, fence)


def claimed(pair: TwoStepBackend) -> Lease:
    lease = pair.claim(LOCK, KEY, 10.0).lease
    assert lease is not None
    return lease


def commit(pair: TwoStepBackend, lease: Lease) -> bool:
    return pair.commit(lease, KEY, record(lease.fencing_token), 60)


def claimed_with_a_lost_write(pair: TwoStepBackend, records: LossyStore) -> Lease:
    """A lease whose first commit wrote the record and lost the reply."""
    lease = claimed(pair)
    records.lose_next_reply = True
    with pytest.raises(IdempotencyConnectionError):
        commit(pair, lease)
    assert records.sets == 1
    return lease


def test_a_claim_takes_the_lock_when_there_is_no_record(
    pair: TwoStepBackend, locks: MemoryLockProvider
) -> None:
    claim = pair.claim(LOCK, KEY, 10.0)
    assert claim.lease is not None
    assert claim.record is None
    assert locks.is_locked(LOCK)
    again = pair.claim(LOCK, KEY, 10.0)
    assert again.lease is None
    assert again.record is None


def test_a_claim_that_finds_a_record_returns_it_and_gives_the_lock_back(
    pair: TwoStepBackend, locks: MemoryLockProvider, records: LossyStore
) -> None:
    records.set(KEY, record(7), 60)
    claim = pair.claim(LOCK, KEY, 10.0)
    assert claim.lease is None
    assert claim.record is not None
    assert claim.record.fencing_token == 7
    assert not locks.is_locked(LOCK)


def test_a_look_up_that_fails_gives_the_lock_back_and_says_which_step(
    pair: TwoStepBackend, locks: MemoryLockProvider, records: LossyStore
) -> None:
    records.fail_get = True
    with pytest.raises(IdempotencyBackendError, match="store get failed") as info:
        pair.claim(LOCK, KEY, 10.0)
    assert info.value.key == KEY
    assert not locks.is_locked(LOCK)


def test_a_commit_writes_then_releases(
    pair: TwoStepBackend, locks: MemoryLockProvider, records: LossyStore
) -> None:
    lease = claimed(pair)
    assert commit(pair, lease) is True
    stored = records.get(KEY)
    assert stored is not None
    assert stored.fencing_token == lease.fencing_token
    assert not locks.is_locked(LOCK)


def test_a_commit_after_the_lease_ran_out_writes_nothing(
    pair: TwoStepBackend, records: LossyStore, clock: Any
) -> None:
    lease = claimed(pair)
    clock.advance(11)
    assert commit(pair, lease) is False
    assert records.sets == 0


def test_a_resend_after_a_lost_reply_finds_the_write_and_does_not_write_again(
    pair: TwoStepBackend, locks: MemoryLockProvider, records: LossyStore
) -> None:
    lease = claimed_with_a_lost_write(pair, records)
    assert commit(pair, lease) is True
    assert records.sets == 1  # looked, found its own record, did not replace it
    assert not locks.is_locked(LOCK)


def test_a_lease_lost_after_a_write_of_unknown_outcome_is_unknown_not_false(
    pair: TwoStepBackend, records: LossyStore, clock: Any
) -> None:
    lease = claimed_with_a_lost_write(pair, records)
    clock.advance(11)  # the lease runs out before the resend
    with pytest.raises(CommitUnknownError, match="may or may not be stored"):
        commit(pair, lease)


def test_a_write_is_not_sent_when_its_proof_came_back_after_a_whole_lease(
    locks: MemoryLockProvider, records: LossyStore, clock: Any
) -> None:
    ticks = iter([0.0, 10.0])  # the proof's reply took the whole lock_ttl
    pair = TwoStepBackend(locks, records, 10.0, monotonic=lambda: next(ticks))
    lease = claimed(pair)
    with pytest.raises(IdempotencyConnectionError, match="longer than the lease"):
        commit(pair, lease)
    assert records.sets == 0
