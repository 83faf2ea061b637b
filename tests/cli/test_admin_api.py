"""``Task.idempotency_status`` / ``Task.idempotency_forget`` agree with ``celery ...
idempotency inspect`` / ``forget`` on the same keys, on a real Redis and on a Redis Cluster.

Both go through :mod:`celery_idempotent.admin`; here each side is driven as a user drives it
(the Python methods on the task; the command through click with the app in Celery's CLI
context) and their answers are compared key by key, in every state a key can be in.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import threading
import uuid
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from celery import Celery
from celery.bin.base import CLIContext
from cliadmin_app import GATES, STARTED, make_app
from click.testing import CliRunner, Result

from celery_idempotent import (
    IdempotencyKeyHeldError,
    IdempotencyKeyMissingError,
    IdempotentTask,
    LockLostError,
)
from celery_idempotent.admin import IdempotencyStatus
from celery_idempotent.celery.task import reset_backends
from celery_idempotent.cli import idempotency
from celery_idempotent.core.fingerprint import fingerprint_payload


@pytest.fixture(params=["redis", "cluster"])
def admin_app(request: pytest.FixtureRequest, key_prefix: str) -> Iterator[Celery]:
    """``cliadmin_app.make_app`` on a real Redis (a URL) or a Redis Cluster (a client
    factory), with two more tasks: one with a fixed namespace, one with a missing-key field."""
    reset_backends()
    made: list[Any] = []
    if request.param == "redis":
        app = make_app(request.getfixturevalue("redis_url"), key_prefix)
    else:
        cluster = request.getfixturevalue("redis_cluster")

        def factory() -> Any:
            made.append(cluster.client())
            return made[-1]

        app = make_app(None, key_prefix, idempotency_client=factory)

    @app.task(
        base=IdempotentTask,
        shared=False,
        name="cliadmin.charge_v2",
        idempotency_namespace="billing.charge",
    )
    def charge_v2(order_id: int, amount: int) -> dict[str, int]:
        return {"order": order_id, "charged": amount, "v": 2}

    @app.task(
        base=IdempotentTask,
        shared=False,
        name="cliadmin.welcome",
        idempotency_key="user:{user_id}",
    )
    def welcome(user_id: int | None) -> str:
        return "hi"

    try:
        yield app
    finally:
        reset_backends()
        app.close()
        for client in made:
            client.close()


def cli(app: Celery, *args: str) -> Result:
    obj = CLIContext(app=app, no_color=True, workdir=None)
    return CliRunner().invoke(idempotency, list(args), obj=obj)


def inspect_json(app: Celery, *args: str) -> dict[str, Any]:
    result = cli(app, "inspect", *args, "--json")
    assert result.exit_code == 0, (result.stdout, result.stderr)
    doc: dict[str, Any] = json.loads(result.stdout)
    return doc


def assert_agree(status: IdempotencyStatus, doc: dict[str, Any]) -> None:
    """The API's status and the command's JSON describe the same thing."""
    assert status.key == doc["key"]
    assert status.state == {"in_progress": "running"}.get(doc["state"], doc["state"])
    record, lock = doc["record"], doc["lock"]
    if status.state == "completed":
        assert status.fingerprint == record["fingerprint"]
        assert status.fencing_token == record["fencing_token"]
        assert status.task_id == record["task_id"]
        assert status.ttl is not None
        # read apart by a `celery` subprocess's start (seconds on a loaded host)
        assert abs(status.ttl - record["ttl"]) < 30
        assert status.age is not None
        assert abs(status.age - record["age"]) < 30
    elif status.state == "running":
        assert status.holder == lock["holder"]
        assert status.fencing_token == doc["fence"]["last"]
        assert status.ttl is not None
        assert abs(status.ttl - lock["ttl"]) < 5
    else:
        assert record is None
        assert lock["held"] is False
        assert dataclasses.astuple(status)[2:] == (None,) * 8  # every field but key, state


class Holder:
    """A ``cliadmin.hold`` delivery in a thread, holding its key until released."""

    def __init__(self, app: Celery) -> None:
        self.gate = uuid.uuid4().hex
        GATES[self.gate] = threading.Event()
        STARTED[self.gate] = threading.Event()
        self.outcome: list[Any] = []
        task = app.tasks["cliadmin.hold"]
        self.thread = threading.Thread(target=lambda: self.outcome.append(task.apply((self.gate,))))
        self.thread.start()
        assert STARTED[self.gate].wait(10), "the held body never started"

    def release(self) -> Any:
        GATES[self.gate].set()
        self.thread.join(30)
        assert not self.thread.is_alive()
        return self.outcome[0]


def test_status_and_inspect_agree_in_every_state(admin_app: Celery) -> None:
    charge = admin_app.tasks["cliadmin.charge"]

    absent = charge.idempotency_status((42, 999))
    assert absent.state == "absent"
    assert_agree(absent, inspect_json(admin_app, "--task", charge.name, "--args", "[42, 999]"))

    assert charge.apply((42, 999)).get() == {"order": 42, "charged": 999}
    done = charge.idempotency_status((42, 999))
    assert done.state == "completed"
    assert done.fingerprint == fingerprint_payload({"order_id": 42, "amount": 999})
    assert done.key == charge.idempotency_key_for((42, 999), {})
    assert_agree(done, inspect_json(admin_app, "--task", charge.name, "--args", "[42, 999]"))
    # shaped like apply_async: args and kwargs by keyword, bound to the signature
    for by_kw in (
        charge.idempotency_status(args=(42,), kwargs={"amount": 999}),
        charge.idempotency_status(kwargs={"order_id": 42, "amount": 999}),
    ):
        assert (by_kw.key, by_kw.state, by_kw.fingerprint) == (
            done.key,
            "completed",
            done.fingerprint,
        )
    with pytest.raises(dataclasses.FrozenInstanceError):
        done.state = "absent"  # type: ignore[misc]

    charge.apply((1, 2), headers={"idempotency_key": "payment-42"}).get()
    by_key = charge.idempotency_status(key="payment-42")
    assert by_key.state == "completed"
    assert by_key.key == f"{charge.name}:key:payment-42"
    assert_agree(by_key, inspect_json(admin_app, "payment-42", "--task", charge.name))

    report = admin_app.tasks["cliadmin.report"]
    report.apply(("2026-12-01",), task_id="report-1").get()
    by_id = report.idempotency_status(task_id="report-1")
    assert by_id.state == "completed"
    assert_agree(by_id, inspect_json(admin_app, "--task", report.name, "--task-id", "report-1"))
    with pytest.raises(TypeError, match="task_id"):
        report.idempotency_status(("2026-12-01",))

    holder = Holder(admin_app)
    try:
        hold = admin_app.tasks["cliadmin.hold"]
        running = hold.idempotency_status((holder.gate,))
        assert running.state == "running"
        assert running.holder
        assert running.fencing_token
        assert_agree(
            running,
            inspect_json(admin_app, "--task", hold.name, "--args", json.dumps([holder.gate])),
        )
    finally:
        assert holder.release().get() == f"released {holder.gate}"


def test_forget_and_the_command_agree(admin_app: Celery) -> None:
    charge = admin_app.tasks["cliadmin.charge"]
    for order in (1, 2):
        charge.apply((order, 10)).get()

    # forgotten through the API: the command sees it gone
    forgotten = charge.idempotency_forget((1, 10))
    assert forgotten.state == "completed"
    assert len(forgotten.deleted) == 1
    assert forgotten.key == charge.idempotency_key_for((1, 10), {})
    assert inspect_json(admin_app, "--task", charge.name, "--args", "[1, 10]")["state"] == "absent"
    assert charge.idempotency_forget((1, 10)).deleted == ()  # nothing left: nothing deleted

    # forgotten through the command: the API sees it gone
    result = cli(admin_app, "forget", "--task", charge.name, "--args", "[2, 10]", "--yes")
    assert result.exit_code == 0, result.stderr
    assert charge.idempotency_status((2, 10)).state == "absent"

    # a held lock: both refuse without force, both delete it with force
    hold = admin_app.tasks["cliadmin.hold"]
    holder = Holder(admin_app)
    try:
        with pytest.raises(IdempotencyKeyHeldError) as refused:
            hold.idempotency_forget((holder.gate,))
        assert refused.value.key == hold.idempotency_key_for((holder.gate,), {})
        assert refused.value.holder == hold.idempotency_status((holder.gate,)).holder
        by_cli = cli(
            admin_app, "forget", "--task", hold.name, "--args", json.dumps([holder.gate]), "--yes"
        )
        assert by_cli.exit_code == 1
        assert "refused" in by_cli.stderr
        assert hold.idempotency_status((holder.gate,)).state == "running"

        forced = hold.idempotency_forget((holder.gate,), force=True)
        assert forced.state == "running"
        assert len(forced.deleted) == 1
        assert hold.idempotency_status((holder.gate,)).state == "absent"
    finally:
        outcome = holder.release()
    # the holder lost its lease to the forced forget: its result is not stored
    assert isinstance(outcome.result, LockLostError)
    assert hold.idempotency_status((holder.gate,)).state == "absent"


def test_naming_a_key_wrongly_is_a_clear_error(admin_app: Celery) -> None:
    charge = admin_app.tasks["cliadmin.charge"]
    with pytest.raises(TypeError, match="name one key"):
        charge.idempotency_status((42, 999), key="payment-42")
    with pytest.raises(TypeError, match="name one key"):
        charge.idempotency_forget(key="payment-42", task_id="abc")
    with pytest.raises(TypeError, match="apply_async"):
        charge.idempotency_status("42")  # a str is not an args tuple
    with pytest.raises(TypeError, match=r"cliadmin\.charge"):
        charge.idempotency_status((42,))  # amount missing: the signature says so


def test_status_and_forget_on_memory_backends(key_prefix: str) -> None:
    """memory:// keys live in this process: the methods read them through the store and
    lock-provider protocols (no TTL left, no holder)."""
    reset_backends()
    app = make_app("memory://", key_prefix)
    try:
        charge, hold = app.tasks["cliadmin.charge"], app.tasks["cliadmin.hold"]
        assert charge.idempotency_status((1, 2)).state == "absent"
        charge.apply((1, 2)).get()
        done = charge.idempotency_status((1, 2))
        assert done.state == "completed"
        assert done.fingerprint == fingerprint_payload({"order_id": 1, "amount": 2})
        assert done.fencing_token
        assert done.age is not None
        assert done.age < 30
        assert done.ttl is None
        assert charge.idempotency_forget((1, 2)).state == "completed"
        assert charge.idempotency_status((1, 2)).state == "absent"
        holder = Holder(app)
        try:
            assert hold.idempotency_status((holder.gate,)).state == "running"
            with pytest.raises(IdempotencyKeyHeldError):
                hold.idempotency_forget((holder.gate,), force=True)
        finally:
            assert holder.release().get() == f"released {holder.gate}"
    finally:
        reset_backends()
        app.close()


def test_a_fixed_namespace_and_a_missing_key(admin_app: Celery) -> None:
    """The API and the command name a namespaced task's keys alike; a call without a key has
    no status, in both."""
    charge_v2 = admin_app.tasks["cliadmin.charge_v2"]
    charge_v2.apply((5, 50)).get()
    status = charge_v2.idempotency_status((5, 50))
    assert status.key.startswith("billing.charge:args:")
    assert_agree(status, inspect_json(admin_app, "--task", charge_v2.name, "--args", "[5, 50]"))
    charge_v2.apply((6, 60), headers={"idempotency_key": "inv-6"}).get()
    assert_agree(
        charge_v2.idempotency_status(key="inv-6"),
        inspect_json(admin_app, "inv-6", "--task", charge_v2.name),
    )

    # every key of the task: the command scans its namespace, not its name
    counted = cli(admin_app, "stats", "--task", charge_v2.name, "--json")
    assert json.loads(counted.stdout)["tasks"] == {
        "billing.charge": {"completed": 2, "in_progress": 0, "queued": 0}
    }
    gone = cli(admin_app, "forget", "--task", charge_v2.name, "--yes")
    assert "deleted 2 record(s)" in gone.stdout, (gone.stdout, gone.stderr)
    assert charge_v2.idempotency_status((5, 50)).state == "absent"
    assert charge_v2.idempotency_status(key="inv-6").state == "absent"

    welcome = admin_app.tasks["cliadmin.welcome"]
    with pytest.raises(IdempotencyKeyMissingError):
        welcome.idempotency_status((None,))
    missing = cli(admin_app, "inspect", "--task", welcome.name, "--args", "[null]")
    assert missing.exit_code == 2
    assert "user_id" in missing.stderr


def test_the_celery_program_agrees_with_the_api(
    celery_cli: Callable[..., subprocess.CompletedProcess[str]],
    redis_url: str,
    key_prefix: str,
) -> None:
    """The real ``celery -A cliadmin_app idempotency`` program (a subprocess) on the keys the
    API reads and forgets in this process."""
    reset_backends()
    app = make_app(redis_url, key_prefix)
    try:
        charge = app.tasks["cliadmin.charge"]
        charge.apply((3, 30)).get()
        status = charge.idempotency_status((3, 30))
        shown = celery_cli("inspect", "--task", charge.name, "--args", "[3, 30]", "--json")
        assert shown.returncode == 0, shown.stderr
        assert_agree(status, json.loads(shown.stdout))

        gone = celery_cli("forget", "--task", charge.name, "--args", "[3, 30]", "--yes")
        assert gone.returncode == 0, gone.stderr
        assert charge.idempotency_status((3, 30)).state == "absent"
        charge.apply((3, 30)).get()
        charge.idempotency_forget((3, 30))
        after = celery_cli("inspect", "--task", charge.name, "--args", "[3, 30]", "--json")
        assert json.loads(after.stdout)["state"] == "absent"
    finally:
        reset_backends()
        app.close()
