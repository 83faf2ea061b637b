"""IdempotentTask without a worker: ``apply()``, ``task_always_eager``, a direct call, and the
log lines (caplog); the store is the test Redis under the test's ``key_prefix``."""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery, Task, chain, chord, current_task, group
from celery.exceptions import Ignore, Reject

from celery_idempotent import (
    IdempotencyMismatchError,
    IdempotentTask,
    LockAcquisitionError,
    current_lease,
)
from celery_idempotent.backends.redis.client import glob_escape
from celery_idempotent.core.fingerprint import key_digest as _hash
from tests.celery.cidem_helpers import key_of, redis_names

pytestmark = pytest.mark.redis


class Calls:
    """Counts body runs per name in this process."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, name: str) -> int:
        with self.lock:
            self.counts[name] = self.counts.get(name, 0) + 1
            return self.counts[name]

    def __getitem__(self, name: str) -> int:
        return self.counts.get(name, 0)


@pytest.fixture
def calls() -> Calls:
    return Calls()


def keys_under(redis_client: Any, prefix: str) -> list[bytes]:
    return list(redis_client.scan_iter(match=glob_escape(prefix) + "*"))


# --------------------------------------------------------------------------- apply / eager


def test_apply_runs_once_and_replays(make_app: Callable[..., Celery], calls: Calls) -> None:
    app = make_app()

    @app.task(shared=False, base=IdempotentTask)
    def pay(order: int, amount: int) -> dict[str, Any]:
        return {"order": order, "run": calls("pay"), "token": uuid.uuid4().hex}

    first = pay.apply((1, 10))
    second = pay.apply((1, 10))
    other = pay.apply((2, 10))

    assert first.state == second.state == "SUCCESS"
    assert second.get() == first.get()
    assert other.get()["order"] == 2
    assert calls["pay"] == 2


def test_the_body_sees_its_delivery_as_a_plain_task_does(
    make_app: Callable[..., Celery], calls: Calls
) -> None:
    """The body is run without Task.__call__'s copy of the request: what it reads from
    ``self.request`` and ``current_task`` is the delivery's own, as in a plain task."""
    app = make_app()

    @app.task(shared=False, bind=True, base=IdempotentTask)
    def pay(self: Any, order: int, amount: int = 5) -> dict[str, Any]:
        calls("pay")
        request = self.request
        return {
            "id": request.id,
            "args": list(request.args),
            "kwargs": dict(request.kwargs),
            "current": current_task.name if current_task else None,
            "lease": current_lease() is not None,
        }

    first = pay.apply((1,), {"amount": 7}, task_id="t-1").get()
    assert first == {
        "id": "t-1",
        "args": [1],
        "kwargs": {"amount": 7},
        "current": pay.name,
        "lease": True,
    }
    assert pay.apply((1,), {"amount": 7}, task_id="t-2").get() == first  # replayed
    assert calls["pay"] == 1
    assert not current_task  # popped after the call


def test_a_mixin_call_after_idempotent_task_still_wraps_the_body(
    make_app: Callable[..., Celery], calls: Calls
) -> None:
    """A base class whose ``__call__`` comes after IdempotentTask's in the MRO (tracing,
    metrics) runs around the body, as it did: only Celery's own Task.__call__ is skipped."""
    app = make_app()
    seen: list[tuple[str, Any]] = []

    class Traced(Task):  # type: ignore[misc]
        abstract = True

        def __call__(self, *args: Any, **kwargs: Any) -> Any:
            seen.append(("before", self.request.id))
            try:
                return super().__call__(*args, **kwargs)
            finally:
                seen.append(("after", self.request.id))

    class Base(IdempotentTask, Traced):
        abstract = True

    @app.task(shared=False, base=Base)
    def pay(order: int) -> int:
        return calls("pay")

    assert pay.apply((1,), task_id="m-1").get() == 1
    assert pay.apply((1,), task_id="m-2").get() == 1  # replayed: the body does not run
    assert calls["pay"] == 1
    assert seen == [("before", "m-1"), ("after", "m-1")]


def test_task_always_eager_runs_once(make_app: Callable[..., Celery], calls: Calls) -> None:
    app = make_app(task_always_eager=True)

    @app.task(shared=False, base=IdempotentTask)
    def pay(order: int, amount: int) -> dict[str, Any]:
        return {"run": calls("pay"), "token": uuid.uuid4().hex}

    values = [pay.delay(1, 10).get() for _ in range(3)]
    values.append(pay.apply_async((1,), {"amount": 10}).get())

    assert values == [values[0]] * 4
    assert calls["pay"] == 1


def test_direct_call_runs_plainly_and_creates_no_keys(
    make_app: Callable[..., Celery], calls: Calls, redis_client: Any, key_prefix: str
) -> None:
    app = make_app()

    leases: list[Any] = []

    @app.task(shared=False, base=IdempotentTask)
    def pay(order: int, amount: int) -> int:
        leases.append(current_lease())
        return calls("pay")

    assert pay(1, 10) == 1
    assert pay(1, 10) == 2
    assert pay.run(1, 10) == 3
    assert leases == [None, None, None]
    assert keys_under(redis_client, key_prefix) == []
    assert pay.apply((1, 10)).get() == 4  # through the guard: under a lease, then stored
    assert leases[-1] is not None
    assert keys_under(redis_client, key_prefix) != []


@pytest.mark.parametrize("strategy", ["task_id", "args", "fixed"])
def test_direct_recursive_call_inside_the_body_runs_plainly(
    make_app: Callable[..., Celery],
    calls: Calls,
    redis_client: Any,
    key_prefix: str,
    strategy: str,
) -> None:
    """A body that calls its own task directly makes a plain call: it has no request of its
    own (Celery leaves the outer one on top of the stack), so it must neither take the outer
    delivery's key (held: LockAcquisitionError, or a re-queue of the outer request with the
    inner arguments) nor store records of its own."""
    app = make_app(idempotency_on_locked="raise", idempotency_retry_count=0)

    @app.task(
        shared=False, base=IdempotentTask, idempotency_key=strategy if strategy != "fixed" else "k"
    )
    def fact(n: int) -> int:
        calls("fact")
        assert current_lease() is not None  # the outer delivery's lease, still ours
        return 1 if n <= 1 else n * fact(n - 1)

    result = fact.apply((4,), task_id="outer")

    assert result.get() == 24
    assert calls["fact"] == 4
    # the outer delivery's record (and its fencing counter) only
    tags = {name.split(b"{")[1].split(b"}")[0] for name in keys_under(redis_client, key_prefix)}
    assert len(tags) == 1
    assert fact.apply((4,), task_id="outer").get() == 24
    assert calls["fact"] == 4


def test_eager_replay_of_a_tuple_equals_the_first_result(
    make_app: Callable[..., Celery], calls: Calls
) -> None:
    """JSON turns a tuple into a list; the first caller and the replay get the same value."""
    app = make_app(task_always_eager=True)

    @app.task(shared=False, base=IdempotentTask)
    def pair(a: int) -> tuple[int, int]:
        calls("pair")
        return (a, a + 1)

    first = pair.delay(1).get()
    replay = pair.delay(1).get()

    assert replay == [1, 2]
    assert first == replay
    assert calls["pair"] == 1


def test_eager_chain_and_chord(make_app: Callable[..., Celery], calls: Calls) -> None:
    app = make_app(task_always_eager=True)

    @app.task(shared=False, base=IdempotentTask)
    def add(x: int, y: int) -> int:
        calls(f"add{x},{y}")
        return x + y

    @app.task(shared=False, base=IdempotentTask)
    def total(values: list[int]) -> int:
        calls("total")
        return sum(values)

    assert chain(add.s(1, 2), add.s(10)).apply_async().get() == 13
    assert chain(add.s(1, 2), add.s(10)).apply_async().get() == 13
    parts = [add.s(1, 1), add.s(1, 1), add.s(2, 2)]
    assert chord(parts)(total.s()).get() == 8
    assert chord(parts)(total.s()).get() == 8
    assert group(add.s(1, 1), add.s(1, 1)).apply_async().get() == [2, 2]

    assert calls["add1,2"] == 1
    assert calls["add3,10"] == 1
    assert calls["add1,1"] == 1
    assert calls["add2,2"] == 1
    assert calls["total"] == 1


def test_eager_self_retry_commits_once(make_app: Callable[..., Celery], calls: Calls) -> None:
    app = make_app(task_always_eager=True)

    @app.task(shared=False, base=IdempotentTask, bind=True, max_retries=3, idempotency_lock_ttl=10)
    def flaky(self: Any, order: int) -> int:
        n = calls("flaky")
        if n <= 2:
            raise self.retry(countdown=0)
        return n

    started = time.monotonic()
    flaky.delay(1)
    assert time.monotonic() - started < 5  # the retries were not blocked by the lock
    assert calls["flaky"] == 3
    assert flaky.delay(1).get() == 3
    assert calls["flaky"] == 3


def test_explicit_key_mismatch_in_apply(make_app: Callable[..., Celery], calls: Calls) -> None:
    app = make_app()

    @app.task(shared=False, base=IdempotentTask)
    def pay(order: int, amount: int) -> int:
        return calls("pay")

    headers = {"idempotency_key": "payment-42"}
    assert pay.apply((1, 10), headers=headers).get() == 1
    assert pay.apply((1, 10), headers=headers).get() == 1
    refused = pay.apply((1, 20), headers=headers)

    assert refused.state == "FAILURE"
    with pytest.raises(IdempotencyMismatchError) as caught:
        refused.get()
    assert caught.value.key == f"{pay.name}:key:payment-42"
    assert calls["pay"] == 1


def test_failures_and_control_flow_store_nothing(
    make_app: Callable[..., Celery], calls: Calls
) -> None:
    app = make_app()
    outcome: dict[str, Any] = {}

    @app.task(shared=False, base=IdempotentTask)
    def step(order: int) -> int:
        n = calls("step")
        effect = outcome.get(n)
        if effect is not None:
            raise effect
        return n

    outcome.update({1: RuntimeError("boom"), 2: Ignore(), 3: Reject("no", requeue=False)})
    assert step.apply((1,)).state == "FAILURE"
    assert step.apply((1,)).state == "IGNORED"
    assert step.apply((1,)).state == "REJECTED"
    assert step.apply((1,)).get() == 4
    assert step.apply((1,)).get() == 4
    assert calls["step"] == 4


# --------------------------------------------------------------------------- on_locked (eager)


def _hold(task: Any, *args: Any, ttl: float = 10) -> Any:
    """Take the key's lock as another delivery would; returns the lease."""
    guard = task.idempotency_guard()
    resource, _ = redis_names(task, key_of(task, *args))
    lease = guard.lock_provider.acquire(resource, ttl)
    assert lease is not None
    return guard, lease


def test_on_locked_raise_and_ignore_in_apply(make_app: Callable[..., Celery], calls: Calls) -> None:
    app = make_app()
    fast = {"idempotency_retry_count": 1, "idempotency_retry_base_delay": 0.01}

    @app.task(shared=False, base=IdempotentTask, idempotency_on_locked="raise", **fast)
    def raising(order: int) -> int:
        return calls("raising")

    @app.task(shared=False, base=IdempotentTask, idempotency_on_locked="ignore", **fast)
    def ignoring(order: int) -> int:
        return calls("ignoring")

    _hold(raising, 1)
    _hold(ignoring, 1)
    refused = raising.apply((1,))
    ignored = ignoring.apply((1,))

    assert refused.state == "FAILURE"
    with pytest.raises(LockAcquisitionError) as caught:
        refused.get()
    assert caught.value.attempts == 2
    assert caught.value.key == key_of(raising, 1)
    assert ignored.state == "IGNORED"
    assert calls["raising"] == calls["ignoring"] == 0


def test_on_locked_retry_in_apply_waits_for_the_lease(
    make_app: Callable[..., Celery], calls: Calls
) -> None:
    app = make_app()

    @app.task(
        shared=False,
        base=IdempotentTask,
        max_retries=0,
        idempotency_retry_count=0,
        idempotency_retry_base_delay=0.05,
        idempotency_lock_ttl=1,
    )
    def pay(order: int) -> int:
        return calls("pay")

    guard, lease = _hold(pay, 1, ttl=5)
    timer = threading.Timer(0.6, guard.lock_provider.release, (lease,))
    timer.start()
    try:
        started = time.monotonic()
        result = pay.apply((1,))
        waited = time.monotonic() - started
    finally:
        timer.cancel()

    assert result.get() == 1
    assert waited >= 0.5
    # a lease that nobody releases (a killed holder) runs out by itself
    _hold(pay, 2, ttl=1)
    assert pay.apply((2,)).get() == 2


# --------------------------------------------------------------------------- logs


SECRET = "4111-1111-1111-1111"


def test_replay_and_contention_log_lines_name_the_task_and_hide_arguments(
    make_app: Callable[..., Celery], calls: Calls, caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()

    @app.task(
        shared=False,
        base=IdempotentTask,
        idempotency_on_locked="raise",
        idempotency_retry_count=0,
        idempotency_key="card:{card}",
    )
    def charge(card: str, amount: int) -> int:
        return calls("charge")

    caplog.set_level(logging.INFO, logger="celery_idempotent")
    charge.apply((SECRET, 10), task_id="first-id")
    replay = charge.apply((SECRET, 10), task_id="replay-id")
    key = key_of(charge, SECRET, 10)
    _hold(charge, "other-card", 5)
    contended = charge.apply(("other-card", 5), task_id="contended-id")

    assert replay.get() == 1
    assert contended.state == "FAILURE"
    ours = [r for r in caplog.records if r.name == "celery_idempotent"]
    replays = [r for r in ours if "replayed" in r.getMessage()]
    contentions = [r for r in ours if "held by another" in r.getMessage()]
    assert len(replays) == 1
    assert len(contentions) == 1
    for record, task_id, raw_key in (
        (replays[0], "replay-id", key),
        (contentions[0], "contended-id", key_of(charge, "other-card", 5)),
    ):
        message = record.getMessage()
        assert record.levelno == logging.INFO
        assert charge.name in message
        assert task_id in message
        assert _hash(raw_key) in message
        assert raw_key not in message
    for record in ours:
        message = record.getMessage()
        assert SECRET not in message
        assert "other-card" not in message
