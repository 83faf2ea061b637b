"""The controls of issue 14 in one process (``apply()`` against the test Redis): which arguments
must match (``idempotency_fingerprint``), keys with a ``None`` field
(``idempotency_missing_key``), stored failures (``idempotency_store_errors``), key namespaces
(``idempotency_namespace``) and ``idempotency_on_locked="reject"``. The same behaviours with
real workers are in ``test_task_controls_workers.py``."""

from __future__ import annotations

import logging
import sys
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.exceptions import Ignore, Reject, Retry, SoftTimeLimitExceeded

from celery_idempotent import (
    IdempotencyError,
    IdempotencyKeyMissingError,
    IdempotencyMismatchError,
    IdempotentTask,
)
from celery_idempotent.celery.task import FAILURE_MARKER, check_namespaces
from tests.celery.cidem_helpers import key_of, redis_names

pytestmark = pytest.mark.redis


class CardDeclinedError(Exception):
    """A terminal failure of a payment: stored, so that a retry never charges."""

    def __init__(self, order_id: int, reason: str) -> None:
        super().__init__(order_id, reason)
        self.order_id = order_id
        self.reason = reason


def name() -> str:
    return f"controls.t{uuid.uuid4().hex[:8]}"


# --------------------------------------------------------------------------- fingerprint


def test_a_fingerprint_over_named_arguments_lets_the_others_differ(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    runs: list[str] = []

    def charge(order_id: int, amount: int, requested_at: str) -> dict[str, Any]:
        runs.append(requested_at)
        return {"order": order_id, "amount": amount, "at": requested_at}

    strict = app.task(
        charge, shared=False, base=IdempotentTask, name=name(), idempotency_key="o:{order_id}"
    )
    loose = app.task(
        charge,
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_fingerprint=("order_id", "amount"),
    )

    first = loose.apply((1, 10, "09:00")).get()
    assert loose.apply((1, 10, "09:05")).get() == first  # replay: requested_at may differ
    mismatch = loose.apply((1, 11, "09:06")).result  # amount must match
    assert isinstance(mismatch, IdempotencyMismatchError)

    strict.apply((1, 10, "09:00")).get()
    assert isinstance(strict.apply((1, 10, "09:05")).result, IdempotencyMismatchError)
    assert runs == ["09:00", "09:00"]


def test_fingerprint_none_never_compares_and_a_callable_decides(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    runs: list[int] = []

    def body(order_id: int, amount: int) -> int:
        runs.append(amount)
        return amount

    unchecked = app.task(
        body,
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_fingerprint=None,
    )
    seen: list[tuple[Any, ...]] = []

    def by_amount_sign(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        seen.append((task.name, args, kwargs))
        amount = args[1] if len(args) > 1 else kwargs["amount"]
        return None if amount == 0 else ("refund" if amount < 0 else "charge")

    by_fn = app.task(
        body,
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_fingerprint=by_amount_sign,
    )

    assert unchecked.apply((1, 10)).get() == 10
    assert unchecked.apply((1, 99)).get() == 10  # no check: the stored result
    assert by_fn.apply((2, 10)).get() == 10
    assert by_fn.apply((2, 20)).get() == 10  # both "charge"
    assert isinstance(by_fn.apply((2, -5)).result, IdempotencyMismatchError)
    assert by_fn.apply((2,), {"amount": 0}).get() == 10  # None: this call is not compared
    assert runs == [10, 10]
    assert seen[0] == (by_fn.name, (2, 10), {})


def test_the_fingerprint_setting_is_the_app_default_and_a_task_can_say_none(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(idempotency_fingerprint=("order_id",))
    runs: list[int] = []

    def body(order_id: int, amount: int) -> int:
        runs.append(amount)
        return amount

    by_app = app.task(
        body, shared=False, base=IdempotentTask, name=name(), idempotency_key="o:{order_id}"
    )
    opted_out = app.task(
        body,
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_fingerprint=None,
    )
    assert by_app.idempotency_settings().idempotency_fingerprint == ("order_id",)
    assert opted_out.idempotency_settings().idempotency_fingerprint is None
    assert by_app.apply((1, 10)).get() == 10
    assert by_app.apply((1, 20)).get() == 10
    assert opted_out.apply((1, 10)).get() == 10
    assert opted_out.apply((1, 30)).get() == 10
    assert runs == [10, 10]


def test_a_fingerprint_naming_an_unknown_argument_fails_naming_it(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()

    @app.task(
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_fingerprint=("order_id", "amonut"),
    )
    def charge(order_id: int, amount: int) -> int:
        raise AssertionError("never runs")

    result = charge.apply((1, 10))
    assert isinstance(result.result, ValueError)
    assert "idempotency_fingerprint" in str(result.result)
    assert "amonut" in str(result.result)
    assert "order_id, amount" in str(result.result)  # what the task has


def test_fingerprint_args_key_still_covers_every_argument(
    make_app: Callable[..., Celery],
) -> None:
    """Under the default "args" key a subset fingerprint changes nothing: the key itself
    already differs when any argument differs (the README says so)."""
    app = make_app()

    @app.task(shared=False, base=IdempotentTask, name=name(), idempotency_fingerprint=("order_id",))
    def charge(order_id: int, requested_at: str) -> str:
        return requested_at

    assert key_of(charge, 1, "a") != key_of(charge, 1, "b")
    assert charge.apply((1, "a")).get() == "a"
    assert charge.apply((1, "b")).get() == "b"


# --------------------------------------------------------------------------- missing keys


def test_a_none_format_field_is_a_missing_key(make_app: Callable[..., Celery]) -> None:
    app = make_app()
    runs: list[Any] = []

    @app.task(shared=False, base=IdempotentTask, name=name(), idempotency_key="user:{user_id}")
    def welcome(user_id: int | None, email: str) -> str:
        runs.append(user_id)
        return email

    result = welcome.apply((None, "a@example.com"))
    assert isinstance(result.result, IdempotencyKeyMissingError)
    assert isinstance(result.result, IdempotencyError)
    assert result.result.task == welcome.name
    assert result.result.field == "user_id"
    assert result.result.key == "user:{user_id}"
    assert welcome.name in str(result.result)
    assert "user_id" in str(result.result)
    assert runs == []
    assert welcome.apply((7, "a@example.com")).get() == "a@example.com"
    assert runs == [7]


@pytest.mark.parametrize(
    ("template", "value", "field"),
    [
        ("user:{user.id}", None, "user"),
        ("user:{user[id]}", {"id": None}, "user[id]"),
        ("user:{user[id]}", {"id": 0}, None),  # 0 is a key like any other
        ("user:{user}", "", None),  # so is ""
    ],
)
def test_missing_key_fields_inside_arguments(
    make_app: Callable[..., Celery], template: str, value: Any, field: str | None
) -> None:
    app = make_app()

    @app.task(shared=False, base=IdempotentTask, name=name(), idempotency_key=template)
    def body(user: Any) -> str:
        return "ran"

    result = body.apply((value,))
    if field is None:
        assert result.get() == "ran"
    else:
        assert isinstance(result.result, IdempotencyKeyMissingError)
        assert result.result.field == field


def test_a_key_callable_returning_none_is_a_missing_key(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    def tenant_key(task: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
        return None if args[0] is None else f"tenant-{args[0]}"

    @app.task(shared=False, base=IdempotentTask, name=name(), idempotency_key=tenant_key)
    def body(tenant: Any) -> str:
        return "ran"

    result = body.apply((None,))
    assert isinstance(result.result, IdempotencyKeyMissingError)
    assert result.result.field is None
    assert "tenant_key" in str(result.result)


def test_missing_key_run_runs_unguarded_with_one_warning_each(
    make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture, redis_client: Any
) -> None:
    app = make_app(idempotency_missing_key="run")
    runs: list[Any] = []

    @app.task(shared=False, base=IdempotentTask, name=name(), idempotency_key="user:{user_id}")
    def welcome(user_id: int | None) -> int:
        runs.append(user_id)
        return len(runs)

    with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
        assert welcome.apply((None,)).get() == 1
        assert welcome.apply((None,)).get() == 2
    assert runs == [None, None]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2
    assert all(welcome.name in w and "'user_id'" in w and "unguarded" in w for w in warnings)
    _, record = redis_names(welcome, f"{welcome.name}:key:user:None")
    assert not redis_client.exists(record)
    assert welcome.apply((3,)).get() == 3
    assert welcome.apply((3,)).get() == 3  # a key: guarded as before
    assert runs == [None, None, 3]


# --------------------------------------------------------------------------- stored failures


def test_a_listed_failure_is_stored_and_raised_again_without_running_the_body(
    make_app: Callable[..., Celery], redis_client: Any
) -> None:
    app = make_app()
    runs: list[int] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="pay:{order_id}",
        idempotency_store_errors=(CardDeclinedError,),
    )
    def charge(order_id: int) -> str:
        runs.append(order_id)
        raise CardDeclinedError(order_id, "insufficient funds")

    first = charge.apply((42,))
    assert type(first.result) is CardDeclinedError
    assert first.traceback is not None
    assert ", in charge\n" in first.traceback  # the original, raised in the body
    for _ in range(3):
        again = charge.apply((42,))
        assert again.state == "FAILURE"
        assert type(again.result) is CardDeclinedError
        assert again.result.args == (42, "insufficient funds")
        assert again.result.order_id == 42
    assert runs == [42]
    _, record = redis_names(charge, key_of(charge, 42))
    assert redis_client.exists(record)


def test_an_unlisted_failure_and_control_flow_are_not_stored(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    runs: list[str] = []
    raises: dict[str, BaseException] = {
        "value": ValueError("not listed"),
        "retry": Retry("retry later"),
        "ignore": Ignore(),
        "reject": Reject("no", requeue=False),
        "soft": SoftTimeLimitExceeded(),
    }

    @app.task(
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="k:{what}",
        idempotency_store_errors=(Exception,),  # every Exception, and still not these
    )
    def body(what: str) -> str:
        runs.append(what)
        raise raises[what]

    for what in raises:
        body.apply((what,))
        body.apply((what,))
    # ValueError is an Exception, so it is stored (listed through Exception); the control-flow
    # exceptions are not, whatever the tuple says.
    assert runs.count("value") == 1
    for what in ("retry", "ignore", "reject", "soft"):
        assert runs.count(what) == 2, what

    def divide(order_id: int) -> float:
        runs.append("unlisted")
        return order_id / 0

    other = app.task(
        divide,
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_store_errors=(CardDeclinedError,),
    )
    assert isinstance(other.apply((1,)).result, ZeroDivisionError)
    assert isinstance(other.apply((1,)).result, ZeroDivisionError)
    assert runs.count("unlisted") == 2  # not listed: not stored, the body runs again


def test_a_result_shaped_like_an_envelope_is_not_a_failure(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()

    @app.task(shared=False, base=IdempotentTask, name=name())
    def body(x: int) -> dict[str, Any]:
        return {FAILURE_MARKER: 1, "exc": {"exc_type": "ValueError"}, "x": x}

    assert body.apply((1,)).get()["x"] == 1
    assert body.apply((1,)).get()["x"] == 1


def test_a_stored_failure_naming_a_non_exception_is_refused(
    make_app: Callable[..., Celery], redis_client: Any
) -> None:
    """A planted record cannot make the replay call an arbitrary function (Celery's own
    check of stored exceptions applies)."""
    app = make_app()

    @app.task(
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_store_errors=(CardDeclinedError,),
    )
    def body(order_id: int) -> str:
        raise CardDeclinedError(order_id, "x")

    body.apply((1,))
    guard = body.idempotency_guard()
    rkey = guard.record_key(key_of(body, 1))
    stored = guard.store.get(rkey)
    assert stored is not None
    planted = {
        FAILURE_MARKER: 1,
        "exc": {"exc_module": "os", "exc_type": "system", "exc_message": ["true"]},
    }
    guard.store.set(rkey, type(stored)(planted, None, stored.created_at, 1), 60)
    result = body.apply((1,))
    assert type(result.result).__name__ == "SecurityError"


def test_a_listed_class_is_rebuilt_even_when_its_module_is_not_imported(
    make_app: Callable[..., Celery], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replay does not run the body, so the module the body imports the class from may not
    be in ``sys.modules`` (where Celery looks): the class comes from the tuple itself."""
    module = types.ModuleType(f"gateway_{uuid.uuid4().hex[:8]}")
    declined = type("Declined", (Exception,), {"__module__": module.__name__})
    module.Declined = declined  # type: ignore[attr-defined]
    app = make_app()

    @app.task(
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_store_errors=(declined,),
    )
    def body(order_id: int) -> str:
        raise declined(order_id, "no")

    monkeypatch.setitem(sys.modules, module.__name__, module)
    with pytest.raises(declined):
        body.apply((1,), throw=True)
    monkeypatch.delitem(sys.modules, module.__name__)
    with pytest.raises(declined) as again:
        body.apply((1,), throw=True)
    assert type(again.value) is declined
    assert again.value.args == (1, "no")


def test_stored_failures_with_the_pickle_serializer(make_app: Callable[..., Celery]) -> None:
    app = make_app(result_serializer="pickle", result_accept_content=["pickle", "json"])
    runs: list[int] = []

    @app.task(
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_key="o:{order_id}",
        idempotency_store_errors=(CardDeclinedError,),
    )
    def body(order_id: int) -> str:
        runs.append(order_id)
        raise CardDeclinedError(order_id, "pickled")

    body.apply((5,))
    again = body.apply((5,)).result
    assert type(again) is CardDeclinedError
    assert again.args == (5, "pickled")
    assert runs == [5]


# --------------------------------------------------------------------------- namespace


def test_a_fixed_namespace_keeps_the_records_across_a_rename(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app()
    runs: list[str] = []

    def charge(order_id: int) -> str:
        runs.append("ran")
        return f"charged-{order_id}"

    old = app.task(
        charge,
        shared=False,
        base=IdempotentTask,
        name="billing.tasks.charge",
        idempotency_namespace="billing.charge",
    )
    assert old.apply((42,)).get() == "charged-42"
    # renamed (a module move): a new task name, the same declared namespace
    new = app.task(
        charge,
        shared=False,
        base=IdempotentTask,
        name="payments.charge",
        idempotency_namespace="billing.charge",
    )
    assert (
        key_of(new, 42)
        == key_of(old, 42)
        == "billing.charge:args:" + key_of(old, 42).split(":args:")[1]
    )
    assert new.apply((42,)).get() == "charged-42"
    assert runs == ["ran"]
    # without a namespace, the task's name is the namespace: a rename loses the records
    plain = app.task(charge, shared=False, base=IdempotentTask, name="payments.charge2")
    assert key_of(plain, 42).startswith("payments.charge2:args:")
    plain.apply((42,)).get()
    assert runs == ["ran", "ran"]


def test_the_start_up_check_names_an_accidental_shared_namespace(
    make_app: Callable[..., Celery], caplog: pytest.LogCaptureFixture
) -> None:
    app = make_app()

    def body(x: int) -> int:
        return x

    prefix = f"ns{uuid.uuid4().hex[:6]}"
    app.task(
        body, shared=False, base=IdempotentTask, name=f"{prefix}.a", idempotency_namespace="shared"
    )
    app.task(
        body, shared=False, base=IdempotentTask, name=f"{prefix}.b", idempotency_namespace="shared"
    )
    # declares the name of another task as its namespace: that one did not agree to share
    app.task(body, shared=False, base=IdempotentTask, name=f"{prefix}.c")
    app.task(
        body,
        shared=False,
        base=IdempotentTask,
        name=f"{prefix}.d",
        idempotency_namespace=f"{prefix}.c",
    )
    # the same namespace on another key prefix does not share anything
    app.task(
        body,
        shared=False,
        base=IdempotentTask,
        name=f"{prefix}.e",
        idempotency_namespace=f"{prefix}.c",
        idempotency_key_prefix="elsewhere:",
    )
    app.finalize(auto=True)
    with caplog.at_level(logging.WARNING, logger="celery_idempotent"):
        messages = [m for m in check_namespaces(app) if prefix in m]

    assert len(messages) == 1
    assert f"tasks {prefix}.c, {prefix}.d share the key namespace '{prefix}.c'" in messages[0]
    assert f"({prefix}.c did not declare it)" in messages[0]
    assert "shared" not in messages[0].split("namespace")[1].split(" by")[0]
    assert f"celery-idempotent: {messages[0]}" in caplog.text


def test_an_app_wide_namespace_is_shared_by_accident(make_app: Callable[..., Celery]) -> None:
    app = make_app(idempotency_namespace="everything")

    def body() -> int:
        return 1

    app.task(body, shared=False, base=IdempotentTask, name="nsapp.a")
    app.task(body, shared=False, base=IdempotentTask, name="nsapp.b")
    app.finalize(auto=True)
    messages = [m for m in check_namespaces(app) if "'everything'" in m]
    assert len(messages) == 1
    assert "nsapp.a, nsapp.b" in messages[0]


# --------------------------------------------------------------------------- on_locked


def test_on_locked_reject_rejects_without_requeue(make_app: Callable[..., Celery]) -> None:
    app = make_app()

    @app.task(
        shared=False,
        base=IdempotentTask,
        name=name(),
        idempotency_on_locked="reject",
        idempotency_retry_count=0,
    )
    def body(x: int) -> int:
        return x

    guard = body.idempotency_guard()
    lease = guard.lock_provider.acquire(guard.lock_resource(key_of(body, 1)), 10)
    assert lease is not None
    try:
        result = body.apply((1,))
        assert result.state == "REJECTED"
        assert isinstance(result.result, Reject)
        assert result.result.requeue is False
    finally:
        guard.lock_provider.release(lease)
    assert body.apply((1,)).get() == 1
