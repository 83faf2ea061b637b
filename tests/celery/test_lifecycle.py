"""The life-cycle matrix of SPEC §8 (issue 22): one row per way a message can end, one column
per ack mode (Celery's default early ack; ``acks_late``; ``acks_late`` +
``task_reject_on_worker_lost``), on the Redis broker and on RabbitMQ, with a real prefork
``celery worker`` per column. The whole-worker row starts workers of its own (one to kill with
its children, one standing by for the broker's redelivery) with a short Redis
``visibility_timeout``.

Each cell records the body's executions (of the first message and, where the re-submission
ran, of that one too), what the key holds afterwards (``Task.idempotency_status``), and what an
identical re-submission (``delay()`` of the same call, a new task id) got, and is checked
against the table. The whole matrix is printed at the end of the module (``pytest -s``) and
written to ``$LC_MATRIX_OUT`` when that is set.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import pytest
from celery.result import EagerResult

from celery_idempotent import settings as idem_settings
from celery_idempotent.celery.factory import reset_backends
from tests.support.keys import delete_keys_with_prefix
from tests.support.workers import WorkerGroup, start_workers

# A campaign of its own (minutes of real workers): .ci/run runs it after the README's command.
pytestmark = [pytest.mark.worker, pytest.mark.slow, pytest.mark.redis, pytest.mark.campaign]

APPS_DIR = Path(__file__).parent / "apps"
TIMEOUT = 30
ACKS = ("early", "late", "late_reject")
BROKERS = ("redis", "rabbitmq")


class Cell(NamedTuple):
    executions: int
    key_after: str
    resubmission: str


_matrix: dict[tuple[str, str, str], Cell] = {}


# --------------------------------------------------------------------------- set-up


@pytest.fixture(scope="module")
def lc_base(redis_url: str) -> Iterator[dict[str, str]]:
    session = uuid.uuid4().hex[:8]
    env = {"LC_REDIS_URL": redis_url, "LC_PREFIX": f"test:lc-{session}:"}
    yield env
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        delete_keys_with_prefix(client, env["LC_PREFIX"])
    finally:
        client.close()
    _report()


class Column:
    """One column: the app module loaded in this process and a worker, both configured alike."""

    def __init__(self, app: ModuleType, group: WorkerGroup, env: dict[str, str]) -> None:
        self.app = app
        self.group = group
        self.env = env


@pytest.fixture(scope="module")
def columns(
    lc_base: dict[str, str], request: pytest.FixtureRequest
) -> Iterator[Callable[[str, str], Column]]:
    made: dict[tuple[str, str], Column] = {}

    def get(broker: str, acks: str) -> Column:
        found = made.get((broker, acks))
        if found is not None:
            return found
        for other in list(made.values()):  # one column at a time: the machine is small
            other.group.stop()
            made.pop(next(k for k, v in made.items() if v is other))
        env = {
            **lc_base,
            "LC_ACKS": acks,
            "LC_QUEUE": f"lc-{broker}-{acks}-{uuid.uuid4().hex[:6]}",
        }
        if broker == "rabbitmq":
            env["LC_BROKER_URL"] = request.getfixturevalue("rabbitmq_url")
        app = _load(env)
        group = start_workers(
            1,
            "lifecycle_app",
            env=env,
            pythonpath=[APPS_DIR],
            pool="prefork",
            concurrency=2,
            queues=[env["LC_QUEUE"]],
        )
        made[broker, acks] = Column(app, group, env)
        return made[broker, acks]

    yield get
    for column in made.values():
        column.group.stop()
        for worker in column.group:
            worker.remove_log()
    _unload()


_saved_env: dict[str, str | None] = {}


def _load(env: dict[str, str]) -> ModuleType:
    """The app module with ``env`` (a fresh import, settings and backends forgotten)."""
    _unload()
    for name, value in env.items():
        _saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value
    if "LC_BROKER_URL" not in env:
        _saved_env.setdefault("LC_BROKER_URL", os.environ.get("LC_BROKER_URL"))
        os.environ.pop("LC_BROKER_URL", None)
    if str(APPS_DIR) not in sys.path:
        sys.path.insert(0, str(APPS_DIR))
    import lifecycle_app

    idem_settings.clear_cache()
    reset_backends()
    return lifecycle_app


def _unload() -> None:
    module = sys.modules.pop("lifecycle_app", None)
    if module is not None:
        module.app.close()
    for name, value in _saved_env.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
    idem_settings.clear_cache()
    reset_backends()


# --------------------------------------------------------------------------- helpers


def _tag() -> str:
    return uuid.uuid4().hex[:10]


def _wait(what: Callable[[], Any], timeout: float = TIMEOUT, step: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        got = what()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(step)


def _state(task: Any, *args: Any) -> str:
    return str(task.idempotency_status(args).state)


def _wait_state(task: Any, args: tuple[Any, ...], state: str, timeout: float = TIMEOUT) -> str:
    _wait(lambda: _state(task, *args) == state, timeout)
    return state


def _got(first: Any, again: Any, ran: bool) -> str:
    """What the re-submission got, in the table's words."""
    if isinstance(again, EagerResult):
        return "replayed failure" if again.failed() else "replayed value"
    if again.id == first.id:
        return "the first call"
    return "ran" if ran else "published, not run"


def _record(broker: str, acks: str, row: str, cell: Cell) -> Cell:
    _matrix[broker, acks, row] = cell
    return cell


def _report() -> None:
    if not _matrix:
        return
    order = ROWS + OWN_WORKER_ROWS
    rows = sorted({row for _, _, row in _matrix}, key=order.index)
    cols = [(b, a) for b in BROKERS for a in ACKS if any((b, a, r) in _matrix for r in rows)]
    lines = [
        "| how the message ends | " + " | ".join(f"{b} / {a}" for b, a in cols) + " |",
        "|---|" + "---|" * len(cols),
    ]
    for row in rows:
        cells = []
        for b, a in cols:
            cell = _matrix.get((b, a, row))
            cells.append(
                "-"
                if cell is None
                else f"{cell.executions} run(s); {cell.key_after}; re-submission: "
                f"{cell.resubmission}"
            )
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    text = "\n".join(lines)
    print("\nSPEC §8 life-cycle matrix (executions; key after; re-submission got):\n" + text)
    out = os.environ.get("LC_MATRIX_OUT")
    if out:
        Path(out).write_text(text + "\n", encoding="utf-8")


# --------------------------------------------------------------------------- the rows


def row_returns(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.returns.delay(t)
    assert first.get(timeout=TIMEOUT) == f"{t}:1"
    key = _state(lc.returns, t)
    again = lc.returns.delay(t)
    assert again.get(timeout=TIMEOUT) == f"{t}:1"
    cell = Cell(lc.count("returns", t), key, _got(first, again, False))
    assert cell == Cell(1, "completed", "replayed value")
    return cell


def row_raises(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.raises.delay(t)
    with pytest.raises(ValueError, match="failed"):
        first.get(timeout=TIMEOUT)
    key = _state(lc.raises, t)  # free at once: the marker ended before the result was stored
    again = lc.raises.delay(t)
    with pytest.raises(ValueError, match="failed"):
        again.get(timeout=TIMEOUT)
    runs = lc.count("raises", t)
    cell = Cell(runs - 1, key, _got(first, again, runs == 2))
    assert cell == Cell(1, "absent", "ran")
    return cell


def row_stored_error(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.stored_error.delay(t)
    with pytest.raises(KeyError):
        first.get(timeout=TIMEOUT)
    key = _state(lc.stored_error, t)
    again = lc.stored_error.delay(t)
    with pytest.raises(KeyError):
        again.get(timeout=TIMEOUT)
    cell = Cell(lc.count("stored_error", t), key, _got(first, again, False))
    assert cell == Cell(1, "completed", "replayed failure")
    return cell


def row_retry_published(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.retries.delay(t, 3.0)
    _wait(lambda: lc.count("retries", t) == 1)
    # The retry is published, then the lease given up and the marker handed to the retry.
    key = _wait_state(lc.retries, (t, 3.0), "queued", timeout=5)
    again = lc.retries.delay(t, 3.0)
    got = _got(first, again, False)
    assert first.get(timeout=TIMEOUT) == f"{t} after 1 retry"
    cell = Cell(lc.count("retries", t), key, got)
    assert cell == Cell(2, "queued", "the first call")  # 2 runs: the first attempt + the retry
    return cell


def row_retry_refused(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.retry_refused.delay(t)
    assert first.get(timeout=TIMEOUT) == f"{t}:fallback"  # committed: the lease was kept
    key = _state(lc.retry_refused, t)
    again = lc.retry_refused.delay(t)
    assert again.get(timeout=TIMEOUT) == f"{t}:fallback"
    cell = Cell(lc.count("retry_refused", t), key, _got(first, again, False))
    assert cell == Cell(1, "completed", "replayed value")
    return cell


def row_retry_refused_exc(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.retry_refused_exc.delay(t)
    with pytest.raises(ValueError, match="gave up"):
        first.get(timeout=TIMEOUT)
    key = _state(lc.retry_refused_exc, t)
    again = lc.retry_refused_exc.delay(t)
    with pytest.raises(ValueError, match="gave up"):
        again.get(timeout=TIMEOUT)
    runs = lc.count("retry_refused_exc", t)
    cell = Cell(runs - 1, key, _got(first, again, runs == 2))
    assert cell == Cell(1, "absent", "ran")
    return cell


def _ends_without_result(lc: ModuleType, task: Any, name: str) -> Cell:
    t = _tag()
    first = task.delay(t)
    _wait(lambda: lc.count(name, t) == 1)
    key = _wait_state(task, (t,), "absent", timeout=5)  # free at once (no result to wait for)
    again = task.delay(t)
    _wait(lambda: lc.count(name, t) == 2)
    cell = Cell(1, key, _got(first, again, True))
    assert cell == Cell(1, "absent", "ran")
    return cell


def row_ignore(lc: ModuleType) -> Cell:
    return _ends_without_result(lc, lc.ignores, "ignores")


def row_reject(lc: ModuleType) -> Cell:
    return _ends_without_result(lc, lc.rejects, "rejects")


def row_reject_requeue(lc: ModuleType, acks: str) -> Cell:
    t = _tag()
    first = lc.rejects_requeue.delay(t)
    if acks == "early":
        # Acked before the body ran: Celery's reject does nothing, the message is gone, and
        # the key is free at once (as for Ignore); the re-submission runs.
        _wait(lambda: lc.count("rejects_requeue", t) == 1)
        key = _wait_state(lc.rejects_requeue, (t,), "absent", timeout=5)
        again = lc.rejects_requeue.delay(t)
        assert again.get(timeout=TIMEOUT) == f"{t}:second"
        cell = Cell(1, key, _got(first, again, True))
        assert cell == Cell(1, "absent", "ran")
        return cell
    # Requeued: the redelivery runs (the key queued meanwhile), then every re-submission replays.
    assert first.get(timeout=TIMEOUT) == f"{t}:second"
    key = _state(lc.rejects_requeue, t)
    again = lc.rejects_requeue.delay(t)
    assert again.get(timeout=TIMEOUT) == f"{t}:second"
    cell = Cell(lc.count("rejects_requeue", t), key, _got(first, again, False))
    assert cell == Cell(2, "completed", "replayed value")
    return cell


def row_revoked(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.returns.apply_async((t,), countdown=2)
    lc.app.control.revoke(first.id)
    key = _wait_state(lc.returns, (t,), "absent", timeout=15)  # once the worker discards it
    assert lc.count("returns", t) == 0
    again = lc.returns.delay(t)
    assert again.get(timeout=TIMEOUT) == f"{t}:1"
    cell = Cell(0, key, _got(first, again, True))
    assert cell == Cell(0, "absent", "ran")
    return cell


def row_expired(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.returns.apply_async((t,), countdown=2, expires=1)
    key = _wait_state(lc.returns, (t,), "absent", timeout=15)
    assert lc.count("returns", t) == 0
    again = lc.returns.delay(t)
    assert again.get(timeout=TIMEOUT) == f"{t}:1"
    cell = Cell(0, key, _got(first, again, True))
    assert cell == Cell(0, "absent", "ran")
    return cell


def row_terminated(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.sleeps.delay(t, 30)
    _wait(lambda: lc.count("sleeps", t) == 1)
    lc.app.control.revoke(first.id, terminate=True, signal="SIGKILL")
    key = _wait_state(lc.sleeps, (t, 30), "absent", timeout=lc.LOCK_TTL + 10)
    again = lc.sleeps.delay(t, 30)
    _wait(lambda: lc.count("sleeps", t) == 2)
    lc.app.control.revoke(again.id, terminate=True, signal="SIGKILL")
    cell = Cell(1, "free within lock_ttl" if key == "absent" else key, _got(first, again, True))
    assert cell == Cell(1, "free within lock_ttl", "ran")
    return cell


def row_soft_limit(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.soft_limit.delay(t)
    with pytest.raises(Exception, match=r"SoftTimeLimitExceeded|imit"):
        first.get(timeout=TIMEOUT)
    # The table's bound is lock_ttl; the exception reaches the guard, so the key frees at once.
    key = _wait_state(lc.soft_limit, (t,), "absent", timeout=lc.LOCK_TTL + 10)
    again = lc.soft_limit.delay(t)
    _wait(lambda: lc.count("soft_limit", t) == 2)
    cell = Cell(1, "free within lock_ttl" if key == "absent" else key, _got(first, again, True))
    assert cell == Cell(1, "free within lock_ttl", "ran")
    return cell


def row_hard_limit(lc: ModuleType) -> Cell:
    t = _tag()
    first = lc.hard_limit.delay(t)
    with pytest.raises(Exception, match=r"TimeLimitExceeded|imit"):
        first.get(timeout=TIMEOUT)
    key = _wait_state(lc.hard_limit, (t,), "absent", timeout=lc.LOCK_TTL + 10)
    again = lc.hard_limit.delay(t)
    _wait(lambda: lc.count("hard_limit", t) == 2)
    cell = Cell(1, "free within lock_ttl" if key == "absent" else key, _got(first, again, True))
    assert cell == Cell(1, "free within lock_ttl", "ran")
    return cell


def row_child_killed(lc: ModuleType, acks: str) -> Cell:
    t = _tag()
    first = lc.sleeps_once.delay(t)
    _wait(lambda: lc.count("sleeps_once", t) >= 1)
    pid = int(_wait(lambda: lc.client().get(lc.PREFIX + "fx:pid:" + t)))
    os.kill(pid, signal.SIGKILL)
    if acks != "late_reject":
        # The message was acked: nothing redelivers it. Free once the lease runs out.
        key = _wait_state(lc.sleeps_once, (t,), "absent", timeout=lc.LOCK_TTL + 10)
        again = lc.sleeps_once.delay(t)
        assert again.get(timeout=TIMEOUT) == f"{t}:run 2"
        cell = Cell(1, "free within lock_ttl", _got(first, again, True))
        assert key == "absent"
        assert cell == Cell(1, "free within lock_ttl", "ran")
        return cell
    # Requeued at once: while the killed lease is valid the key is still claimed (a
    # re-submission gets the first call); once it runs out, the redelivery claims the key and
    # runs the body; every later re-submission replays it. Never a second completed run.
    again = lc.sleeps_once.delay(t)
    got = _got(first, again, False)
    assert first.get(timeout=TIMEOUT) == f"{t}:run 2"
    key = _state(lc.sleeps_once, t)
    later = lc.sleeps_once.delay(t)
    assert later.get(timeout=TIMEOUT) == f"{t}:run 2"
    cell = Cell(lc.count("sleeps_once", t), key, got)
    assert cell == Cell(2, "completed", "the first call")  # the killed run + the redelivery
    assert isinstance(later, EagerResult)  # replayed at publish
    return cell


def row_never_delivered(lc: ModuleType, broker: str) -> Cell:
    t = _tag()
    queue = f"{lc.QUEUE}-nobody"  # no worker consumes it
    first = lc.returns.apply_async((t,), queue=queue)
    with lc.app.connection_for_write() as conn:
        conn.default_channel.queue_purge(queue)  # the broker lost it
    status = lc.returns.idempotency_status((t,))
    assert status.state == "queued"
    assert status.claimed is False  # no delivery ever claimed it
    assert status.age is not None
    assert 0 <= status.age < 30
    assert status.ttl is not None
    assert status.ttl > 3000  # idempotency_publish_ttl
    again = lc.returns.apply_async((t,), queue=queue)
    cell = Cell(0, "queued until publish_ttl (age shown, never claimed)", _got(first, again, False))
    assert cell.resubmission == "the first call"
    lc.returns.idempotency_forget((t,))
    return cell


ROWS = [
    "body returns",
    "body raises",
    "raises a store_errors error",
    "self.retry() published",
    "self.retry() refused, caught (fallback returned)",
    "self.retry(exc=...) refused, uncaught",
    "Ignore",
    "Reject(requeue=False)",
    "Reject(requeue=True)",
    "revoked before claimed",
    "expired before claimed",
    "revoked terminate=True",
    "soft time limit that escapes",
    "hard time limit",
    "worker child killed mid-body",
    "never delivered (lost by the broker)",
]

_RUN: dict[str, Callable[[ModuleType, str, str], Cell]] = {
    ROWS[0]: lambda lc, b, a: row_returns(lc),
    ROWS[1]: lambda lc, b, a: row_raises(lc),
    ROWS[2]: lambda lc, b, a: row_stored_error(lc),
    ROWS[3]: lambda lc, b, a: row_retry_published(lc),
    ROWS[4]: lambda lc, b, a: row_retry_refused(lc),
    ROWS[5]: lambda lc, b, a: row_retry_refused_exc(lc),
    ROWS[6]: lambda lc, b, a: row_ignore(lc),
    ROWS[7]: lambda lc, b, a: row_reject(lc),
    ROWS[8]: lambda lc, b, a: row_reject_requeue(lc, a),
    ROWS[9]: lambda lc, b, a: row_revoked(lc),
    ROWS[10]: lambda lc, b, a: row_expired(lc),
    ROWS[11]: lambda lc, b, a: row_terminated(lc),
    ROWS[12]: lambda lc, b, a: row_soft_limit(lc),
    ROWS[13]: lambda lc, b, a: row_hard_limit(lc),
    ROWS[14]: lambda lc, b, a: row_child_killed(lc, a),
    ROWS[15]: lambda lc, b, a: row_never_delivered(lc, b),
}


@pytest.mark.parametrize("row", ROWS)
@pytest.mark.parametrize("acks", ACKS)
@pytest.mark.parametrize("broker", BROKERS)
def test_life_cycle(
    columns: Callable[[str, str], Column], broker: str, acks: str, row: str
) -> None:
    if broker == "rabbitmq":
        pytest.importorskip("amqp")
    column = columns(broker, acks)
    _record(broker, acks, row, _RUN[row](column.app, broker, acks))


# --------------------------------------------------------------------------- a whole worker killed

#: Rows that kill a whole worker (main process and pool children): each cell starts workers
#: of its own on a queue of its own, beside the column's (which it leaves running).
OWN_WORKER_ROWS = ["whole worker killed mid-body"]

#: kombu's Redis ``visibility_timeout`` of those workers: the Redis broker redelivers an
#: unacked message of a dead worker once it is this old (RabbitMQ does when the connection
#: drops).
VISIBILITY = 6


def row_whole_worker_killed(column: Column, broker: str, acks: str) -> Cell:
    lc = column.app
    queue = f"{lc.QUEUE}-whole-{_tag()[:6]}"
    env = {**column.env, "LC_VISIBILITY": str(VISIBILITY)}
    options: dict[str, Any] = {
        "env": env,
        "pythonpath": [APPS_DIR],
        "pool": "prefork",
        "concurrency": 1,
        "queues": [queue],
    }
    t = _tag()
    doomed = start_workers(1, "lifecycle_app", **options)
    standby = None
    try:
        first = lc.sleeps_once.apply_async((t,), queue=queue)
        _wait(lambda: lc.count("sleeps_once", t) >= 1)
        killed = time.monotonic()
        doomed[0].kill()  # SIGKILL of the process group: the main process and its child at once
        if acks == "early":
            # Acked before the body ran: no broker brings it back. Free once the lease ends.
            key = _wait_state(lc.sleeps_once, (t,), "absent", timeout=lc.LOCK_TTL + 10)
            standby = start_workers(1, "lifecycle_app", **options)
            again = lc.sleeps_once.apply_async((t,), queue=queue)
            assert again.get(timeout=TIMEOUT) == f"{t}:run 2"
            # Past the visibility timeout (and kombu's sweep) nothing redelivered the first.
            time.sleep(max(0.0, killed + VISIBILITY + 3 - time.monotonic()))
            assert lc.count("sleeps_once", t) == 2
            assert first.state == "PENDING"  # the killed call has no result, ever
            cell = Cell(
                1, "free within lock_ttl" if key == "absent" else key, _got(first, again, True)
            )
            assert cell == Cell(1, "free within lock_ttl", "ran")
            return cell
        # Unacked: the broker redelivers it (Redis: once older than visibility_timeout, restored
        # by the standby's sweep; RabbitMQ: as the connection drops). A re-submission at once
        # finds the killed delivery's claim (its lease still valid) and gets the first call; if
        # the lease ran out first it is published, and then one of the two runs, the other
        # replays. Never a second completed run.
        again = lc.sleeps_once.apply_async((t,), queue=queue)
        standby = start_workers(1, "lifecycle_app", **options)
        assert first.get(timeout=TIMEOUT) == f"{t}:run 2"
        assert again.get(timeout=TIMEOUT) == f"{t}:run 2"
        key = _state(lc.sleeps_once, t)
        later = lc.sleeps_once.apply_async((t,), queue=queue)
        assert isinstance(later, EagerResult)  # replayed at publish
        assert later.get() == f"{t}:run 2"
        got = (
            "the first call"
            if again.id == first.id
            else "published; one of it and the redelivery ran, the other replayed"
        )
        if broker == "redis":  # the redelivery waited for the visibility timeout
            assert time.monotonic() - killed >= VISIBILITY - 1
        cell = Cell(lc.count("sleeps_once", t), key, got)
        assert cell.executions == 2  # the killed run + one completed run
        assert cell.key_after == "completed"
        return cell
    finally:
        doomed.stop()
        if standby is not None:
            standby.stop()
        for worker in [*doomed, *(standby or [])]:
            worker.remove_log()


@pytest.mark.parametrize("acks", ACKS)
@pytest.mark.parametrize("broker", BROKERS)
def test_whole_worker_killed(columns: Callable[[str, str], Column], broker: str, acks: str) -> None:
    """SPEC §8's rows "worker killed, message acked" (early ack) and "worker killed, message
    redelivered" (``acks_late``, with or without ``task_reject_on_worker_lost``: nobody is left
    to reject, so the broker's own redelivery brings it back)."""
    if broker == "rabbitmq":
        pytest.importorskip("amqp")
    column = columns(broker, acks)
    _record(broker, acks, OWN_WORKER_ROWS[0], row_whole_worker_killed(column, broker, acks))


# --------------------------------------------------------------------------- a shorter publish_ttl


def test_a_marker_that_expired_costs_one_message_replayed(
    columns: Callable[[str, str], Column],
) -> None:
    """``idempotency_publish_ttl`` shorter than a message's wait: the identical publish after
    the marker expired is a second message, and the worker replays it (one execution)."""
    column = columns("redis", "early")
    lc = column.app
    t = _tag()
    queue = f"{lc.QUEUE}-later-{t[:6]}"
    one = lc.returns.apply_async((t,), queue=queue, idempotency_publish_ttl=1)
    same = lc.returns.apply_async((t,), queue=queue, idempotency_publish_ttl=1)
    assert same.id == one.id  # stopped at publish while the marker lives
    _wait_state(lc.returns, (t,), "absent", timeout=10)
    two = lc.returns.apply_async((t,), queue=queue, idempotency_publish_ttl=1)
    assert two.id != one.id
    with lc.app.connection_for_write() as conn:
        assert conn.default_channel.client.llen(queue) == 2  # two messages wait
    node = column.group[0].nodename
    lc.app.control.add_consumer(queue, destination=[node], reply=True, timeout=10)
    try:
        assert one.get(timeout=TIMEOUT) == f"{t}:1"
        assert two.get(timeout=TIMEOUT) == f"{t}:1"  # replayed: the first run's value
    finally:
        lc.app.control.cancel_consumer(queue, destination=[node], reply=True, timeout=10)
    assert lc.count("returns", t) == 1


# --------------------------------------------------------------------------- per-call options


def test_per_call_options_reach_the_worker(columns: Callable[[str, str], Column]) -> None:
    """``apply_async(..., idempotency_ttl=..., idempotency_publish_ttl=...)``: the worker keeps
    the result for this call's TTL, and the marker lives for this call's publish TTL."""
    lc = columns("redis", "early").app
    t = _tag()
    first = lc.returns.apply_async((t,), idempotency_ttl=2)
    assert first.get(timeout=TIMEOUT) == f"{t}:1"
    status = lc.returns.idempotency_status((t,))
    assert status.state == "completed"
    assert status.ttl is not None
    assert status.ttl <= 2
    _wait_state(lc.returns, (t,), "absent", timeout=10)
    again = lc.returns.delay(t)  # the record is gone: this call runs, with the task's TTL
    assert again.get(timeout=TIMEOUT) == f"{t}:2"
    assert lc.returns.idempotency_status((t,)).ttl > 3600

    lost = lc.returns.apply_async((t + "q",), queue=f"{lc.QUEUE}-nobody", idempotency_publish_ttl=1)
    status = lc.returns.idempotency_status((t + "q",))
    assert status.state == "queued"
    assert status.ttl is not None
    assert status.ttl <= 1
    _wait_state(lc.returns, (t + "q",), "absent", timeout=10)
    assert lost.id


def test_a_countdown_keeps_the_marker_until_the_message_is_due(
    columns: Callable[[str, str], Column],
) -> None:
    """The marker of a message published with a countdown lives ``publish_ttl`` past its due
    time, not from the publish: a long countdown does not outlive its own marker."""
    lc = columns("redis", "early").app
    t = _tag()
    nobody = f"{lc.QUEUE}-nobody"
    lc.returns.apply_async((t,), queue=nobody, countdown=100, idempotency_publish_ttl=5)
    status = lc.returns.idempotency_status((t,))
    assert status.state == "queued"
    assert status.ttl is not None
    assert 100 < status.ttl <= 105
    lc.returns.idempotency_forget((t,))
