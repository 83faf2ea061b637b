"""Issue 14's controls with real ``celery worker`` processes (``apps/controls_app.py``):
a fingerprint over chosen arguments, missing keys, stored failures, a namespace that survives a
rename (and the start-up check of an accidental one), and ``on_locked="reject"``.

Two workers share the module: ``v1`` (prefork, 2 children) runs everything; ``v2`` (solo, its
own queue) is the same app after ``controls.charge_v1`` was renamed ``controls.charge_v2``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery import Celery

from tests.celery.cidem_helpers import count
from tests.support.waiting import wait_for
from tests.support.workers import CeleryWorker, WorkerGroup

pytestmark = [pytest.mark.worker, pytest.mark.redis]

TIMEOUT = 30
APPS_DIR = Path(__file__).resolve().parent / "apps"


@pytest.fixture(scope="module")
def controls(cidem: ModuleType, cidem_env: dict[str, str]) -> Iterator[ModuleType]:
    import controls_app

    controls_app.configure_controls(controls_app.app, cidem_env)
    yield controls_app
    controls_app.app.close()


@pytest.fixture(scope="module")
def queues() -> dict[str, str]:
    session = uuid.uuid4().hex[:8]
    return {"v1": f"controls-v1-{session}", "v2": f"controls-v2-{session}"}


@pytest.fixture(scope="module")
def control_workers(
    cidem_env: dict[str, str], queues: dict[str, str]
) -> Iterator[dict[str, CeleryWorker]]:
    started = {
        "v1": CeleryWorker(
            "controls_app",
            pool="prefork",
            concurrency=2,
            queues=[queues["v1"]],
            env={**cidem_env, "CONTROLS_VERSION": "1"},
            pythonpath=[APPS_DIR],
        ),
        "v2": CeleryWorker(
            "controls_app",
            pool="solo",
            queues=[queues["v2"]],
            env={**cidem_env, "CONTROLS_VERSION": "2"},
            pythonpath=[APPS_DIR],
        ),
    }
    group = WorkerGroup(started.values())
    try:
        for worker in group:
            worker.start(wait=False)
        for worker in group:
            worker.wait_ready()
        yield started
    finally:
        group.stop()
        for worker in group:
            worker.remove_log()


def send(app: Celery, queue: str, name: str, *args: Any, **options: Any) -> Any:
    return app.send_task(name, args, queue=queue, **options)


def outcome(result: Any) -> Any:
    """The value, or the exception the task ended with."""
    try:
        return result.get(timeout=TIMEOUT)
    except Exception as exc:
        return exc


def test_a_differing_requested_at_replays_with_a_fingerprint_and_mismatches_without(
    controls: ModuleType,
    control_workers: dict[str, CeleryWorker],
    queues: dict[str, str],
    tag: str,
) -> None:
    app, q = controls.app, queues["v1"]
    first = send(app, q, "controls.order", tag, 42, 999, "2026-12-01T09:00:00").get(timeout=TIMEOUT)
    later = [
        send(app, q, "controls.order", tag, 42, 999, f"2026-12-01T09:0{i}:00") for i in (1, 2, 3)
    ]
    assert [r.get(timeout=TIMEOUT) for r in later] == [first] * 3
    assert first["requested_at"] == "2026-12-01T09:00:00"
    other_amount = outcome(send(app, q, "controls.order", tag, 42, 1000, "2026-12-01T09:04:00"))
    assert type(other_amount).__name__ == "IdempotencyMismatchError"
    assert count(controls, "order", tag) == 1

    send(app, q, "controls.order_strict", tag, 42, 999, "2026-12-01T09:00:00").get(timeout=TIMEOUT)
    strict = outcome(send(app, q, "controls.order_strict", tag, 42, 999, "2026-12-01T09:01:00"))
    assert type(strict).__name__ == "IdempotencyMismatchError"
    assert count(controls, "order_strict", tag) == 1


def test_a_none_key_field_raises_by_default_and_runs_every_time_with_run(
    controls: ModuleType,
    control_workers: dict[str, CeleryWorker],
    queues: dict[str, str],
    tag: str,
) -> None:
    app, q = controls.app, queues["v1"]
    missing = outcome(send(app, q, "controls.welcome", tag, None))
    assert type(missing).__name__ == "IdempotencyKeyMissingError"
    assert missing.task == "controls.welcome"
    assert missing.field == "user_id"
    assert count(controls, "welcome", tag) == 0

    runs = [send(app, q, "controls.welcome_run", tag, None) for _ in range(2)]
    assert sorted(r.get(timeout=TIMEOUT) for r in runs) == [1, 2]
    assert count(controls, "welcome_run", tag) == 2
    log = control_workers["v1"].log()
    warnings = [
        line
        for line in log.splitlines()
        if "WARNING" in line and "controls.welcome_run" in line and "unguarded" in line
    ]
    assert len([w for w in warnings if any(r.id in w for r in runs)]) == 2
    # with a key, the same task is guarded as before
    keyed = [send(app, q, "controls.welcome_run", tag, 7) for _ in range(3)]
    assert len({r.get(timeout=TIMEOUT) for r in keyed}) == 1
    assert count(controls, "welcome_run", tag) == 3


def test_a_stored_card_declined_is_raised_to_five_duplicates_and_the_body_runs_once(
    controls: ModuleType,
    control_workers: dict[str, CeleryWorker],
    queues: dict[str, str],
    tag: str,
) -> None:
    app, q = controls.app, queues["v1"]
    results = [send(app, q, "controls.pay", tag, 42, "declined") for _ in range(6)]
    errors = [outcome(r) for r in results]
    assert all(type(e) is controls.CardDeclinedError for e in errors), errors
    assert {e.args for e in errors} == {(42, "insufficient funds")}
    assert {e.order_id for e in errors} == {42}
    assert count(controls, "pay", tag) == 1
    assert all(r.state == "FAILURE" for r in results)

    # a ValueError is not in the tuple: nothing stored, every delivery runs the body
    bugs = [outcome(send(app, q, "controls.pay", tag, 43, "bug")) for _ in range(2)]
    assert all(type(e) is ValueError for e in bugs), bugs
    assert count(controls, "pay", tag) == 3


def test_a_fixed_namespace_keeps_the_records_of_a_renamed_task(
    controls: ModuleType,
    control_workers: dict[str, CeleryWorker],
    queues: dict[str, str],
    tag: str,
) -> None:
    app = controls.app
    before = send(app, queues["v1"], "controls.charge_v1", tag, 42).get(timeout=TIMEOUT)
    after = send(app, queues["v2"], "controls.charge_v2", tag, 42).get(timeout=TIMEOUT)
    assert before["version"] == "1"
    assert after == before  # replayed by the renamed task, from the v1 record
    assert count(controls, "charge", tag) == 1
    fresh = send(app, queues["v2"], "controls.charge_v2", tag, 43).get(timeout=TIMEOUT)
    assert fresh["version"] == "2"


def test_the_worker_names_an_accidental_shared_namespace_at_start(
    control_workers: dict[str, CeleryWorker],
) -> None:
    worker = control_workers["v1"]
    wait_for(lambda: "by accident" in worker.log(), TIMEOUT, what="the namespace warning")
    lines = [ln for ln in worker.log().splitlines() if "by accident" in ln]
    assert len(lines) == 1
    assert "WARNING" in lines[0]
    assert "tasks controls.audit, controls.audit_copy share the key namespace" in lines[0]
    assert "(controls.audit did not declare it)" in lines[0]
    assert "billing.charge" not in lines[0]  # declared by its only task: no accident


def test_on_locked_reject_rejects_a_duplicate_of_a_running_body(
    controls: ModuleType,
    control_workers: dict[str, CeleryWorker],
    queues: dict[str, str],
    tag: str,
) -> None:
    """The rejected duplicate records nothing under its task id, on every Celery version
    (Celery 5.7 would record a FAILURE for a ``Reject(requeue=False)``; 5.5 and 5.6 do not):
    its result stays PENDING while the first body runs and after it has committed."""
    app, q = controls.app, queues["v1"]
    worker = control_workers["v1"]
    first = send(app, q, "controls.slow", tag, 2.0)
    wait_for(lambda: count(controls, "slow", tag) == 1, TIMEOUT, what="the first body")
    duplicate = send(app, q, "controls.slow", tag, 2.0)
    line = f"[{duplicate.id}] reject requeue=False"
    wait_for(lambda: line in worker.log(), TIMEOUT, what="the duplicate's rejection")
    assert duplicate.state == "PENDING"
    value = first.get(timeout=TIMEOUT)
    assert count(controls, "slow", tag) == 1
    assert duplicate.state == "PENDING"  # nothing written later either
    assert send(app, q, "controls.slow", tag, 2.0).get(timeout=TIMEOUT) == value


def test_a_redelivery_of_the_running_message_is_rejected_without_a_failure(
    controls: ModuleType,
    control_workers: dict[str, CeleryWorker],
    queues: dict[str, str],
    tag: str,
) -> None:
    """A second delivery of the message whose body is running (what a visibility timeout or
    a broker's redelivery produces) has the running call's task id: it is rejected, and no
    FAILURE is written under that id, so the caller's ``get()`` gets the body's result."""
    app, q = controls.app, queues["v1"]
    worker = control_workers["v1"]
    first = send(app, q, "controls.slow", tag, 2.0)
    wait_for(lambda: count(controls, "slow", tag) == 1, TIMEOUT, what="the first body")
    send(app, q, "controls.slow", tag, 2.0, task_id=first.id)
    line = f"[{first.id}] reject requeue=False"
    wait_for(lambda: line in worker.log(), TIMEOUT, what="the redelivery's rejection")
    assert first.state not in {"FAILURE", "SUCCESS"}  # the body still runs; no FAILURE
    assert first.get(timeout=TIMEOUT)
    assert first.state == "SUCCESS"
    assert count(controls, "slow", tag) == 1
    assert worker.log().count(line) == 1


@pytest.mark.rabbitmq
def test_a_rejected_duplicate_goes_to_the_dead_letter_queue(
    rabbitmq_url: str,
    redis_url: str,
    controls: ModuleType,
    cidem_env: dict[str, str],
    tag: str,
) -> None:
    from kombu import Connection

    queue = f"controls-dlx-{tag}"
    dlq = f"{queue}-dead"
    env = {
        **cidem_env,
        "CIDEM_BROKER_URL": rabbitmq_url,
        "CIDEM_BACKEND_URL": redis_url,
        "CIDEM_IDEMPOTENCY_URL": redis_url,
        "CIDEM_QUEUE": queue,
        "CONTROLS_DLQ": dlq,
    }
    app = Celery("controls_rabbit", set_as_current=False)
    controls.configure_controls(app, env)
    with Connection(rabbitmq_url, connect_timeout=5) as conn:
        channel = conn.default_channel
        channel.queue_declare(dlq, durable=True, auto_delete=False)
        worker = CeleryWorker(
            "controls_app", pool="prefork", concurrency=2, env=env, pythonpath=[APPS_DIR]
        )
        try:
            worker.start()
            first = app.send_task("controls.slow", (tag, 2.0))
            wait_for(lambda: count(controls, "slow", tag) == 1, TIMEOUT, what="the first body")
            duplicate = app.send_task("controls.slow", (tag, 2.0))
            value = first.get(timeout=TIMEOUT)

            def dead_lettered() -> Any:
                return channel.basic_get(dlq, no_ack=True)

            message = wait_for(dead_lettered, TIMEOUT, what="the duplicate in the DLQ")
            assert message.headers["id"] == duplicate.id
            assert message.headers["x-death"][0]["reason"] == "rejected"
            assert channel.basic_get(dlq, no_ack=True) is None  # only the duplicate
            assert count(controls, "slow", tag) == 1
            assert value
            assert duplicate.state == "PENDING"  # rejected: nothing recorded, on every Celery
        finally:
            worker.stop()
            worker.remove_log()
            app.close()
            channel.queue_delete(queue)
            channel.queue_delete(dlq)
