"""Duplicates stopped at publish (issue 12), with real workers, a real Redis broker and two real
``celery beat`` processes.

The app is ``apps/publish_app.py``: its queue is a Redis list under the session prefix, so a
test counts the messages in the broker with ``LLEN`` while no worker consumes them.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import chain, chord, group
from celery.result import AsyncResult, EagerResult
from kombu import VERSION as KOMBU_VERSION

from celery_idempotent import DuplicatePublishError, IdempotencyMismatchError, keyspace
from celery_idempotent import settings as idem_settings
from celery_idempotent.backends.redis import keyspace as redis_keyspace
from celery_idempotent.celery.task import reset_backends
from tests.support.keys import delete_keys_with_prefix
from tests.support.workers import WorkerGroup, start_workers

#: kombu 5.7 added ``x-expires`` on Redis queues (``Channel._expires``) and
#: ``Producer.batch()``; 5.5 and 5.6 (both supported) have neither. Tests assert each one's own.
KOMBU_57 = tuple(KOMBU_VERSION[:2]) >= (5, 7)

pytestmark = pytest.mark.redis

APPS_DIR = Path(__file__).resolve().parent / "apps"
TIMEOUT = 30


@pytest.fixture(scope="module")
def pub_env(redis_url: str) -> Iterator[dict[str, str]]:
    session = uuid.uuid4().hex[:10]
    env = {
        "PUB_REDIS_URL": redis_url,
        "PUB_PREFIX": f"test:pub-{session}:",
        "PUB_QUEUE": f"pub-{session}",
    }
    yield env
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        delete_keys_with_prefix(client, env["PUB_PREFIX"])
    finally:
        client.close()


@pytest.fixture(scope="module")
def pub(pub_env: dict[str, str]) -> Iterator[ModuleType]:
    """The app module, loaded with this module's environment (a fresh import)."""
    saved = {name: os.environ.get(name) for name in pub_env}
    os.environ.update(pub_env)
    sys.path.insert(0, str(APPS_DIR))
    sys.modules.pop("publish_app", None)
    try:
        import publish_app

        idem_settings.clear_cache()
        reset_backends()
        yield publish_app
        publish_app.app.close()
    finally:
        sys.modules.pop("publish_app", None)
        sys.path.remove(str(APPS_DIR))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        idem_settings.clear_cache()
        reset_backends()


@pytest.fixture(scope="module")
def start(pub_env: dict[str, str]) -> Iterator[Callable[..., WorkerGroup]]:
    groups: list[WorkerGroup] = []

    def factory(env: dict[str, str] | None = None, **options: Any) -> WorkerGroup:
        options.setdefault("pool", "prefork")
        options.setdefault("concurrency", 2)
        options.setdefault("queues", [pub_env["PUB_QUEUE"]])
        group = start_workers(
            1, "publish_app", env={**pub_env, **(env or {})}, pythonpath=[APPS_DIR], **options
        )
        groups.append(group)
        return group

    yield factory
    for made in groups:
        made.stop()
        for each in made:
            each.remove_log()


@pytest.fixture(scope="module")
def worker(start: Callable[..., WorkerGroup]) -> Iterator[WorkerGroup]:
    group = start()
    yield group
    group.stop()


def queued(pub: ModuleType) -> int:
    """Messages waiting in the broker's queue."""
    return int(pub.client().llen(f"{pub.PREFIX}kombu:{pub.QUEUE}"))


def tag() -> str:
    return uuid.uuid4().hex[:10]


# --------------------------------------------------------------------------- one message


def test_ten_publishes_make_one_message_one_execution_then_replays_at_publish(
    pub: ModuleType, start: Callable[..., WorkerGroup]
) -> None:
    t = tag()
    before = queued(pub)
    results = [pub.charge.delay(t, 5) for _ in range(10)]
    assert queued(pub) == before + 1  # one message in the broker, no worker yet
    assert len({r.id for r in results}) == 1  # ten result objects, one task id
    assert all(isinstance(r, AsyncResult) for r in results)
    first = results[0]

    group = start()
    try:
        value = first.get(timeout=TIMEOUT)
        assert value == {"tag": t, "amount": 5, "run": 1}
        assert [r.get(timeout=TIMEOUT) for r in results[1:]] == [value] * 9
        assert pub.count("charge", t) == 1  # one execution

        # Completed: no message, the stored value at once, under the first task's id.
        before = queued(pub)
        again = pub.charge.apply_async((t, 5))
        assert isinstance(again, EagerResult)
        assert again.id == first.id
        assert again.get(timeout=0) == value
        time.sleep(0.3)
        assert queued(pub) == before
        assert pub.count("charge", t) == 1
        # The first call re-sent with its own task id goes through, completed or not.
        resent = pub.charge.apply_async((t, 5), task_id=first.id)
        assert not isinstance(resent, EagerResult)  # published, not answered at once
        assert resent.get(timeout=TIMEOUT) == value
        assert pub.count("charge", t) == 1  # replayed by the worker

        # The same key with other arguments fails at the caller, queued or completed.
        order = tag()
        pub.ship.delay(order, "Main St", 1.0)
        with pytest.raises(IdempotencyMismatchError) as caught:
            pub.ship.delay(order, "Elm St", 1.0)  # queued or running
        assert caught.value.key == f"pub.ship:key:order:{order}"
        done = pub.ship.delay(order, "Main St", 1.0)
        assert done.get(timeout=TIMEOUT) == f"{order} to Main St"
        with pytest.raises(IdempotencyMismatchError):
            pub.ship.delay(order, "Elm St", 1.0)  # completed
        assert pub.count("ship", order) == 1
    finally:
        group.stop()


def test_raise_policy_and_publish_policy(pub: ModuleType, worker: WorkerGroup) -> None:
    t = tag()
    first = pub.charge.delay(t, 1)
    with pytest.raises(DuplicatePublishError) as caught:
        pub.charge.apply_async((t, 1), idempotency_on_duplicate_publish="raise")
    assert caught.value.task_id == first.id
    assert caught.value.key is not None
    # "publish": published anyway, under its own id; the worker's guard replays.
    other = pub.charge.apply_async((t, 1), idempotency_on_duplicate_publish="publish")
    assert other.id != first.id
    assert other.get(timeout=TIMEOUT) == first.get(timeout=TIMEOUT)
    assert pub.count("charge", t) == 1


def test_send_task_publishes_as_today(pub: ModuleType, worker: WorkerGroup) -> None:
    t = tag()
    first = pub.charge.delay(t, 2)
    sent = pub.app.send_task("pub.charge", (t, 2))  # no task class: no publish-side check
    assert sent.id != first.id
    assert sent.get(timeout=TIMEOUT) == first.get(timeout=TIMEOUT)
    assert pub.count("charge", t) == 1


# --------------------------------------------------------------------------- go through


def test_retry_and_the_librarys_requeue_go_through(pub: ModuleType, worker: WorkerGroup) -> None:
    t = tag()
    assert pub.flaky.delay(t).get(timeout=TIMEOUT) == f"{t} after 1 retry"
    assert pub.count("flaky", t) == 2  # the retry (same task id as the marker) was published

    # A duplicate delivered while the first body runs (send_task: no publish-side check) is
    # re-queued by the library until the first commits, then replays.
    order = tag()
    first = pub.ship.apply_async((order, "Main St"), {"hold": 1.5})
    time.sleep(0.5)
    duplicate = pub.app.send_task("pub.ship", (order, "Main St"), {"hold": 1.5})
    assert duplicate.get(timeout=TIMEOUT) == first.get(timeout=TIMEOUT) == f"{order} to Main St"
    assert pub.count("ship", order) == 1


def test_chain_group_and_chord_of_duplicates_complete(pub: ModuleType, worker: WorkerGroup) -> None:
    x = int(uuid.uuid4().int % 10**6)
    assert chain(pub.add.s(x, 1), pub.add.s(2)).apply_async().get(timeout=TIMEOUT) == x + 3
    assert (
        group(pub.add.s(x, 5) for _ in range(3)).apply_async().get(timeout=TIMEOUT) == [x + 5] * 3
    )
    assert pub.count("add", x, 5) == 1  # published three times, run once, replayed twice
    header = [pub.add.s(x, 7) for _ in range(3)]
    assert chord(header)(pub.total.s()).get(timeout=TIMEOUT) == 3 * (x + 7)
    assert pub.count("add", x, 7) == 1


def test_a_failed_body_ends_its_marker(pub: ModuleType, worker: WorkerGroup) -> None:
    t = tag()
    first = pub.fails.delay(t)
    with pytest.raises(ValueError, match="failed"):
        first.get(timeout=TIMEOUT)
    again = pub.fails.delay(t)  # published again: the failure stored nothing
    assert again.id != first.id
    with pytest.raises(ValueError, match="failed"):
        again.get(timeout=TIMEOUT)
    assert pub.count("fails", t) == 2


def test_a_purged_queue_blocks_the_key_for_publish_ttl_only(
    pub: ModuleType, start: Callable[..., WorkerGroup]
) -> None:
    t = tag()
    queue = f"{pub.QUEUE}-purged"  # no worker consumes it until the end
    broker_list = f"{pub.PREFIX}kombu:{queue}"
    charge_class = type(pub.app.tasks["pub.charge"])
    charge_class.idempotency_publish_ttl = 1.5  # a task option (read from the class)
    idem_settings.clear_cache()
    try:
        lost = pub.charge.apply_async((t, 9), queue=queue)
        assert pub.client().llen(broker_list) == 1
        pub.client().delete(broker_list)  # the broker lost the message (a purge)
        assert pub.charge.apply_async((t, 9), queue=queue).id == lost.id  # still "queued"
        assert pub.client().llen(broker_list) == 0
        time.sleep(1.7)  # idempotency_publish_ttl
        resent = pub.charge.apply_async((t, 9), queue=queue)
        assert resent.id != lost.id
        assert pub.client().llen(broker_list) == 1
    finally:
        charge_class.idempotency_publish_ttl = None
        idem_settings.clear_cache()
    group = start(queues=[queue])
    try:
        assert resent.get(timeout=TIMEOUT)["run"] == 1
    finally:
        group.stop()


# --------------------------------------------------------------------------- schedule slots


def _beat(pub_env: dict[str, str], tmp: Path, name: str, extra: dict[str, str]) -> Any:
    env = {
        **os.environ,
        **pub_env,
        **extra,
        "PYTHONPATH": os.pathsep.join([str(APPS_DIR), os.environ.get("PYTHONPATH", "")]),
    }
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - closed with the process
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "celery",
            "-A",
            "publish_app",
            "beat",
            "--loglevel=INFO",
            "-s",
            str(tmp / f"{name}-schedule"),
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        cwd=str(tmp),
    )
    process.log_file = log  # type: ignore[attr-defined]
    return process


def _stop(process: Any) -> None:
    process.terminate()
    try:
        process.wait(10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)
    process.log_file.close()


def test_two_beats_run_a_periodic_task_once_per_slot(
    pub: ModuleType,
    pub_env: dict[str, str],
    start: Callable[..., WorkerGroup],
    tmp_path: Path,
) -> None:
    """Two ``celery beat`` processes, a 2 s schedule and ``idempotency_window=2`` for 20 s:
    every slot runs once, none is missed."""
    queue = f"{pub.QUEUE}-beat"  # the other tests' worker (no window) must not take ticks
    beat_env = {"PUB_BEAT": "2", "PUB_QUEUE": queue}
    pub.client().delete(f"{pub.PREFIX}fx:ticks")
    group = start(env=beat_env, queues=[queue])
    beats = []
    try:
        beats.append(_beat(pub_env, tmp_path, "beat-1", beat_env))
        time.sleep(1.0)  # the second beat fires half a slot later than the first
        beats.append(_beat(pub_env, tmp_path, "beat-2", beat_env))
        time.sleep(20)
    finally:
        for process in beats:
            _stop(process)
    time.sleep(2.5)  # the last published ticks run
    group.stop()
    logs = [(tmp_path / f"beat-{n}.log").read_text() for n in (1, 2)]
    sent = [log.count("Scheduler: Sending due task tick") for log in logs]
    ticks = [
        entry.decode().split("|") for entry in pub.client().lrange(f"{pub.PREFIX}fx:ticks", 0, -1)
    ]
    slots = [int(slot) for slot, _ in ticks]
    # How many slots pass depends on how fast two `celery beat` processes start on a loaded
    # machine; what must hold is relative to what they sent: each beat sends once per slot, so
    # every slot either beat sent in has run (the last one may still be cut by the stop).
    assert all(n >= 5 for n in sent), (sent, logs)  # both beats published, every 2 s
    assert len(slots) == len(set(slots)), f"a slot ran twice: {sorted(slots)}"
    assert sorted(slots) == list(range(min(slots), max(slots) + 2, 2)), f"missed: {sorted(slots)}"
    assert len(slots) >= max(sent) - 1, (sorted(slots), sent)
    assert sum(sent) > len(slots) + 5  # the other beat's publishes were stopped


def test_a_periodic_task_whose_key_collapses_its_runs_is_warned_about(
    start: Callable[..., WorkerGroup],
) -> None:
    group = start(env={"PUB_BEAT": "2", "PUB_NO_WINDOW": "1"}, pool="solo")
    try:
        log = group[0].log()
    finally:
        group.stop()
    assert "periodic task pub.tick (beat_schedule entry 'tick') is keyed by its arguments" in log
    assert "idempotency_window" in log


def test_inspect_shows_a_queued_key_and_forget_clears_it(pub: ModuleType) -> None:
    import json

    from celery.bin.base import CLIContext
    from click.testing import CliRunner

    from celery_idempotent.cli import idempotency

    def cli(*args: str) -> Any:
        obj = CLIContext(app=pub.app, no_color=True, workdir=None)
        result = CliRunner().invoke(idempotency, list(args), obj=obj)
        assert result.exit_code == 0, result.output
        return json.loads(result.stdout)

    t = tag()
    queue = f"{pub.QUEUE}-inspect"  # no worker: the key stays queued
    first = pub.charge.apply_async((t, 3), queue=queue)
    doc = cli("inspect", "--task", "pub.charge", "--args", json.dumps([t, 3]), "--json")
    assert doc["state"] == "queued"
    assert doc["queued"]["task_id"] == first.id
    assert 3500 < doc["queued"]["ttl"] <= 3600  # idempotency_publish_ttl
    assert pub.charge.idempotency_status((t, 3)).state == "queued"  # the Python admin API
    assert pub.charge.idempotency_status((t, 3)).task_id == first.id
    assert doc["record"] is None
    human = CliRunner().invoke(
        idempotency,
        ["inspect", "--task", "pub.charge", "--args", json.dumps([t, 3])],
        obj=CLIContext(app=pub.app, no_color=True, workdir=None),
    )
    assert human.exit_code == 0, human.output
    assert "queued (published, not run yet)" in human.stdout
    assert f"task {first.id}" in human.stdout
    gone = cli("forget", "--task", "pub.charge", "--args", json.dumps([t, 3]), "--yes", "--json")
    record = redis_keyspace.record_name(
        f"{pub.PREFIX}idem:", pub.charge.idempotency_key_for((t, 3), {})
    )
    assert gone["deleted"] == [record]
    assert pub.charge.apply_async((t, 3), queue=queue).id != first.id  # published again
    pub.client().delete(f"{pub.PREFIX}kombu:{queue}")


def test_a_failed_publish_removes_its_marker_and_a_resend_goes_through(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    from celery import Task

    t = tag()
    queue = f"{pub.QUEUE}-unconsumed"
    broker_list = f"{pub.PREFIX}kombu:{queue}"
    record = redis_keyspace.record_name(
        f"{pub.PREFIX}idem:", pub.charge.idempotency_key_for((t, 4), {})
    )

    def broken(*args: Any, **kwargs: Any) -> Any:
        raise ConnectionError("the broker is down")

    with monkeypatch.context() as patch:
        patch.setattr(Task, "apply_async", broken)
        with pytest.raises(ConnectionError):
            pub.charge.apply_async((t, 4), queue=queue)
    assert not pub.client().exists(record)  # the marker went with the failed publish

    first = pub.charge.apply_async((t, 4), queue=queue)
    assert redis_keyspace.parse_queued(pub.client().get(record)) == (
        first.id,
        pub.charge.idempotency_fingerprint_for((t, 4), {}),
    )
    # A client re-sending with the same task id publishes again (the marker is its own).
    again = pub.charge.apply_async((t, 4), queue=queue, task_id=first.id)
    assert again.id == first.id
    assert pub.client().llen(broker_list) == 2
    assert pub.charge.apply_async((t, 4), queue=queue).id == first.id  # another id: stopped
    assert pub.client().llen(broker_list) == 2
    pub.client().delete(broker_list, record)


def _redis_commands(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The commands this process sends through redis-py clients from now on (kombu's broker
    client, the store's; not pub/sub: the result backend's SUBSCRIBE is alike for all)."""
    import redis

    sent: list[str] = []
    original = redis.Redis.execute_command

    def spy(self: Any, *args: Any, **options: Any) -> Any:
        sent.append(str(args[0]).upper())
        return original(self, *args, **options)

    monkeypatch.setattr(redis.Redis, "execute_command", spy)
    return sent


def test_on_the_brokers_redis_the_check_and_the_push_are_one_script(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store on the broker's Redis: one EVALSHA checks, sets the marker and pushes the
    message (no LPUSH of kombu's); a duplicate is one EVALSHA that pushes nothing. The store
    on another database: the check, then kombu's own LPUSH; duplicates stopped alike."""
    t = tag()
    queue = f"{pub.QUEUE}-fused"  # no worker consumes it
    broker_list = f"{pub.PREFIX}kombu:{queue}"
    charge = pub.app.tasks["pub.charge"]
    record = redis_keyspace.record_name(
        f"{pub.PREFIX}idem:", charge.idempotency_key_for((t, 6), {})
    )
    pub.charge.apply_async((tag(), 6), queue=queue)  # the queue declared, the script loaded
    pub.client().delete(broker_list)

    sent = _redis_commands(monkeypatch)
    first = pub.charge.apply_async((t, 6), queue=queue)
    assert sent == ["EVALSHA"]  # one round trip: the check and the push
    assert pub.client().llen(broker_list) == 1
    assert redis_keyspace.parse_queued(pub.client().get(record)) == (
        first.id,
        charge.idempotency_fingerprint_for((t, 6), {}),
    )
    sent.clear()
    again = pub.charge.apply_async((t, 6), queue=queue, task_id=f"dup-{t}")
    assert sent == ["EVALSHA"]
    assert again.id == first.id
    assert pub.client().llen(broker_list) == 1  # nothing pushed
    # The stopped message's result subscription (Celery's Redis backend) was given back.
    consumer = pub.app.backend.result_consumer
    assert not any(f"dup-{t}" in str(name) for name in consumer.subscribed_to)
    pub.ship.apply_async(("o-" + t, "Main St"), queue=queue)
    with pytest.raises(IdempotencyMismatchError):  # raised here, at the caller
        pub.ship.apply_async(("o-" + t, "Elm St"), queue=queue)
    pub.client().delete(broker_list, record)

    # The store on another database of the server: not one script; the same decisions.
    other_url = pub.URL.rsplit("/", 1)[0] + "/1"
    charge_class = type(charge)
    charge_class.idempotency_url = other_url
    idem_settings.clear_cache()
    reset_backends()
    other = redis.Redis.from_url(other_url)
    try:
        sent.clear()
        first = pub.charge.apply_async((t, 7), queue=queue)
        assert sent[-2:] == ["EVALSHA", "LPUSH"]  # the check, then kombu's push
        sent.clear()
        assert pub.charge.apply_async((t, 7), queue=queue).id == first.id
        assert sent[-1:] == ["EVALSHA"]
        assert pub.client().llen(broker_list) == 1
    finally:
        charge_class.idempotency_url = None
        idem_settings.clear_cache()
        reset_backends()
        delete_keys_with_prefix(other, pub.PREFIX)
        other.close()
        pub.client().delete(broker_list)


def test_threads_publishing_one_key_at_once_make_one_message(pub: ModuleType) -> None:
    """Real threads, each arming its own check (a context variable per thread), publish the
    same call at once through the shared app: one message, one task id for all; and distinct
    calls from the same threads are each published once."""
    import threading

    t = tag()
    queue = f"{pub.QUEUE}-threads"  # no worker consumes it
    broker_list = f"{pub.PREFIX}kombu:{queue}"
    pub.charge.apply_async((tag(), 9), queue=queue)  # the queue declared
    pub.client().delete(broker_list)
    barrier = threading.Barrier(8)
    ids: list[str] = []
    errors: list[BaseException] = []

    def publish(n: int) -> None:
        try:
            barrier.wait(timeout=10)
            ids.append(pub.charge.apply_async((t, 9), queue=queue).id)
            ids.append(pub.charge.apply_async((f"{t}-{n}", 9), queue=queue).id)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=publish, args=(n,)) for n in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=30)
    assert not errors, errors
    assert len(ids) == 16
    assert len(set(ids)) == 1 + 8  # one id for the shared call, one per distinct call
    assert pub.client().llen(broker_list) == 1 + 8
    pub.client().delete(broker_list)


def test_a_push_that_fails_in_the_script_removes_its_marker(pub: ModuleType) -> None:
    """The marker is set and the push fails in the same script (the queue's name holds a
    string): the caller gets the error and no marker is left behind."""
    from celery_idempotent import IdempotencyBackendError

    t = tag()
    queue = f"{pub.QUEUE}-broken"
    broker_list = f"{pub.PREFIX}kombu:{queue}"
    record = redis_keyspace.record_name(
        f"{pub.PREFIX}idem:", pub.charge.idempotency_key_for((t, 8), {})
    )
    pub.charge.apply_async((tag(), 8), queue=queue)  # the queue declared
    pub.client().set(broker_list, "not a list")
    try:
        with pytest.raises(IdempotencyBackendError, match="WRONGTYPE"):
            pub.charge.apply_async((t, 8), queue=queue)
        assert not pub.client().exists(record)
    finally:
        pub.client().delete(broker_list)
    first = pub.charge.apply_async((t, 8), queue=queue)  # published now, under a new marker
    assert redis_keyspace.parse_queued(pub.client().get(record))[0] == first.id  # type: ignore[index]
    assert pub.client().llen(broker_list) == 1
    pub.client().delete(broker_list, record)


def test_the_slot_comes_from_the_header_else_the_eta_else_the_clock(pub: ModuleType) -> None:
    from celery_idempotent.celery.task import SLOT_HEADER

    tick = pub.app.tasks["pub.tick"]
    tick_class = type(tick)
    tick_class.idempotency_window = 60
    idem_settings.clear_cache()
    try:
        tick.push_request(id="a", headers={SLOT_HEADER: "120"})
        assert tick.idempotency_key_for((), {}).endswith("@120")
        tick.pop_request()
        tick.push_request(id="b", headers={}, eta="1970-01-01T00:02:29+00:00")  # 149 s
        assert tick.idempotency_key_for((), {}).endswith("@120")  # nearest multiple of 60
        tick.pop_request()
        tick.push_request(id="c", headers={})
        now_slot = keyspace.slot_for(time.time(), 60)
        assert tick.idempotency_key_for((), {}).endswith(f"@{now_slot}")
        tick.pop_request()
        assert keyspace.slot_for(89.9, 60) == "60"
        assert keyspace.slot_for(90.1, 60) == "120"
    finally:
        tick_class.idempotency_window = None
        idem_settings.clear_cache()


# --------------------------------------------------------------------------- kombu's Redis paths


def _fresh_list(pub: ModuleType, name: str, *, queue: Any = None) -> str:
    """The broker's list of the unconsumed queue ``name``, declared and empty."""
    pub.charge.apply_async((tag(), 0), queue=queue if queue is not None else name)
    broker_list = f"{pub.PREFIX}kombu:{name}"
    pub.client().delete(broker_list)
    return broker_list


def _record(pub: ModuleType, *args: Any) -> str:
    return redis_keyspace.record_name(
        f"{pub.PREFIX}idem:", pub.charge.idempotency_key_for(args, {})
    )


def test_a_stopped_duplicate_keeps_the_pooled_broker_connection(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A duplicate is stopped by an exception out of kombu's publish: it must not reach the
    producer pool's context, which replaces (closes and reconnects) a producer that saw an
    exception. So the publish after a stopped duplicate is still one EVALSHA, no reconnection."""
    from kombu.resource import Resource

    t = tag()
    queue = f"{pub.QUEUE}-pool"
    broker_list = _fresh_list(pub, queue)
    replaced: list[Any] = []
    original = Resource.replace
    monkeypatch.setattr(
        Resource,
        "replace",
        lambda self, resource: (replaced.append(resource), original(self, resource)),
    )
    first = pub.charge.apply_async((t, 1), queue=queue)
    sent = _redis_commands(monkeypatch)
    for _ in range(3):
        assert pub.charge.apply_async((t, 1), queue=queue).id == first.id
    assert pub.charge.apply_async((f"{t}-next", 1), queue=queue).id != first.id
    assert replaced == []
    assert sent == ["EVALSHA"] * 4  # no PING of a new connection, no queue declared again
    assert pub.client().llen(broker_list) == 2
    pub.client().delete(broker_list, _record(pub, t, 1), _record(pub, f"{t}-next", 1))


def test_the_script_pushes_what_kombus_own_put_pushes(pub: ModuleType) -> None:
    """Pins kombu: for each priority (kombu's Redis transport keeps one list per priority
    step, ``queue\\x06\\x16<step>``) under the app's ``global_keyprefix``, the list name and
    bytes the script would push are those kombu's own ``Channel._put`` pushes. A kombu that
    changes its ``_put`` fails here, not in production."""
    from kombu.transport import redis as kombu_redis

    from celery_idempotent.backends.redis import publish as publish_redis

    assert publish_redis.install()
    assert publish_redis.kombu_problem(kombu_redis) is None
    own_put = kombu_redis.Channel._put.__wrapped__  # type: ignore[attr-defined]
    from kombu import Connection

    store = pub.charge.idempotency_guard().store
    queue = f"{pub.QUEUE}-pin-{tag()}"

    def compare(channel: Any, prefix: str) -> None:
        for priority in (None, 0, 1, 4, 6, 9, 255):
            message = {
                "body": "e30=",
                "headers": {"id": tag(), "task": "pub.charge"},
                "properties": {"priority": priority, "delivery_info": {}},
            }
            push = publish_redis.fused_push(channel, queue, message, store)
            assert push is not None
            before = set(pub.client().scan_iter(f"{prefix}{queue}*"))
            own_put(channel, queue, message)
            after = set(pub.client().scan_iter(f"{prefix}{queue}*"))
            (name,) = after - before or before
            assert push[0] == name.decode()
            assert pub.client().lpop(name) == (
                push[1].encode() if isinstance(push[1], str) else push[1]
            )

    with pub.app.producer_or_acquire() as producer:
        compare(producer.channel, f"{pub.PREFIX}kombu:")
    # Ten priority steps, another separator and prefix, priority order.
    options = {
        "global_keyprefix": f"{pub.PREFIX}k2:",
        "priority_steps": list(range(10)),
        "sep": ":",
        "queue_order_strategy": "priority",
    }
    with Connection(pub.URL, transport_options=options) as connection:
        compare(connection.default_channel, f"{pub.PREFIX}k2:")
    # What the script relies on, read from kombu's source shape.
    assert (
        publish_redis.kombu_problem(type("M", (), {"Channel": object, "dumps": None})) is not None
    )

    class NewPut:
        def _put(self, queue: str, message: Any, client: Any = None, **kwargs: Any) -> None: ...
        def _q_for_pri(self, queue: str, pri: int) -> str: ...
        def _get_message_priority(self, message: Any, reverse: bool = False) -> int: ...

    problem = publish_redis.kombu_problem(type("M", (), {"Channel": NewPut, "dumps": len}))
    assert problem is not None
    assert "_put" in problem


def test_an_untested_kombu_is_refused_the_fused_push_with_the_reason() -> None:
    """No upper bound on kombu in setup.cfg; instead a kombu outside the tested range
    (``TESTED_KOMBU``) gets the check-then-push path, and the WARNING says why."""
    from kombu.transport import redis as kombu_redis

    from celery_idempotent.backends.redis import publish as publish_redis

    assert publish_redis.TESTED_KOMBU == ((5, 5, 2), (5, 8))
    assert publish_redis.kombu_problem(kombu_redis) is None  # this env's kombu: tested
    for version in ("5.5.2", "5.6.2", "5.7.0", "5.7.9"):
        assert publish_redis.kombu_problem(kombu_redis, version) is None, version
    for version in ("5.8.0", "5.8.0rc1", "6.0.0", "5.5.1", "5.4.2"):
        problem = publish_redis.kombu_problem(kombu_redis, version)
        assert problem is not None
        assert f"kombu {version} is not one this release of celery-idempotent was tested" in (
            problem
        )
        assert "5.5.2 up to (not including) 5.8" in problem


def test_an_untested_kombu_checks_then_lets_kombu_push(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What the start-up check leads to: the check runs alone, kombu pushes the message
    itself, and the duplicate is still stopped (never lost, never unchecked)."""
    from kombu.transport import redis as kombu_redis

    from celery_idempotent.backends.redis import publish as publish_redis

    problem = publish_redis.kombu_problem(kombu_redis, "5.8.0")
    monkeypatch.setattr(publish_redis, "_fuse_problem", problem)
    t = tag()
    queue = f"{pub.QUEUE}-kombu58"
    broker_list = _fresh_list(pub, queue)
    sent = _redis_commands(monkeypatch)
    first = pub.charge.apply_async((t, 11), queue=queue)
    assert sent == ["EVALSHA", "LPUSH"]  # the check, then kombu's own push
    sent.clear()
    assert pub.charge.apply_async((t, 11), queue=queue).id == first.id
    assert sent == ["EVALSHA"]
    assert pub.client().llen(broker_list) == 1
    pub.client().delete(broker_list, _record(pub, t, 11))


def test_a_kombu_channel_without_expires_still_fuses(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """kombu 5.5 and 5.6 (both supported) have no ``Channel._expires`` (``x-expires`` came
    with 5.7): the check and the push are still one script, not an AttributeError."""
    t = tag()
    queue = f"{pub.QUEUE}-k56"
    broker_list = _fresh_list(pub, queue)
    with pub.app.producer_or_acquire() as producer:
        if KOMBU_57:  # take it away, as 5.5 and 5.6 have it
            saved = producer.channel.__dict__.pop("_expires")
        else:  # the real thing
            assert not hasattr(producer.channel, "_expires")
        try:
            sent = _redis_commands(monkeypatch)
            first = pub.charge.apply_async((t, 2), queue=queue, producer=producer)
            assert sent == ["EVALSHA"]
            assert pub.charge.apply_async((t, 2), queue=queue, producer=producer).id == first.id
        finally:
            if KOMBU_57:
                producer.channel._expires = saved
    assert pub.client().llen(broker_list) == 1
    pub.client().delete(broker_list, _record(pub, t, 2))


def test_a_channel_that_cannot_name_the_list_falls_back_to_check_then_push(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A kombu whose channel no longer names the list as the script expects: the check runs
    alone and kombu pushes the message itself (never lost, never unchecked)."""
    from kombu.transport import redis as kombu_redis

    t = tag()
    queue = f"{pub.QUEUE}-newkombu"
    broker_list = _fresh_list(pub, queue)

    own = kombu_redis.Channel._q_for_pri

    def q_for_pri(self: Any, queue: str, pri: Any) -> str:
        if sys._getframe(1).f_globals.get("__name__") != "kombu.transport.redis":
            raise AttributeError("_q_for_pri is gone")  # for the hook; kombu's _put has its own
        return str(own(self, queue, pri))

    monkeypatch.setattr(kombu_redis.Channel, "_q_for_pri", q_for_pri)
    sent = _redis_commands(monkeypatch)
    first = pub.charge.apply_async((t, 3), queue=queue)
    assert sent == ["EVALSHA", "LPUSH"]  # the check, then kombu's own push
    sent.clear()
    assert pub.charge.apply_async((t, 3), queue=queue).id == first.id
    assert sent == ["EVALSHA"]
    assert pub.client().llen(broker_list) == 1
    pub.client().delete(broker_list, _record(pub, t, 3))


def test_a_fanout_exchange_is_checked_then_published_by_kombu(pub: ModuleType) -> None:
    """A Broadcast queue (a fanout exchange: kombu's Redis transport PUBLISHes the message to
    a pub/sub topic): the check runs alone, kombu publishes once; the duplicate is stopped
    without unbinding the queue (a producer closed by the stop would delete the fanout
    bindings its channel declared)."""
    from kombu.common import Broadcast

    t = tag()
    name = f"{pub.QUEUE}-bcast-{t}"
    broadcast = Broadcast(name)
    listener = pub.client().pubsub()
    listener.psubscribe(f"{pub.PREFIX}kombu:/*.{name}*")
    listener.get_message(timeout=2)  # the psubscribe confirmation
    binding = f"{pub.PREFIX}kombu:_kombu.binding.{name}"
    try:
        first = pub.charge.apply_async((t, 5), queue=broadcast, declare=[broadcast])
        members = pub.client().smembers(binding)
        assert members
        again = pub.charge.apply_async((t, 5), queue=broadcast, declare=[broadcast])
        assert again.id == first.id
        assert pub.client().smembers(binding) == members  # still bound
        heard = []
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:  # the message, then 0.3 s for a second one
            message = listener.get_message(timeout=0.3 if heard else 1.0)
            if message is not None and message["type"] == "pmessage":
                heard.append(message["data"])
            elif heard:
                break
        assert len(heard) == 1
        assert f'"id": "{first.id}"'.encode() in heard[0]
        assert redis_keyspace.parse_queued(pub.client().get(_record(pub, t, 5)))[0] == first.id  # type: ignore[index]
    finally:
        listener.close()
        pub.client().delete(binding, _record(pub, t, 5))


def test_an_x_expires_queue_is_checked_then_pushed_by_kombu(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue with ``x-expires``: kombu 5.7 pushes with a PEXPIRE of every priority list, so
    the check runs alone and kombu pushes (the list gets its expiry); kombu 5.5 and 5.6 set no
    expiry on a Redis queue, so the check and the push stay one script and the list keeps no
    TTL, as kombu's own push leaves it. The duplicate is stopped either way."""
    from kombu import Queue

    t = tag()
    queue = Queue(f"{pub.QUEUE}-expires", expires=120)
    broker_list = _fresh_list(pub, queue.name, queue=queue)
    sent = _redis_commands(monkeypatch)
    first = pub.charge.apply_async((t, 6), queue=queue)
    # 5.7: the check; kombu's LPUSH + PEXPIREs go in its pipeline. Before: the fused script.
    assert sent == ["EVALSHA"]
    assert pub.client().llen(broker_list) == 1
    if KOMBU_57:
        assert 0 < pub.client().pttl(broker_list) <= 120_000
    else:
        assert pub.client().pttl(broker_list) == -1  # kombu < 5.7 ignores x-expires on Redis
    assert pub.charge.apply_async((t, 6), queue=queue).id == first.id
    assert pub.client().llen(broker_list) == 1
    pub.client().delete(broker_list, _record(pub, t, 6))


def test_priorities_and_countdowns_go_where_kombu_puts_them(
    pub: ModuleType, worker: WorkerGroup
) -> None:
    """A priority goes to its priority step's list (``queue\\x06\\x16<step>``), as a plain
    ``send_task`` of the same priority; a countdown's message is in the queue as any other.
    With the worker: each runs once, and its duplicates are stopped at publish."""
    t = tag()
    queue = f"{pub.QUEUE}-pri-{t}"
    for priority in (None, 0, 5, 9):
        pub.charge.apply_async((f"{t}-{priority}", 1), queue=queue, priority=priority)
        pub.app.send_task("pub.charge", (f"{t}-{priority}", 2), queue=queue, priority=priority)
    where: dict[str, str] = {}
    lists = list(pub.client().scan_iter(f"{pub.PREFIX}kombu:{queue}*"))
    for key in lists:
        for raw in pub.client().lrange(key, 0, -1):
            where[json.loads(raw)["headers"]["argsrepr"]] = key.decode()
    assert len(where) == 8
    for priority in (None, 0, 5, 9):
        assert where[repr((f"{t}-{priority}", 1))] == where[repr((f"{t}-{priority}", 2))]
    assert where[repr((f"{t}-None", 1))] == f"{pub.PREFIX}kombu:{queue}"
    assert where[repr((f"{t}-9", 1))] == f"{pub.PREFIX}kombu:{queue}\x06\x169"
    pub.client().delete(*lists)

    # With the worker: priorities and a countdown, each once.
    results = [
        pub.charge.apply_async((f"{t}-w{priority}", 3), priority=priority) for priority in (0, 9)
    ]
    late = pub.charge.apply_async((f"{t}-late", 3), countdown=1)
    assert pub.charge.apply_async((f"{t}-late", 3), countdown=5).id == late.id
    assert pub.charge.apply_async((f"{t}-w9", 3), priority=9).id == results[1].id
    for result in [*results, late]:
        assert result.get(timeout=TIMEOUT)["run"] == 1
    assert pub.charge.apply_async((f"{t}-late", 3)).get(timeout=1)["run"] == 1  # replayed


def test_a_sentinel_broker_checks_and_pushes_in_one_script(
    redis_sentinel: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A ``sentinel://`` broker (kombu's SentinelTransport), the store following it to the
    master: the check and the push are one script on the master, under the broker's
    ``global_keyprefix``; kombu reads the message back from its queue; duplicates stopped."""
    from celery import Celery

    from celery_idempotent import IdempotentTask

    host, port = redis_sentinel.sentinel_hosts[0]
    app = Celery("sentinel_pub", set_as_current=False)
    app.conf.update(
        broker_url=f"sentinel://{host}:{port}/0",
        broker_transport_options={
            "master_name": redis_sentinel.master_name,
            "global_keyprefix": "sp:",
        },
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        idempotency_key_prefix="sp:idem:",
    )

    @app.task(base=IdempotentTask, shared=False, name="sp.charge")
    def charge(tag: str, amount: int) -> int:
        return amount

    master = redis_sentinel.master_client()
    try:
        charge.apply_async(("warm", 0), queue="spq")  # connected, the queue declared
        master.delete("sp:spq")
        sent = _redis_commands(monkeypatch)
        first = charge.apply_async(("a", 1), queue="spq")
        assert "EVALSHA" in sent
        assert "LPUSH" not in sent  # pushed by the script
        assert charge.apply_async(("a", 1), queue="spq").id == first.id
        assert charge.apply_async(("a", 1), queue="spq", task_id="other").id == first.id
        assert master.llen("sp:spq") == 1
        with app.connection_for_read() as connection:
            message = connection.default_channel.basic_get("spq", no_ack=True)
            assert message is not None
            assert message.headers["id"] == first.id
    finally:
        app.close()
        reset_backends()


def test_tasks_on_green_pools_publish_without_swapping_their_checks(
    pub: ModuleType, start: Callable[..., WorkerGroup]
) -> None:
    """On a gevent and an eventlet worker (started side by side), eight tasks at once each
    publish, from inside the task, the same call and calls of their own, with greenlet
    switches in between (the check's round trip is one): each greenlet's armed check stays its
    own (a context variable per greenlet), so the shared call is one message with one id, and
    every message in the queue carries the id its publisher got, under the marker of its own
    arguments. (A check armed per process instead fails here: ids swap.)"""
    from concurrent.futures import ThreadPoolExecutor

    pools = ("gevent", "eventlet")
    with ThreadPoolExecutor(2) as starter:
        groups = list(
            starter.map(
                lambda pool: start(pool=pool, concurrency=8, queues=[f"{pub.QUEUE}-{pool}"]),
                pools,
            )
        )
    try:
        for pool in pools:
            _check_green_pool(pub, pool)
    finally:
        for group in groups:
            group.stop()


def _check_green_pool(pub: ModuleType, pool: str) -> None:
    t = tag()
    target = f"{pub.QUEUE}-{pool}-out"
    broker_list = _fresh_list(pub, target)
    results = [
        pub.fan_out.apply_async((t, n, target), queue=f"{pub.QUEUE}-{pool}") for n in range(8)
    ]
    got = [result.get(timeout=TIMEOUT) for result in results]
    ids: dict[str, set[str]] = {}
    for pairs in got:
        for own, task_id in pairs:
            ids.setdefault(own, set()).add(task_id)
    assert len(ids) == 1 + 8 * 3
    assert all(len(found) == 1 for found in ids.values()), (pool, ids)
    headers = [json.loads(raw)["headers"] for raw in pub.client().lrange(broker_list, 0, -1)]
    assert len(headers) == 1 + 8 * 3, pool
    for header in headers:
        own = ast.literal_eval(header["argsrepr"])[0]
        assert ids[own] == {header["id"]}
        marker = redis_keyspace.parse_queued(pub.client().get(_record(pub, own, 0)))
        assert marker is not None
        assert marker[0] == header["id"]
    pub.client().delete(broker_list)


def test_a_publish_that_fails_before_its_push_leaves_no_mark_behind(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Celery fails between the arming and kombu's ``_put`` (a bad countdown): nothing was
    checked, so no marker is in Redis and the next publish of the same call is checked and
    published under its own id; a ``before_task_publish`` handler that raises (Celery logs it
    and publishes) changes nothing; the next unrelated publish is checked for itself."""
    from celery.signals import before_task_publish

    t = tag()
    queue = f"{pub.QUEUE}-stale"
    broker_list = _fresh_list(pub, queue)
    with pytest.raises(TypeError):
        pub.charge.apply_async((t, 7), queue=queue, countdown="soon")
    assert not pub.client().exists(_record(pub, t, 7))
    assert pub.client().llen(broker_list) == 0

    def handler(**kwargs: Any) -> None:
        raise RuntimeError("a broken before_task_publish handler")

    before_task_publish.connect(handler, weak=False)
    try:
        sent = _redis_commands(monkeypatch)
        first = pub.charge.apply_async((t, 7), queue=queue)
        # The TypeError went through the producer pool (as it does for any publish): the
        # producer was replaced, its new connection PINGs (and kombu < 5.7 declares the
        # queue again). Then the one script, which pushed the message.
        assert sent.count("EVALSHA") == 1
        assert "LPUSH" not in sent
        assert redis_keyspace.parse_queued(pub.client().get(_record(pub, t, 7)))[0] == first.id  # type: ignore[index]
        assert pub.charge.apply_async((t, 7), queue=queue).id == first.id
    finally:
        before_task_publish.disconnect(handler)
    other = pub.charge.apply_async((f"{t}-other", 7), queue=queue)
    assert other.id != first.id
    assert (
        redis_keyspace.parse_queued(pub.client().get(_record(pub, f"{t}-other", 7)))[0] == other.id
    )  # type: ignore[index]
    assert pub.client().llen(broker_list) == 2
    pub.client().delete(broker_list)


def test_a_failure_after_the_push_keeps_the_marker_of_the_queued_message(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The message is in the broker and Celery fails after (say its task-sent event cannot be
    sent): the caller gets the error, and the marker stays, naming the queued message, so a
    retry of the caller is stopped instead of publishing a second message."""
    t = tag()
    queue = f"{pub.QUEUE}-after"
    broker_list = _fresh_list(pub, queue)
    sent_ids: list[str] = []
    original = pub.app.amqp.send_task_message

    def then_fail(producer: Any, name: str, message: Any, **kwargs: Any) -> Any:
        original(producer, name, message, **kwargs)
        sent_ids.append(message.headers["id"])
        raise RuntimeError("the task-sent event could not be sent")

    with monkeypatch.context() as patch:
        patch.setattr(pub.app.amqp, "send_task_message", then_fail)
        with pytest.raises(RuntimeError, match="task-sent"):
            pub.charge.apply_async((t, 8), queue=queue)
    assert pub.client().llen(broker_list) == 1
    assert redis_keyspace.parse_queued(pub.client().get(_record(pub, t, 8)))[0] == sent_ids[0]  # type: ignore[index]
    assert pub.charge.apply_async((t, 8), queue=queue).id == sent_ids[0]
    assert pub.client().llen(broker_list) == 1
    pub.client().delete(broker_list)


def test_a_redis_transport_whose_channel_pushes_its_own_way_is_checked_first(
    pub: ModuleType,
) -> None:
    """A subclass of kombu's Redis transport whose channel overrides ``_put`` (and never calls
    kombu's) would push past the hook: such a broker gets the check first, as RabbitMQ does,
    so its duplicates are still stopped."""
    from kombu import Connection
    from kombu.transport import redis as kombu_redis

    pushed: list[str] = []

    class OwnChannel(kombu_redis.Channel):  # type: ignore[misc]
        def _put(self, queue: str, message: Any, **kwargs: Any) -> None:
            pushed.append(message["headers"]["id"])
            with self.conn_or_acquire() as client:
                client.lpush(queue, kombu_redis.dumps(message))

    class OwnTransport(kombu_redis.Transport):  # type: ignore[misc]
        Channel = OwnChannel

    t = tag()
    queue = f"{pub.QUEUE}-own"
    broker_list = f"{pub.PREFIX}kombu:{queue}"
    options = {"global_keyprefix": f"{pub.PREFIX}kombu:"}
    with Connection(pub.URL, transport=OwnTransport, transport_options=options) as connection:
        producer = connection.Producer()
        first = pub.charge.apply_async((t, 9), queue=queue, producer=producer)
        again = pub.charge.apply_async((t, 9), queue=queue, producer=producer)
    assert again.id == first.id
    assert pushed == [first.id]
    assert pub.client().llen(broker_list) == 1
    assert redis_keyspace.parse_queued(pub.client().get(_record(pub, t, 9)))[0] == first.id  # type: ignore[index]
    pub.client().delete(broker_list)


def test_a_batch_keeps_the_markers_it_pushed_and_drops_those_it_discarded(
    pub: ModuleType,
) -> None:
    """kombu's ``Producer.batch()`` buffers the messages and pushes them when it flushes (at
    the end, or each ``max_size`` commands): a duplicate inside the batch is stopped; when the
    batch is given up, the markers of the messages it discarded go with them (else the key
    would answer with a task id that was never published, for ``idempotency_publish_ttl``),
    and those of the messages an earlier flush pushed stay."""
    from celery_idempotent.backends.redis import publish as publish_redis

    if not KOMBU_57:  # no batches to keep markers for: nothing watched, nothing to break
        assert not hasattr(pub.app.producer_pool.create_producer(), "batch")
        assert publish_redis.install()
        assert publish_redis._watched_batches is publish_redis._NoBatches
        return
    assert publish_redis._watched_batches is not publish_redis._NoBatches
    t = tag()
    queue = f"{pub.QUEUE}-batch"
    broker_list = _fresh_list(pub, queue)
    ids: list[str] = []

    def give_up(producer: Any) -> None:
        with producer.batch(max_size=2):
            ids.extend(
                pub.charge.apply_async((f"{t}-{n}", 10), queue=queue, producer=producer).id
                for n in range(3)
            )
            again = pub.charge.apply_async((f"{t}-2", 10), queue=queue, producer=producer)
            assert again.id == ids[2]
            assert pub.client().llen(broker_list) == 2  # flushed at max_size; the third buffered
            raise RuntimeError("the caller gives up")

    with pub.app.producer_or_acquire() as producer:
        with pytest.raises(RuntimeError, match="gives up"):
            give_up(producer)
        assert pub.client().llen(broker_list) == 2
        for n in range(2):
            assert (
                redis_keyspace.parse_queued(pub.client().get(_record(pub, f"{t}-{n}", 10)))[0]
                == ids[n]
            )  # type: ignore[index]
        assert not pub.client().exists(_record(pub, f"{t}-2", 10))

        with producer.batch():
            third = pub.charge.apply_async((f"{t}-2", 10), queue=queue, producer=producer)
            assert third.id != ids[2]
            assert (
                pub.charge.apply_async((f"{t}-0", 10), queue=queue, producer=producer).id == ids[0]
            )
    assert pub.client().llen(broker_list) == 3
    assert redis_keyspace.parse_queued(pub.client().get(_record(pub, f"{t}-2", 10)))[0] == third.id  # type: ignore[index]
    assert pub.charge.apply_async((f"{t}-2", 10), queue=queue).id == third.id
    pub.client().delete(broker_list)


def test_a_message_kombu_routes_to_no_queue_sets_no_marker(pub: ModuleType) -> None:
    """An exchange nothing is bound to: kombu's Redis transport drops the message without
    pushing it (as for a plain publish), so the hook never sees it: no marker blocks the key,
    and the next publish to a real queue is checked and published."""
    t = tag()
    nowhere = pub.charge.apply_async((t, 11), exchange=f"nowhere-{t}", routing_key="nobody")
    assert not pub.client().exists(_record(pub, t, 11))
    queue = f"{pub.QUEUE}-somewhere"
    broker_list = _fresh_list(pub, queue)
    first = pub.charge.apply_async((t, 11), queue=queue)
    assert first.id != nowhere.id
    assert redis_keyspace.parse_queued(pub.client().get(_record(pub, t, 11)))[0] == first.id  # type: ignore[index]
    assert pub.client().llen(broker_list) == 1
    pub.client().delete(broker_list)


def test_over_rabbitmq_the_check_comes_first_and_a_failed_publish_drops_its_marker(
    pub: ModuleType, rabbitmq_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RabbitMQ (no hook): the check is its own round trip before the publish. Three
    publishes of one call are one message in the queue with one id; a publish that fails in
    Celery after the check removes the marker it set, so the call publishes again."""
    from celery import Celery
    from kombu import Connection

    from celery_idempotent import IdempotentTask

    t = tag()
    queue = f"pub-rabbit-{t}"
    app = Celery("pub_rabbit", set_as_current=False)
    app.conf.update(
        broker_url=rabbitmq_url,
        task_ignore_result=True,
        task_serializer="json",
        accept_content=["json"],
        idempotency_url=pub.URL,
        idempotency_key_prefix=f"{pub.PREFIX}idem:",
    )

    @app.task(base=IdempotentTask, shared=False, name="pub.charge")
    def charge(tag: str, amount: int) -> int:
        return amount

    def waiting() -> int:
        with Connection(rabbitmq_url, connect_timeout=5) as connection:
            return int(connection.default_channel.queue_declare(queue, passive=True).message_count)

    try:
        sent = _redis_commands(monkeypatch)
        first = charge.apply_async((t, 12), queue=queue)
        assert sent == ["EVALSHA"]  # the check; the publish went to RabbitMQ
        assert charge.apply_async((t, 12), queue=queue).id == first.id
        assert charge.apply_async((t, 12), queue=queue, task_id=f"x-{t}").id == first.id
        deadline = time.monotonic() + 5
        while waiting() < 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.2)
        assert waiting() == 1

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("Celery failed before the publish")

        with monkeypatch.context() as patch:
            patch.setattr(app.amqp, "send_task_message", broken)
            with pytest.raises(RuntimeError, match="before the publish"):
                charge.apply_async((f"{t}-b", 12), queue=queue)
        assert not pub.client().exists(_record(pub, f"{t}-b", 12))
        again = charge.apply_async((f"{t}-b", 12), queue=queue)
        assert (
            redis_keyspace.parse_queued(pub.client().get(_record(pub, f"{t}-b", 12)))[0] == again.id
        )  # type: ignore[index]
    finally:
        with Connection(rabbitmq_url, connect_timeout=5) as connection:
            connection.default_channel.queue_delete(queue)
        app.close()
        reset_backends()


def test_kombus_publish_retry_pushes_once_after_one_check(
    pub: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The store on another database (the check, then kombu's push) and the push failing
    once with a connection error: kombu's publish retry pushes again without a second check
    (the first one's marker names this message), one message; its duplicate is stopped."""
    t = tag()
    queue = f"{pub.QUEUE}-retry"
    broker_list = _fresh_list(pub, queue)
    other_url = pub.URL.rsplit("/", 1)[0] + "/1"
    charge_class = type(pub.app.tasks["pub.charge"])
    charge_class.idempotency_url = other_url
    idem_settings.clear_cache()
    reset_backends()
    other = redis.Redis.from_url(other_url)
    failures = [redis.ConnectionError("the broker connection dropped")]
    lpush = redis.Redis.lpush

    def flaky_lpush(self: Any, name: Any, *values: Any) -> Any:
        if failures:
            raise failures.pop()
        return lpush(self, name, *values)

    try:
        monkeypatch.setattr(redis.Redis, "lpush", flaky_lpush)
        sent = _redis_commands(monkeypatch)
        first = pub.charge.apply_async((t, 13), queue=queue)
        assert not failures  # the failure happened, and kombu retried
        assert sent.count("EVALSHA") == 1
        assert pub.client().llen(broker_list) == 1
        record = redis_keyspace.record_name(
            f"{pub.PREFIX}idem:", pub.charge.idempotency_key_for((t, 13), {})
        )
        assert redis_keyspace.parse_queued(other.get(record))[0] == first.id  # type: ignore[index]
        assert pub.charge.apply_async((t, 13), queue=queue).id == first.id
        assert pub.client().llen(broker_list) == 1
    finally:
        charge_class.idempotency_url = None
        idem_settings.clear_cache()
        reset_backends()
        delete_keys_with_prefix(other, pub.PREFIX)
        other.close()
        pub.client().delete(broker_list)
