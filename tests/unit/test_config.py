"""Bad configuration fails at construction with ValueError or TypeError, and the message
names the option and the value it got (SPEC §3 rule 11)."""

from __future__ import annotations

import datetime as dt
import time

import pytest

from celery_idempotent import (
    DistributedIdempotencyGuard,
    MemoryIdempotencyStore,
    MemoryLockProvider,
)

NAN, INF = float("nan"), float("inf")

DURATION_BAD = [
    (0, ValueError),
    (0.0, ValueError),
    (-1, ValueError),
    (-0.001, ValueError),
    (dt.timedelta(0), ValueError),
    (dt.timedelta(seconds=-5), ValueError),
    (NAN, ValueError),
    (INF, ValueError),
    (-INF, ValueError),
    (10**400, ValueError),  # too large for a float: still a bad argument, not a crash
    ("10", TypeError),
    (None, TypeError),
    (True, TypeError),  # a bool is an int to Python, but never a duration
    ([10], TypeError),
    (b"10", TypeError),
]
DELAY_BAD = [
    (-1, ValueError),
    (-0.001, ValueError),
    (dt.timedelta(seconds=-1), ValueError),
    (NAN, ValueError),
    (INF, ValueError),
    (10**400, ValueError),
    ("0.1", TypeError),
    (False, TypeError),
    (object(), TypeError),
]
COUNT_BAD = [
    (-1, ValueError),
    (-100, ValueError),
    (1.5, TypeError),
    (3.0, TypeError),
    ("3", TypeError),
    (None, TypeError),
    (True, TypeError),
]

CASES = (
    # ttl may be 0 (idempotency_ttl=0: nothing kept once the body ends); below 0 it is bad.
    [("ttl", v, e) for v, e in DURATION_BAD if v not in (0, dt.timedelta(0))]
    + [("lock_ttl", v, e) for v, e in DURATION_BAD]
    + [("renew_interval", v, e) for v, e in DURATION_BAD if v is not None]  # None: default
    + [("retry_count", v, e) for v, e in COUNT_BAD]
    + [("retry_base_delay", v, e) for v, e in DELAY_BAD]
    + [("retry_max_delay", v, e) for v, e in DELAY_BAD]
    + [
        ("renew_interval", 10, ValueError),  # not shorter than the default lock_ttl of 10
        ("renew_interval", 11.5, ValueError),
        ("key_prefix", 123, TypeError),
        ("key_prefix", None, TypeError),
        ("key_prefix", b"idem:", TypeError),
        ("key_prefix", "app{1}:", ValueError),
        ("key_prefix", "app}", ValueError),
    ]
)


def case_id(case):
    option, value, _ = case
    return f"{option}={value!r}"[:40]


@pytest.mark.parametrize(("option", "value", "error"), CASES, ids=[case_id(c) for c in CASES])
def test_bad_option_fails_at_construction_naming_option_and_value(make_guard, option, value, error):
    with pytest.raises(error) as info:
        make_guard(**{option: value})
    message = str(info.value)
    assert option in message
    assert repr(value) in message or str(value) in message


@pytest.mark.parametrize("option", ["store", "lock_provider"])
@pytest.mark.parametrize("value", [None, object(), "redis://localhost", 42])
def test_backend_that_is_not_one_fails_naming_option_and_type(make_guard, option, value):
    with pytest.raises(TypeError) as info:
        make_guard(**{option: value})
    message = str(info.value)
    assert option in message
    assert type(value).__name__ in message


def test_backend_missing_a_method_is_named(make_guard):
    class HalfStore:
        def get(self, key):
            return None

        def set(self, key, record, ttl):
            pass

    with pytest.raises(TypeError, match=r"store .*HalfStore.* delete"):
        make_guard(store=HalfStore())


@pytest.mark.parametrize("option", ["clock", "sleep", "random", "fingerprint_fn", "on_event"])
@pytest.mark.parametrize("value", [42, "time.time"])
def test_callables_that_are_not_callable_fail_naming_option_and_value(make_guard, option, value):
    with pytest.raises(TypeError) as info:
        make_guard(**{option: value})
    message = str(info.value)
    assert option in message
    assert repr(value) in message


def test_options_are_keyword_only():
    with pytest.raises(TypeError):
        DistributedIdempotencyGuard(MemoryIdempotencyStore(), MemoryLockProvider())  # type: ignore[misc]


@pytest.mark.parametrize("backend", [MemoryIdempotencyStore, MemoryLockProvider])
@pytest.mark.parametrize("clock", [42, "monotonic", None])
def test_memory_backend_clock_must_be_callable(backend, clock):
    with pytest.raises(TypeError) as info:
        backend(clock=clock)
    assert "clock" in str(info.value)
    assert repr(clock) in str(info.value)


def test_good_configuration_is_normalized(make_guard):
    guard = make_guard(
        ttl=dt.timedelta(hours=1),
        lock_ttl=3,
        retry_count=0,
        retry_base_delay=0,
        retry_max_delay=dt.timedelta(milliseconds=500),
        renew_interval=0.5,
        key_prefix="",
        clock=time.time,
    )
    assert guard.ttl == 3600.0
    assert guard.lock_ttl == 3.0
    assert guard.retry_count == 0
    assert guard.retry_base_delay == 0.0
    assert guard.retry_max_delay == 0.5
    assert guard.renew_interval == 0.5
    assert guard.lock_resource("k") == "lock:{k}"
    assert guard.execute("k", lambda: "ok") == "ok"


def test_defaults_follow_the_spec(make_guard):
    guard = make_guard()
    assert guard.ttl == 86_400
    assert guard.lock_ttl == 10
    assert guard.retry_count == 3
    assert guard.retry_base_delay == 0.1
    assert guard.retry_max_delay is None
    assert guard.renew_interval == pytest.approx(10 / 3)
    assert guard.key_prefix == "idempotency:"
