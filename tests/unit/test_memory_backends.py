"""The in-memory store and lock provider: expiry on an injected clock, bounded memory,
ownership by token, thread safety, and conformance to the public protocols."""

from __future__ import annotations

import threading

import pytest

from celery_idempotent import (
    IdempotencyRecord,
    IdempotencyStore,
    Lease,
    LockProvider,
    MemoryIdempotencyStore,
    MemoryLockProvider,
)


def rec(result, fingerprint=None):
    return IdempotencyRecord(result, fingerprint, 0.0)


# -- store ----------------------------------------------------------------------------------


def test_store_satisfies_the_protocol():
    assert isinstance(MemoryIdempotencyStore(), IdempotencyStore)


def test_store_get_set_delete(store):
    assert store.get("a") is None
    record = rec({"x": 1}, "fp")
    store.set("a", record, 10)
    assert store.get("a") is record
    store.set("a", rec(2), 10)
    assert store.get("a").result == 2
    assert store.delete("a") is True
    assert store.get("a") is None
    assert store.delete("a") is False


def test_store_ttl_expiry_follows_its_clock(clock):
    store = MemoryIdempotencyStore(clock=clock)
    store.set("a", rec(1), 10)
    clock.advance(9.999)
    assert store.get("a") is not None
    clock.advance(0.001)
    assert store.get("a") is None
    assert store.delete("a") is False


def test_store_overwrite_resets_ttl(clock):
    store = MemoryIdempotencyStore(clock=clock)
    store.set("a", rec(1), 10)
    clock.advance(8)
    store.set("a", rec(2), 10)
    clock.advance(8)  # the first set's expiry has passed; the sweep must not drop the second
    store.set("b", rec(0), 10)
    assert store.get("a").result == 2
    clock.advance(2)
    assert store.get("a") is None


def test_store_delete_of_expired_record_reports_false(clock):
    store = MemoryIdempotencyStore(clock=clock)
    store.set("a", rec(1), 1)
    clock.advance(2)
    assert store.delete("a") is False


def test_store_accepts_timedelta_ttl(clock):
    import datetime as dt

    store = MemoryIdempotencyStore(clock=clock)
    store.set("a", rec(1), dt.timedelta(minutes=1))
    clock.advance(59)
    assert store.get("a") is not None
    clock.advance(1)
    assert store.get("a") is None


@pytest.mark.parametrize("ttl", [0, -1, float("nan"), "10", None])
def test_store_refuses_bad_ttl(store, ttl):
    with pytest.raises((ValueError, TypeError), match="ttl"):
        store.set("a", rec(1), ttl)
    assert store.get("a") is None


def test_store_memory_stays_bounded_under_endless_distinct_keys(clock):
    store = MemoryIdempotencyStore(clock=clock)
    for i in range(200_000):
        store.set(f"key-{i}", rec(i), 1.0)
        clock.advance(0.01)  # ~100 records live at any moment
        if i % 10_000 == 0:
            assert len(store) <= 102
    assert len(store) <= 102
    assert store._records.heap_size() <= 2 * 102 + 1024  # white box: the expiry heap is bounded too


def test_store_memory_stays_bounded_when_one_key_is_overwritten_forever(clock):
    store = MemoryIdempotencyStore(clock=clock)
    for i in range(50_000):
        store.set("hot", rec(i), 3600)  # never expires within the loop
        clock.advance(0.001)
    assert len(store) == 1
    assert store.get("hot").result == 49_999
    # White box: stale heap entries for the overwritten key must be compacted away.
    assert store._records.heap_size() <= 2 * 1 + 1024 + 1


def test_store_clear(store):
    store.set("a", rec(1), 10)
    store.clear()
    assert store.get("a") is None
    assert len(store) == 0


def test_store_is_thread_safe():
    store = MemoryIdempotencyStore()
    barrier = threading.Barrier(8)
    errors = []

    def worker(n):
        try:
            barrier.wait()
            for i in range(2_000):
                key = f"{n}-{i % 50}"
                store.set(key, rec((n, i)), 60)
                got = store.get(key)
                assert got is not None
                assert got.result[0] == n
                if i % 7 == 0:
                    store.delete(key)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


# -- lock provider --------------------------------------------------------------------------


def test_lock_provider_satisfies_the_protocol():
    assert isinstance(MemoryLockProvider(), LockProvider)


def test_lock_acquire_is_exclusive_until_release(provider):
    lease = provider.acquire("r", 10)
    assert isinstance(lease, Lease)
    assert lease.resource == "r"
    assert provider.is_locked("r")
    assert provider.acquire("r", 10) is None
    assert provider.acquire("other", 10) is not None  # resources are independent
    assert provider.release(lease) is True
    assert not provider.is_locked("r")
    assert provider.release(lease) is False  # a second release is refused
    assert provider.acquire("r", 10) is not None


def test_lock_ttl_expiry_follows_its_clock(clock):
    provider = MemoryLockProvider(clock=clock)
    lease = provider.acquire("r", 10)
    clock.advance(9.999)
    assert provider.is_locked("r")
    assert provider.acquire("r", 10) is None
    clock.advance(0.001)
    assert not provider.is_locked("r")
    assert provider.extend(lease, 10) is False  # expired: no longer ours, even if unclaimed
    assert provider.release(lease) is False
    successor = provider.acquire("r", 10)
    assert successor is not None
    assert successor.fencing_token > lease.fencing_token


def test_lock_extend_gives_a_full_ttl_from_now(clock):
    provider = MemoryLockProvider(clock=clock)
    lease = provider.acquire("r", 10)
    clock.advance(8)
    assert provider.extend(lease, 10) is True
    clock.advance(8)  # past the original expiry: a new acquire still refused
    assert provider.acquire("other", 1) is not None  # triggers a sweep
    assert provider.is_locked("r")
    assert provider.acquire("r", 10) is None
    clock.advance(2)
    assert not provider.is_locked("r")


def test_lock_extend_and_release_by_non_owner_are_refused(provider):
    lease = provider.acquire("r", 10)
    forged = Lease(resource="r", token="not-the-token", fencing_token=lease.fencing_token)
    assert provider.extend(forged, 10) is False
    assert provider.release(forged) is False
    assert provider.is_locked("r")
    wrong_resource = Lease(resource="s", token=lease.token, fencing_token=lease.fencing_token)
    assert provider.release(wrong_resource) is False
    assert provider.release(lease) is True


def test_lock_tokens_are_unique_and_fencing_tokens_increase(clock):
    provider = MemoryLockProvider(clock=clock)
    leases = []
    for i in range(5_000):
        lease = provider.acquire(f"r{i % 10}", 1)
        leases.append(lease)
        if i % 2:
            provider.release(lease)
        else:
            clock.advance(1)  # let it expire instead
    assert len({lease.token for lease in leases}) == len(leases)
    for resource in {lease.resource for lease in leases}:
        fences = [lease.fencing_token for lease in leases if lease.resource == resource]
        assert all(a < b for a, b in zip(fences, fences[1:]))


def test_lock_clear_drops_locks_but_fencing_keeps_increasing(provider):
    first = provider.acquire("r", 10)
    provider.clear()
    assert not provider.is_locked("r")
    assert provider.extend(first, 10) is False
    second = provider.acquire("r", 10)
    assert second.fencing_token > first.fencing_token


@pytest.mark.parametrize("ttl", [0, -1, float("inf"), "1", None, True])
def test_lock_refuses_bad_ttl(provider, ttl):
    with pytest.raises((ValueError, TypeError), match="ttl"):
        provider.acquire("r", ttl)
    assert not provider.is_locked("r")
    lease = provider.acquire("r", 1)
    with pytest.raises((ValueError, TypeError), match="ttl"):
        provider.extend(lease, ttl)


def test_lock_memory_stays_bounded_under_endless_distinct_resources(clock):
    provider = MemoryLockProvider(clock=clock)
    for i in range(100_000):
        lease = provider.acquire(f"r{i}", 1.0)
        if i % 3 == 0:
            provider.release(lease)
        elif i % 3 == 1:
            provider.extend(lease, 1.0)
        clock.advance(0.01)
    assert len(provider) <= 102
    assert provider._held.heap_size() <= 3 * 102  # white box: the expiry heap is bounded too


def test_lock_is_thread_safe_one_winner_per_round():
    provider = MemoryLockProvider()
    threads_n, rounds = 16, 50
    barrier = threading.Barrier(threads_n)
    wins = [[] for _ in range(rounds)]
    errors = []

    def worker():
        try:
            for r in range(rounds):
                barrier.wait()
                lease = provider.acquire(f"round-{r}", 60)
                if lease is not None:
                    wins[r].append(lease)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(threads_n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    assert [len(w) for w in wins] == [1] * rounds
    fences = [w[0].fencing_token for w in wins]
    assert len(set(fences)) == rounds


def test_lock_mutual_exclusion_under_hammering():
    provider = MemoryLockProvider()
    inside, overlaps, held = [0], [0], [0]
    counter_lock = threading.Lock()
    barrier = threading.Barrier(8)

    def worker():
        barrier.wait()
        for _ in range(500):
            lease = provider.acquire("r", 60)
            if lease is None:
                continue
            with counter_lock:
                inside[0] += 1
                held[0] += 1
                if inside[0] > 1:
                    overlaps[0] += 1
            with counter_lock:
                inside[0] -= 1
            assert provider.release(lease)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert overlaps[0] == 0
    assert held[0] > 0
    assert len(provider) == 0
