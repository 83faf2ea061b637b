"""Races with real threads: many callers of one key, released together by a barrier.

The back-off is configured (many retries, millisecond delays) so that every caller ends with
the result; a ``LockAcquisitionError`` here would be a test failure, not an accepted outcome.
"""

from __future__ import annotations

import threading
import time
from collections import Counter

from celery_idempotent import DistributedIdempotencyGuard, MemoryIdempotencyStore, current_lease
from celery_idempotent.core.backoff import event_sleep


def patient_guard(store, provider):
    return DistributedIdempotencyGuard(
        store=store,
        lock_provider=provider,
        retry_count=1_000,
        retry_base_delay=0.001,
        retry_max_delay=0.01,
        sleep=event_sleep,
    )


def run_together(targets):
    """Start one thread per target behind a barrier; return (outcomes, errors)."""
    barrier = threading.Barrier(len(targets))
    outcomes, errors = [], []

    def wrap(target):
        try:
            barrier.wait()
            outcomes.append(target())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wrap, args=(t,)) for t in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, errors


def test_32_threads_on_one_key_run_fn_once_and_share_its_result(provider, store):
    guard = patient_guard(store, provider)
    calls = []
    calls_lock = threading.Lock()

    def body():
        with calls_lock:
            calls.append(threading.get_ident())
        time.sleep(0.02)  # keep the key held while the others arrive
        return {"receipt": object()}

    outcomes, errors = run_together([lambda: guard.run("one", body, input={"amount": 1})] * 32)

    assert errors == []
    assert len(calls) == 1
    assert len(outcomes) == 32
    assert all(o.value is outcomes[0].value for o in outcomes)
    assert sorted(o.replayed for o in outcomes) == [False] + [True] * 31
    assert len(provider) == 0


def test_100_keys_times_8_threads_run_each_key_once(provider):
    store = MemoryIdempotencyStore()
    guard = patient_guard(store, provider)
    calls = Counter()
    calls_lock = threading.Lock()

    def make_call(key):
        def body():
            with calls_lock:
                calls[key] += 1
            time.sleep(0.001)
            return (key, object())

        return lambda: (key, guard.run(key, body, input=key))

    targets = [make_call(f"key-{k}") for k in range(100) for _ in range(8)]
    outcomes, errors = run_together(targets)

    assert errors == []
    assert len(outcomes) == 800
    assert calls == Counter({f"key-{k}": 1 for k in range(100)})
    by_key = {}
    for key, outcome in outcomes:
        by_key.setdefault(key, []).append(outcome)
    assert len(by_key) == 100
    for key, group in by_key.items():
        assert len(group) == 8
        assert all(o.value is group[0].value for o in group)
        assert group[0].value[0] == key
        assert sum(not o.replayed for o in group) == 1
    assert len(provider) == 0
    assert len(store) == 100


def test_threads_with_distinct_keys_each_see_their_own_lease(guard):
    def call(key):
        def body():
            time.sleep(0.001)
            return current_lease().resource

        return lambda: (key, guard.execute(key, body))

    outcomes, errors = run_together([call(f"k{i}") for i in range(50)])
    assert errors == []
    assert sorted(outcomes) == sorted((f"k{i}", guard.lock_resource(f"k{i}")) for i in range(50))


def test_failures_under_contention_let_exactly_one_later_caller_run(provider, store):
    """A body that fails stores nothing: the waiting duplicates then run it, one at a time,
    until one succeeds; after that the rest replay."""
    guard = patient_guard(store, provider)
    running, max_running, calls = [0], [0], [0]
    state_lock = threading.Lock()

    def body():
        with state_lock:
            running[0] += 1
            calls[0] += 1
            max_running[0] = max(max_running[0], running[0])
            attempt = calls[0]
        try:
            time.sleep(0.005)
            if attempt <= 3:
                raise RuntimeError(f"transient {attempt}")
            return "ok"
        finally:
            with state_lock:
                running[0] -= 1

    outcomes, errors = run_together([lambda: guard.execute("flaky", body)] * 12)

    assert max_running[0] == 1  # never two bodies of one key at once
    assert calls[0] == 4
    assert len(errors) == 3
    assert all(isinstance(e, RuntimeError) for e in errors)
    assert outcomes == ["ok"] * 9
