"""One test (or a few) per numbered rule of SPEC §3, named after the rule.

Back-off, release paths, races, configuration, exceptions and the fingerprint each have a
module of their own with the details; the tests here pin the rule itself.
"""

from __future__ import annotations

import threading
import time

import pytest

from celery_idempotent import (
    IdempotencyAbortedError,
    IdempotencyBackendError,
    IdempotencyConnectionError,
    IdempotencyMismatchError,
    LockAcquisitionError,
    LockLostError,
    MemoryIdempotencyStore,
    MemoryLockProvider,
    current_lease,
    fingerprint_payload,
)
from celery_idempotent.core.backoff import event_sleep


class Boom(Exception):
    pass


class RecordingProvider(MemoryLockProvider):
    """A memory lock provider that logs which resources it was asked about."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.acquired: list[str] = []
        self.released: list[str] = []

    def acquire(self, resource, ttl):
        self.acquired.append(resource)
        return super().acquire(resource, ttl)

    def release(self, lease):
        self.released.append(lease.resource)
        return super().release(lease)


class RecordingStore(MemoryIdempotencyStore):
    """A memory store that logs the keys it was asked about."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.keys: list[str] = []

    def get(self, key):
        self.keys.append(key)
        return super().get(key)

    def set(self, key, record, ttl):
        self.keys.append(key)
        super().set(key, record, ttl)


def counting(value=None):
    """A body that counts its calls and returns ``value``."""

    def fn():
        fn.calls += 1
        return value

    fn.calls = 0
    return fn


# -- rule 1 ---------------------------------------------------------------------------------


def test_rule_01_lock_resource_separate_from_store_keys(make_guard):
    provider, store = RecordingProvider(), RecordingStore()
    guard = make_guard(store=store, lock_provider=provider)
    seen_locked = []

    def body():
        seen_locked.append(provider.is_locked("idempotency:lock:{order-7}"))
        return 1

    assert guard.execute("order-7", body) == 1

    assert provider.acquired == ["idempotency:lock:{order-7}"]
    assert provider.released == ["idempotency:lock:{order-7}"]
    assert seen_locked == [True]
    assert set(store.keys) == {"idempotency:{order-7}"}
    assert guard.lock_resource("order-7") == "idempotency:lock:{order-7}"
    assert guard.record_key("order-7") == "idempotency:{order-7}"
    assert store.get("idempotency:lock:{order-7}") is None


def test_rule_01_key_prefix_is_configurable(make_guard):
    provider, store = RecordingProvider(), RecordingStore()
    guard = make_guard(store=store, lock_provider=provider, key_prefix="billing:")
    guard.execute("k", counting(2))
    assert provider.acquired == ["billing:lock:{k}"]
    assert set(store.keys) == {"billing:{k}"}


@pytest.mark.parametrize(
    "key",
    ["plain", "with{brace", "with}brace", "{x}", "lock:{x}", "x" * 500, "ключ", "a b:c"],
)
def test_rule_01_lock_and_record_share_one_hash_tag(guard, key):
    resource, rkey = guard.lock_resource(key), guard.record_key(key)
    assert resource != rkey
    assert resource.startswith("idempotency:lock:{")
    assert resource.endswith("}")
    assert rkey.startswith("idempotency:{")
    assert rkey.endswith("}")
    tag = resource[len("idempotency:lock:{") : -1]
    assert rkey[len("idempotency:{") : -1] == tag
    # Redis hashes the part between the first "{" and the next "}": the tag must be whole.
    assert "{" not in tag
    assert "}" not in tag


def test_rule_01_distinct_keys_never_share_a_name(guard):
    keys = ["a", "lock:a", "{a}", "a{", "x" * 300, "x" * 300 + "y", "lock:{a}"]
    names = [guard.lock_resource(k) for k in keys] + [guard.record_key(k) for k in keys]
    assert len(set(names)) == len(names)


# -- rule 2 ---------------------------------------------------------------------------------


def test_rule_02_attempts_are_one_plus_retry_count_with_exponential_jitter(
    make_guard, provider, sleeps
):
    guard = make_guard(retry_count=3, retry_base_delay=0.1, random=lambda: 0.5)
    holder = provider.acquire(guard.lock_resource("k"), 10)
    assert holder is not None
    fn = counting()

    with pytest.raises(LockAcquisitionError) as info:
        guard.execute("k", fn)

    assert info.value.key == "k"
    assert info.value.attempts == 4
    assert fn.calls == 0
    assert sleeps.delays == pytest.approx([0.15, 0.25, 0.45])
    assert provider.is_locked(guard.lock_resource("k"))  # the holder keeps it


def test_rule_02_retry_count_zero_is_one_attempt_and_no_wait(make_guard, provider, sleeps):
    guard = make_guard(retry_count=0, retry_base_delay=0.1)
    provider.acquire(guard.lock_resource("k"), 10)
    with pytest.raises(LockAcquisitionError) as info:
        guard.execute("k", counting())
    assert info.value.attempts == 1
    assert sleeps.delays == []


def test_rule_02_a_retry_that_finds_the_lock_free_runs_the_body(make_guard, provider, sleeps):
    guard = make_guard(retry_count=3, retry_base_delay=0.1)
    holder = provider.acquire(guard.lock_resource("k"), 10)
    sleeps.hook = lambda i, _abort: provider.release(holder) if i == 1 else None

    outcome = guard.run("k", counting("ran"))

    assert outcome.value == "ran"
    assert outcome.attempts == 3
    assert len(sleeps.delays) == 2


# -- rule 3 ---------------------------------------------------------------------------------


def test_rule_03_abort_is_checked_before_the_first_attempt(make_guard):
    provider = RecordingProvider()
    guard = make_guard(lock_provider=provider)
    abort = threading.Event()
    abort.set()
    fn = counting()

    with pytest.raises(IdempotencyAbortedError) as info:
        guard.execute("k", fn, abort=abort)

    assert info.value.key == "k"
    assert info.value.attempts == 0
    assert provider.acquired == []
    assert fn.calls == 0


def test_rule_03_abort_is_checked_before_every_retry(make_guard, provider, sleeps):
    guard = make_guard(retry_count=10, retry_base_delay=0.1)
    provider.acquire(guard.lock_resource("k"), 10)
    abort = threading.Event()
    # Set while "sleeping" before the second retry; the fake sleep reports it like the
    # real one does, so the guard stops there.
    sleeps.hook = lambda i, _abort: abort.set() if i == 1 else None

    with pytest.raises(IdempotencyAbortedError) as info:
        guard.execute("k", counting(), abort=abort)

    assert info.value.attempts == 2
    assert sleeps.aborts == [abort, abort]  # the wait is given the event, to be woken by it


def test_rule_03_abort_does_not_interrupt_a_running_body(guard, provider):
    abort = threading.Event()

    def body():
        abort.set()
        return "finished"

    assert guard.execute("k", body, abort=abort) == "finished"
    # Committed, not thrown away: a later call (without the set event) replays it.
    assert guard.run("k", counting("other")).replayed
    assert not provider.is_locked(guard.lock_resource("k"))


def test_rule_03_abort_leaves_no_lock_held(make_guard, provider, sleeps):
    guard = make_guard(retry_count=5, retry_base_delay=0.1)
    holder = provider.acquire(guard.lock_resource("k"), 10)
    abort = threading.Event()
    sleeps.hook = lambda _i, _abort: abort.set()
    with pytest.raises(IdempotencyAbortedError):
        guard.execute("k", counting(), abort=abort)
    assert provider.release(holder)
    assert len(provider) == 0


# -- rule 4 ---------------------------------------------------------------------------------


def test_rule_04_stored_record_is_returned_without_calling_fn(guard):
    first, second = counting({"id": 1}), counting({"id": 2})
    result = guard.execute("k", first, input={"a": 1})
    outcome = guard.run("k", second, input={"a": 1})
    assert outcome.replayed
    assert outcome.value == {"id": 1}
    assert outcome.value is result  # the memory store keeps the very object
    assert (first.calls, second.calls) == (1, 0)


def test_rule_04_different_input_raises_mismatch_and_does_not_run(guard, store, provider):
    guard.execute("k", counting("paid"), input={"amount": 10})
    fn = counting("paid twice")

    with pytest.raises(IdempotencyMismatchError) as info:
        guard.execute("k", fn, input={"amount": 11})

    assert fn.calls == 0
    assert info.value.key == "k"
    assert info.value.stored_fingerprint == fingerprint_payload({"amount": 10})
    assert info.value.fingerprint == fingerprint_payload({"amount": 11})
    assert store.get(guard.record_key("k")).result == "paid"  # untouched
    assert not provider.is_locked(guard.lock_resource("k"))


def test_rule_04_same_input_in_another_dict_order_replays(guard):
    guard.execute("k", counting(1), input={"a": 1, "b": [1, 2]})
    assert guard.run("k", counting(2), input={"b": (1, 2), "a": 1}).replayed


def test_rule_04_call_without_input_is_not_compared(guard):
    guard.execute("k", counting("r"), input={"a": 1})
    assert guard.execute("k", counting("other")) == "r"


def test_rule_04_record_stored_without_input_is_not_compared(guard):
    guard.execute("k", counting("r"))
    assert guard.execute("k", counting("other"), input={"anything": True}) == "r"


def test_rule_04_custom_fingerprint_fn_decides_the_comparison(make_guard):
    guard = make_guard(fingerprint_fn=lambda payload: str(payload["id"]))
    guard.execute("k", counting("r"), input={"id": 1, "noise": 1})
    assert guard.execute("k", counting("x"), input={"id": 1, "noise": 2}) == "r"
    with pytest.raises(IdempotencyMismatchError) as info:
        guard.execute("k", counting("x"), input={"id": 2})
    assert (info.value.stored_fingerprint, info.value.fingerprint) == ("1", "2")


def test_rule_04_expired_record_is_not_replayed(make_guard, clock):
    guard = make_guard(store=MemoryIdempotencyStore(clock=clock), ttl=60)
    guard.execute("k", counting("old"))
    clock.advance(59)
    assert guard.execute("k", counting("new")) == "old"
    clock.advance(2)
    fn = counting("new")
    assert guard.execute("k", fn) == "new"
    assert fn.calls == 1


# -- rule 5 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [None, 0, 0.0, "", [], {}, (), False, b""])
def test_rule_05_falsy_results_are_stored_and_replayed(guard, store, value):
    first, again = counting(value), counting("must not run")
    assert guard.execute("k", first) == value
    outcome = guard.run("k", again)
    assert outcome.replayed
    assert outcome.value == value
    assert type(outcome.value) is type(value)
    assert again.calls == 0
    record = store.get(guard.record_key("k"))
    assert record is not None
    assert record.result == value


def test_rule_05_result_is_stored_with_fingerprint_for_ttl(make_guard, clock):
    store = MemoryIdempotencyStore(clock=clock)
    guard = make_guard(store=store, ttl=30)
    guard.execute("k", counting(5), input=[1, 2])
    record = store.get(guard.record_key("k"))
    assert record.result == 5
    assert record.fingerprint == fingerprint_payload([1, 2])
    clock.advance(29.9)
    assert store.get(guard.record_key("k")) is not None
    clock.advance(0.2)
    assert store.get(guard.record_key("k")) is None


# -- rule 6 ---------------------------------------------------------------------------------


def test_rule_06_fn_raising_stores_nothing_and_propagates(guard, store, provider):
    error = Boom("card declined")

    def body():
        raise error

    with pytest.raises(Boom) as info:
        guard.execute("k", body, input={"a": 1})

    assert info.value is error
    assert store.get(guard.record_key("k")) is None
    assert not provider.is_locked(guard.lock_resource("k"))
    fn = counting("second try")
    assert guard.execute("k", fn, input={"a": 1}) == "second try"
    assert fn.calls == 1


# -- rule 7 ---------------------------------------------------------------------------------


@pytest.mark.parametrize("exc_type", [Boom, KeyboardInterrupt, SystemExit])
def test_rule_07_lock_is_released_when_fn_raises(guard, provider, exc_type):
    def body():
        assert provider.is_locked(guard.lock_resource("k"))
        raise exc_type

    with pytest.raises(exc_type):
        guard.execute("k", body)
    assert not provider.is_locked(guard.lock_resource("k"))
    assert len(provider) == 0


def test_rule_07_each_acquisition_has_its_own_token(provider):
    tokens = set()
    for _ in range(200):
        lease = provider.acquire("r", 10)
        tokens.add(lease.token)
        assert provider.release(lease)
    assert len(tokens) == 200


def test_rule_07_expired_holder_cannot_release_or_overwrite_the_new_holder(
    make_guard, clock, store
):
    provider = MemoryLockProvider(clock=clock)
    guard = make_guard(lock_provider=provider, lock_ttl=10)
    resource = guard.lock_resource("k")
    newcomer = []

    def stalled_body():
        clock.advance(11)  # the lease runs out while the body is stalled...
        newcomer.append(provider.acquire(resource, 10))  # ...and someone else takes the key
        return "late"

    with pytest.raises(LockLostError) as info:
        guard.execute("k", stalled_body)

    assert info.value.result == "late"
    assert newcomer[0] is not None
    assert provider.is_locked(resource)  # the stale holder's finally did not release it
    assert store.get(guard.record_key("k")) is None  # nor did it commit over the newcomer
    assert provider.extend(newcomer[0], 10)
    assert provider.release(newcomer[0])


# -- rule 8 ---------------------------------------------------------------------------------


def test_rule_08_lease_is_renewed_while_a_long_body_runs(make_guard):
    provider = MemoryLockProvider()
    # Renewed every 0.1 s, so a renewal may run up to 0.4 s late (a loaded machine) before
    # the lease could lapse; the body lasts three lease lengths.
    guard = make_guard(lock_provider=provider, lock_ttl=0.5, renew_interval=0.1)
    resource = guard.lock_resource("k")
    started, finished = threading.Event(), threading.Event()
    stolen, polls = [], []

    def contender():
        started.wait(5)
        while not finished.is_set():
            lease = provider.acquire(resource, 0.5)
            if lease is not None:
                stolen.append(lease)
            polls.append(provider.is_locked(resource))
            time.sleep(0.01)

    def body():
        started.set()
        time.sleep(1.5)
        finished.set()
        return "done"

    thread = threading.Thread(target=contender)
    thread.start()
    try:
        assert guard.execute("k", body) == "done"
    finally:
        finished.set()
        thread.join()

    assert stolen == []
    assert len(polls) > 10
    assert all(polls)
    assert guard.run("k", counting("again")).replayed
    assert not provider.is_locked(resource)


def test_rule_08_lease_lost_during_body_raises_lock_lost_and_commits_nothing(
    make_guard, provider, store
):
    guard = make_guard(lock_ttl=0.3)

    def body():
        provider.clear()  # the lease is gone (an admin flushed the locks, a failover...)
        time.sleep(0.25)  # long enough for a renewal to notice
        return {"charged": 10}

    with pytest.raises(LockLostError) as info:
        guard.execute("k", body)

    assert info.value.key == "k"
    assert info.value.result == {"charged": 10}
    assert store.get(guard.record_key("k")) is None
    fn = counting("rerun")
    assert guard.execute("k", fn) == "rerun"
    assert fn.calls == 1


class RefusingExtendProvider(MemoryLockProvider):
    """Grants leases but never confirms them again: ``extend`` says "not yours"."""

    def __init__(self):
        super().__init__()
        self.extend_calls = 0

    def extend(self, lease, ttl):
        self.extend_calls += 1
        return False


def test_rule_08_lease_lost_found_at_commit_raises_lock_lost(make_guard, store):
    provider = RefusingExtendProvider()
    guard = make_guard(lock_provider=provider, lock_ttl=10)  # no renewal during a short body
    with pytest.raises(LockLostError) as info:
        guard.execute("k", counting(["result"]))
    assert info.value.result == ["result"]
    assert provider.extend_calls >= 1
    assert store.get(guard.record_key("k")) is None
    assert len(provider) == 0  # released in finally: it still held the lock


def test_rule_08_renewal_finding_the_lease_gone_stops_and_skips_the_commit(make_guard, store):
    provider = RefusingExtendProvider()
    guard = make_guard(lock_provider=provider, lock_ttl=0.3)  # renewal every 0.1 s

    def body():
        time.sleep(0.6)
        return "r"

    with pytest.raises(LockLostError) as info:
        guard.execute("k", body)
    assert info.value.result == "r"
    # One renewal learned the lease was gone; no more renewals, and no commit attempt.
    assert provider.extend_calls == 1
    assert store.get(guard.record_key("k")) is None


class UnreachableExtendProvider(MemoryLockProvider):
    """The lock server stops answering after the lease was granted."""

    def extend(self, lease, ttl):
        raise ConnectionError("lock server unreachable")


def test_rule_08_renewals_failing_until_expiry_raise_lock_lost(make_guard, store):
    guard = make_guard(lock_provider=UnreachableExtendProvider(), lock_ttl=0.3)

    def body():
        time.sleep(0.8)
        return 42

    with pytest.raises(LockLostError) as info:
        guard.execute("k", body)

    assert info.value.result == 42
    assert isinstance(info.value.__cause__, ConnectionError)
    assert store.get(guard.record_key("k")) is None


# -- rule 9 ---------------------------------------------------------------------------------


def test_rule_09_fencing_tokens_strictly_increase_across_holders(guard, provider):
    seen = []

    def failing_body():
        lease = current_lease()
        seen.append(lease.fencing_token)
        assert lease.resource == guard.lock_resource("k")
        raise Boom

    for i in range(20):
        with pytest.raises(Boom):
            guard.execute("k", failing_body)
        # other keys and direct holders in between must not break the order
        guard.execute(f"other-{i}", counting())
        provider.release(provider.acquire(guard.lock_resource("k"), 1))
    outcome = guard.run("k", lambda: current_lease().fencing_token)

    assert all(a < b for a, b in zip(seen, seen[1:]))
    assert outcome.fencing_token == outcome.value > seen[-1]
    replay = guard.run("k", counting())
    assert replay.replayed
    assert replay.fencing_token == outcome.fencing_token  # the committing lease's token


def test_rule_09_current_lease_is_none_outside_a_body(guard):
    assert current_lease() is None
    inside = []
    guard.execute("k", lambda: inside.append(current_lease()))
    assert inside[0] is not None
    assert current_lease() is None

    def failing():
        raise Boom

    with pytest.raises(Boom):
        guard.execute("k2", failing)
    assert current_lease() is None


def test_rule_09_current_lease_is_per_thread_and_nests(guard):
    outer_lease, inner_lease, after_inner, other_thread = [], [], [], []

    def inner():
        inner_lease.append(current_lease())

    def outer():
        outer_lease.append(current_lease())
        thread = threading.Thread(target=lambda: other_thread.append(current_lease()))
        thread.start()
        thread.join()
        guard.execute("inner", inner)
        after_inner.append(current_lease())

    guard.execute("outer", outer)

    assert outer_lease[0].resource == guard.lock_resource("outer")
    assert inner_lease[0].resource == guard.lock_resource("inner")
    assert after_inner == outer_lease
    assert other_thread == [None]


# -- rule 10 --------------------------------------------------------------------------------


def test_rule_10_one_guard_instance_is_safe_to_share_between_threads(make_guard):
    guard = make_guard(
        retry_count=500, retry_base_delay=0.001, retry_max_delay=0.01, sleep=event_sleep
    )
    barrier = threading.Barrier(16)
    calls, results, errors = [], [], []
    calls_lock = threading.Lock()

    def body():
        with calls_lock:
            calls.append(threading.get_ident())
        time.sleep(0.05)
        return object()

    def worker():
        try:
            barrier.wait()
            results.append(guard.execute("shared", body))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()

    assert errors == []
    assert len(calls) == 1
    assert len(results) == 16
    assert all(r is results[0] for r in results)


# -- rule 11 --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("option", "value", "error"),
    [
        ("ttl", -1, ValueError),  # 0 is valid: nothing kept once the body ends
        ("lock_ttl", 0, ValueError),
        ("retry_count", -1, ValueError),
        ("retry_base_delay", -0.1, ValueError),
        ("ttl", "10", TypeError),
        ("retry_count", 1.5, TypeError),
    ],
)
def test_rule_11_bad_configuration_fails_at_construction(make_guard, option, value, error):
    with pytest.raises(error) as info:
        make_guard(**{option: value})
    assert option in str(info.value)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (RuntimeError("disk on fire"), IdempotencyBackendError),
        (ConnectionError("refused"), IdempotencyConnectionError),
        (TimeoutError("timed out"), IdempotencyConnectionError),
    ],
)
def test_rule_11_store_failures_surface_as_idempotency_errors_with_cause(
    make_guard, provider, failure, expected
):
    class BrokenStore(MemoryIdempotencyStore):
        def get(self, key):
            raise failure

    guard = make_guard(store=BrokenStore())
    fn = counting()
    with pytest.raises(expected) as info:
        guard.execute("k", fn)
    assert type(info.value) is expected
    assert info.value.key == "k"
    assert info.value.__cause__ is failure
    assert fn.calls == 0
    assert not provider.is_locked(guard.lock_resource("k"))


def test_rule_11_lock_failures_surface_as_idempotency_errors_with_cause(make_guard):
    failure = ConnectionError("redis down")

    class BrokenProvider(MemoryLockProvider):
        def acquire(self, resource, ttl):
            raise failure

    guard = make_guard(lock_provider=BrokenProvider())
    with pytest.raises(IdempotencyConnectionError) as info:
        guard.execute("k", counting())
    assert info.value.key == "k"
    assert info.value.__cause__ is failure


# -- rule 12 --------------------------------------------------------------------------------


def test_rule_12_memory_backends_expire_on_their_own_clocks(make_guard, clock):
    guard_clock = type(clock)(5_000.0)
    store = MemoryIdempotencyStore(clock=clock)
    provider = MemoryLockProvider(clock=clock)
    guard = make_guard(store=store, lock_provider=provider, clock=guard_clock, ttl=60)

    guard.execute("k", counting("r"))
    record = store.get(guard.record_key("k"))
    assert record.created_at == 5_000.0  # stamped by the guard's clock

    guard_clock.advance(10**6)  # the guard's clock does not expire anything
    assert guard.run("k", counting("x")).replayed

    clock.advance(61)  # the store's clock does
    assert guard.execute("k", counting("fresh")) == "fresh"

    lease = provider.acquire("r", 5)
    guard_clock.advance(10**6)
    assert provider.is_locked("r")
    clock.advance(5)
    assert not provider.is_locked("r")
    assert not provider.release(lease)


def test_rule_12_event_elapsed_uses_the_guard_clock(make_guard, clock):
    events = []

    def body():
        clock.advance(7)
        return 1

    guard = make_guard(clock=clock, on_event=events.append)
    guard.execute("k", body)
    committed = [e for e in events if e.kind == "committed"]
    assert len(committed) == 1
    assert committed[0].elapsed == 7
    assert committed[0].key == "k"


def test_rule_12_record_created_at_defaults_to_wall_clock(guard, store):
    before = time.time()
    guard.execute("k", counting())
    after = time.time()
    assert before <= store.get(guard.record_key("k")).created_at <= after
