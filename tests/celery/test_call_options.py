"""Per-call ``idempotency_*`` options of ``apply_async`` (issue 22, SPEC §8): each takes effect
for that call or raises ``TypeError`` naming it. In one process against the test Redis (eager
calls go through the message's headers as a worker's would); ``test_lifecycle.py`` shows the
values reaching a real worker."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from celery_idempotent import IdempotentTask, keyspace
from celery_idempotent.backends.redis.key_info import read_key
from celery_idempotent.celery.call_options import CALL_OPTIONS_HEADER, PER_CALL
from celery_idempotent.celery.keys import admin_key

pytestmark = pytest.mark.redis


def _task(app: Celery, **options: Any) -> Any:
    @app.task(base=IdempotentTask, name=f"opts.t-{uuid.uuid4().hex[:6]}", shared=False, **options)
    def body(x: int) -> int:
        return x

    return body


@pytest.mark.parametrize(
    "name", ["idempotency_lock_ttl", "idempotency_key", "idempotency_enabled", "idempotency_tll"]
)
def test_an_option_that_cannot_be_set_per_call_raises_type_error_naming_it(
    make_app: Callable[..., Celery], name: str
) -> None:
    task = _task(make_app(task_always_eager=True))
    with pytest.raises(TypeError, match=name):
        task.apply_async((1,), **{name: 1})


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("idempotency_ttl", -1),
        ("idempotency_publish_ttl", "soon"),
        ("idempotency_window", 0),
        ("idempotency_on_duplicate_publish", "twice"),
    ],
)
def test_a_bad_per_call_value_is_refused_naming_the_option(
    make_app: Callable[..., Celery], name: str, value: Any
) -> None:
    task = _task(make_app(task_always_eager=True))
    with pytest.raises((TypeError, ValueError), match=name):
        task.apply_async((1,), **{name: value})


def test_per_call_ttl_is_the_records_ttl(make_app: Callable[..., Celery]) -> None:
    task = _task(make_app(task_always_eager=True))
    assert task.apply_async((5,), idempotency_ttl=1.5).get() == 5
    status = task.idempotency_status((5,))
    assert status.state == "completed"
    assert status.ttl is not None
    assert 0 < status.ttl <= 1.5  # not the default day
    time.sleep(1.7)
    assert task.idempotency_status((5,)).state == "absent"
    other = task.apply_async((6,))  # the next call has the task's own TTL again
    assert other.get() == 6
    assert task.idempotency_status((6,)).ttl > 3600


def test_per_call_window_slots_the_key(make_app: Callable[..., Celery]) -> None:
    task = _task(make_app(task_always_eager=True))
    assert task.apply_async((7,), idempotency_window=3600).get() == 7
    # The key is in the slot: the unslotted key of the same call is absent...
    assert task.idempotency_status((7,)).state == "absent"
    # ...and the slotted one completed.
    cfg = task.idempotency_settings()
    real = task.app.tasks[task.name]
    key = keyspace.with_slot(
        admin_key(real, cfg, (7,), {}, key=None, task_id=None),
        keyspace.slot_for(time.time(), 3600),
    )
    info = read_key(task.idempotency_guard().store.client, cfg.idempotency_key_prefix, key)
    assert info.state == "completed"


def test_the_per_call_options_travel_in_the_headers(make_app: Callable[..., Celery]) -> None:
    app = make_app(task_always_eager=True)
    seen: list[Any] = []

    @app.task(base=IdempotentTask, name="opts.headers", shared=False, bind=True)
    def headers(self: Any, x: int) -> int:
        seen.append((self.request.headers or {}).get(CALL_OPTIONS_HEADER))
        return x

    headers.apply_async((1,), idempotency_ttl=30, idempotency_publish_ttl=60)
    assert seen == [{"idempotency_ttl": 30.0, "idempotency_publish_ttl": 60.0}]
    assert set(PER_CALL) >= {"idempotency_ttl", "idempotency_publish_ttl"}


def test_a_worker_refuses_an_option_it_does_not_take(make_app: Callable[..., Celery]) -> None:
    """A message carrying a per-call option this version does not know (a newer publisher)
    fails, naming it, rather than running with the option ignored."""
    task = _task(make_app())
    result = task.apply((1,), headers={CALL_OPTIONS_HEADER: {"idempotency_lock_ttl": 1}})
    assert result.failed()
    assert "idempotency_lock_ttl" in str(result.result)
