"""Back-off between lock attempts, on fake sleep and fixed randomness; abort on a real wait."""

from __future__ import annotations

import random
import threading
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from celery_idempotent import (
    ExponentialJitterBackoff,
    IdempotencyAbortedError,
    LockAcquisitionError,
)
from celery_idempotent.core.backoff import event_sleep


def body_never_called():
    raise AssertionError("the body must not run")


@settings(max_examples=200, database=None)
@given(
    base=st.floats(min_value=1e-4, max_value=10, allow_nan=False),
    retry=st.integers(min_value=0, max_value=40),
    jitter=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_each_wait_is_within_base_times_two_to_the_i_plus_base(base, retry, jitter):
    delay = ExponentialJitterBackoff(base, random=lambda: jitter).delay(retry)
    low = base * 2**retry
    assert low <= delay <= low + base
    assert delay == pytest.approx(low + jitter * base)


@settings(max_examples=200, database=None)
@given(
    base=st.floats(min_value=1e-4, max_value=10, allow_nan=False),
    cap=st.floats(min_value=0, max_value=100, allow_nan=False),
    retry=st.integers(min_value=0, max_value=10_000),
    jitter=st.floats(min_value=0, max_value=1, exclude_max=True),
)
def test_retry_max_delay_caps_every_wait(base, cap, retry, jitter):
    delay = ExponentialJitterBackoff(base, cap, random=lambda: jitter).delay(retry)
    assert 0 <= delay <= cap
    uncapped = ExponentialJitterBackoff(base, random=lambda: jitter).delay(min(retry, 40))
    if uncapped <= cap and retry <= 40:
        assert delay == uncapped


def test_base_zero_never_waits():
    backoff = ExponentialJitterBackoff(0.0, random=lambda: 0.99)
    assert [backoff.delay(i) for i in range(100)] == [0.0] * 100


def test_huge_retry_numbers_do_not_overflow():
    assert ExponentialJitterBackoff(0.1, 5.0).delay(10**6) == 5.0


def test_guard_waits_follow_the_formula_on_a_fake_sleep(make_guard, provider, sleeps):
    guard = make_guard(retry_count=6, retry_base_delay=0.05, random=lambda: 0.75)
    provider.acquire(guard.lock_resource("k"), 60)

    with pytest.raises(LockAcquisitionError) as info:
        guard.execute("k", body_never_called)

    assert info.value.attempts == 7
    assert sleeps.delays == pytest.approx([0.05 * 2**i + 0.75 * 0.05 for i in range(6)])


def test_guard_waits_with_real_randomness_stay_in_bounds(make_guard, provider, sleeps):
    rng = random.Random(1234)
    guard = make_guard(retry_count=8, retry_base_delay=0.01, random=rng.random)
    provider.acquire(guard.lock_resource("k"), 60)
    with pytest.raises(LockAcquisitionError):
        guard.execute("k", body_never_called)
    assert len(sleeps.delays) == 8
    for i, delay in enumerate(sleeps.delays):
        assert 0.01 * 2**i <= delay <= 0.01 * 2**i + 0.01
    assert len(set(sleeps.delays)) == 8  # jittered, not lockstep


def test_guard_retry_max_delay_caps_each_wait(make_guard, provider, sleeps):
    guard = make_guard(retry_count=6, retry_base_delay=0.1, retry_max_delay=0.5, random=lambda: 0)
    provider.acquire(guard.lock_resource("k"), 60)
    with pytest.raises(LockAcquisitionError):
        guard.execute("k", body_never_called)
    assert sleeps.delays == pytest.approx([0.1, 0.2, 0.4, 0.5, 0.5, 0.5])


def test_guard_base_zero_means_no_wait(make_guard, provider, sleeps):
    guard = make_guard(retry_count=5, retry_base_delay=0, random=lambda: 0.9)
    provider.acquire(guard.lock_resource("k"), 60)
    with pytest.raises(LockAcquisitionError) as info:
        guard.execute("k", body_never_called)
    assert info.value.attempts == 6
    assert sleeps.delays == [0.0] * 5


@pytest.mark.parametrize("retry_count", [0, 1, 2, 7])
def test_lock_acquisition_error_counts_every_attempt(make_guard, provider, retry_count):
    attempts = []

    class CountingProvider(type(provider)):
        def acquire(self, resource, ttl):
            """Always held by someone else: records the attempt, grants no lease."""
            attempts.append(resource)

    guard = make_guard(lock_provider=CountingProvider(), retry_count=retry_count)
    with pytest.raises(LockAcquisitionError) as info:
        guard.execute("k", body_never_called)
    assert info.value.attempts == 1 + retry_count == len(attempts)
    assert info.value.key == "k"


def test_abort_wakes_a_long_real_wait_at_once(make_guard, provider):
    guard = make_guard(retry_count=3, retry_base_delay=30, sleep=event_sleep)
    holder = provider.acquire(guard.lock_resource("k"), 60)
    abort = threading.Event()
    timer = threading.Timer(0.05, abort.set)

    started = time.monotonic()
    timer.start()
    try:
        with pytest.raises(IdempotencyAbortedError) as info:
            guard.execute("k", body_never_called, abort=abort)
    finally:
        timer.cancel()
    elapsed = time.monotonic() - started

    assert elapsed < 5  # a loose bound: woken by the event, not by the 30 s back-off
    assert info.value.key == "k"
    assert info.value.attempts == 1
    assert provider.release(holder)  # the holder still owned it; nothing else was taken
    assert len(provider) == 0


def test_abort_set_before_the_first_attempt_makes_no_attempt(make_guard, provider, sleeps):
    guard = make_guard(retry_count=3, retry_base_delay=30)
    abort = threading.Event()
    abort.set()
    with pytest.raises(IdempotencyAbortedError) as info:
        guard.execute("k", body_never_called, abort=abort)
    assert info.value.attempts == 0
    assert sleeps.delays == []
    assert len(provider) == 0


def test_event_sleep_returns_whether_it_was_aborted():
    abort = threading.Event()
    assert event_sleep(0.001, abort) is False
    assert event_sleep(0, abort) is False
    assert event_sleep(0.001, None) is False
    assert event_sleep(0, None) is False
    abort.set()
    assert event_sleep(30, abort) is True  # returns at once: the event is already set
    assert event_sleep(0, abort) is True


def test_the_commit_resend_back_off_doubles_from_50ms_to_1s_without_jitter() -> None:
    from celery_idempotent.core.commit import COMMIT_RESEND

    assert [COMMIT_RESEND.delay(i) for i in range(8)] == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]


def test_equal_jitter_caps_then_scales_by_half_to_one() -> None:
    low = ExponentialJitterBackoff(0.1, 5.0, lambda: 0.0, jitter="equal")
    high = ExponentialJitterBackoff(0.1, 5.0, lambda: 0.999, jitter="equal")
    assert low.delay(0) == 0.05
    assert low.delay(10) == 2.5  # 0.1 * 1024 capped at 5, times 0.5
    assert high.delay(10) == 5.0 * (0.5 + 0.999 / 2)


def test_an_unknown_jitter_is_refused() -> None:
    with pytest.raises(ValueError, match="jitter"):
        ExponentialJitterBackoff(0.1, jitter="full")  # type: ignore[arg-type]
