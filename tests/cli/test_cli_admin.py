"""``celery -A proj idempotency inspect | forget | stats`` on real records in a real Redis.

Through click's CliRunner (the group invoked with the app in Celery's CLI context) and through
a real ``python -m celery -A cliadmin_app idempotency ...`` subprocess.
"""

from __future__ import annotations

import json
import os
import re
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest
from cliadmin_app import TRIPPED, Tripwire

from celery_idempotent import (
    DistributedIdempotencyGuard,
    LockLostError,
    RedisIdempotencyStore,
    RedisLockProvider,
    fingerprint_payload,
)
from celery_idempotent.backends.redis.keyspace import decode_record, parse_lock_value
from celery_idempotent.cli import parse_redis_name, task_of_slot
from celery_idempotent.core.fingerprint import lock_resource, record_key

if TYPE_CHECKING:
    import subprocess

    import redis
    from celery import Celery
    from click.testing import Result
    from conftest import Holder

pytestmark = pytest.mark.redis

HOLDER_RE = re.compile(rf"^{re.escape(socket.gethostname())}:{os.getpid()}:[0-9a-f]{{8}}$")


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result


def as_json(result: Result | subprocess.CompletedProcess[str]) -> Any:
    return json.loads(result.stdout)


def charge(app: Celery, order: int = 42, amount: int = 999, key: str | None = "payment-42") -> Any:
    headers = {"idempotency_key": key} if key else None
    return app.tasks["cliadmin.charge"].apply((order, amount), headers=headers).get()


def fence_of(client: redis.Redis, record_name: str) -> int:
    """The fencing token a record was committed under."""
    token = decode_record(client.get(record_name), record_name).fencing_token
    assert token is not None
    return token


def names(client: redis.Redis, prefix: str) -> set[str]:
    return {n.decode() for n in client.scan_iter(match=f"{prefix}*", count=1000)}


def fill(app: Celery, guard: DistributedIdempotencyGuard, count: int) -> list[str]:
    """``count`` completed args-keyed records of cliadmin.charge, made by the guard."""
    task = app.tasks["cliadmin.charge"]
    keys = []
    for order in range(count):
        key = task.idempotency_key_for((order, 10), {})
        guard.execute(key, lambda o=order: {"order": o}, input={"order_id": order, "amount": 10})
        keys.append(key)
    return keys


def commandstats(client: redis.Redis) -> dict[str, int]:
    info = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in info.items()}


# --------------------------------------------------------------------------- inspect


def test_inspect_completed_shows_record_metadata(
    cli_app: Celery, run_cli: Callable[..., Result], redis_client: redis.Redis, key_prefix: str
) -> None:
    assert charge(cli_app) == {"order": 42, "charged": 999}
    key = "cliadmin.charge:key:payment-42"
    rname = record_key(key_prefix, key)

    out = ok(run_cli("inspect", "payment-42", "--task", "cliadmin.charge")).stdout
    assert re.search(r"^state\s+completed$", out, re.M)
    assert re.search(r"^ttl left\s+23h59m$", out, re.M)
    assert re.search(r"^lock\s+free$", out, re.M)
    assert f"record name    {rname}" in out

    doc = as_json(ok(run_cli("inspect", "payment-42", "--task", "cliadmin.charge", "--json")))
    record = doc["record"]
    assert doc["key"] == key
    assert doc["task"] == "cliadmin.charge"
    assert doc["state"] == "completed"
    assert doc["prefix"] == key_prefix
    assert record["name"] == rname
    assert record["content_type"] == "application/json"
    stored = decode_record(redis_client.get(rname), rname)
    assert record["size"] == len(stored.data)
    assert record["fingerprint"] == fingerprint_payload({"order_id": 42, "amount": 999})
    assert record["fencing_token"] == stored.fencing_token
    assert 0 <= record["age"] < 30
    assert 86_000 < record["ttl"] <= 86_400
    assert doc["lock"] == {
        "name": lock_resource(key_prefix, key),
        "held": False,
        "holder": None,
        "ttl": None,
        "task_id": None,  # the running call's (idempotency_publish_until="started")
    }
    assert doc["fence"]["last"] == record["fencing_token"]
    assert "result" not in doc


def test_inspect_every_way_of_naming_a_key(
    cli_app: Celery, run_cli: Callable[..., Result], key_prefix: str
) -> None:
    charge(cli_app, 7, 70, key=None)  # keyed by the arguments
    cli_app.tasks["cliadmin.ship"].apply((5, "Main St")).get()  # "order:{order_id}"
    cli_app.tasks["cliadmin.report"].apply(("2024-05-01",), task_id="tid-1").get()  # task id
    args_key = "cliadmin.charge:args:" + fingerprint_payload({"order_id": 7, "amount": 70})

    def key_of(*args: str) -> str:
        doc = as_json(ok(run_cli("inspect", "--json", *args)))
        assert doc["state"] == "completed", doc
        return str(doc["key"])

    assert key_of("--task", "cliadmin.charge", "--args", "[7, 70]") == args_key
    assert key_of("--task", "cliadmin.charge", "--args", "[7]", "--kwargs", '{"amount": 70}') == (
        args_key
    )
    assert key_of("--raw", args_key) == args_key
    assert key_of("--raw", record_key(key_prefix, args_key)) == args_key  # a Redis name
    assert key_of("--task", "cliadmin.ship", "order:5") == "cliadmin.ship:key:order:5"
    assert key_of("--task", "cliadmin.ship", "--args", '[5, "elsewhere"]') == (
        "cliadmin.ship:key:order:5"
    )
    assert key_of("--task", "cliadmin.report", "--task-id", "tid-1") == "cliadmin.report:id:tid-1"


def test_inspect_in_progress_shows_the_live_holder(
    run_cli: Callable[..., Result],
    hold: Callable[[], Holder],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    holder = hold()
    args = ("inspect", "--task", "cliadmin.hold", "--args", json.dumps([holder.gate]))
    out = ok(run_cli(*args)).stdout
    assert re.search(r"^state\s+in progress \(locked\)$", out, re.M)

    time.sleep(1.0)  # past the first renewal (lock_ttl 2 s): the lease is kept alive
    doc = as_json(ok(run_cli(*args, "--json")))
    lock = doc["lock"]
    assert doc["state"] == "in_progress"
    assert doc["record"] is None
    assert lock["held"] is True
    assert HOLDER_RE.match(lock["holder"]), lock["holder"]
    assert 0 < lock["ttl"] <= 2.0
    fence = parse_lock_value(redis_client.get(lock["name"]).decode())[0]
    assert doc["fence"]["last"] == fence
    assert not redis_client.exists(doc["fence"]["name"])  # layout v2: no fence key

    assert holder.release().get() == f"released {holder.gate}"
    done = as_json(ok(run_cli(*args, "--json")))
    assert done["state"] == "completed"
    assert done["record"]["fencing_token"] == fence  # committed under the lease shown
    assert done["lock"]["held"] is False


def test_inspect_absent(run_cli: Callable[..., Result], key_prefix: str) -> None:
    out = ok(run_cli("inspect", "never-seen", "--task", "cliadmin.charge")).stdout
    assert re.search(r"^state\s+absent$", out, re.M)
    doc = as_json(ok(run_cli("inspect", "never-seen", "--task", "cliadmin.charge", "--json")))
    assert doc["state"] == "absent"
    assert doc["record"] is None
    assert doc["lock"]["held"] is False
    assert doc["fence"]["last"] is None


def test_show_result_decodes_with_the_apps_accept_list(
    cli_app: Celery, run_cli: Callable[..., Result]
) -> None:
    charge(cli_app)
    args = ("inspect", "payment-42", "--task", "cliadmin.charge", "--show-result")
    assert '"charged": 999' in ok(run_cli(*args)).stdout
    doc = as_json(ok(run_cli(*args, "--json")))
    assert doc["result"] == {"order": 42, "charged": 999}
    assert doc["result_error"] is None


def test_a_pickled_record_is_described_never_unpickled(
    run_cli: Callable[..., Result], redis_client: redis.Redis, key_prefix: str
) -> None:
    """Whoever can write to the Redis may plant a pickle: inspect reads only its metadata, and
    --show-result refuses it because the app accepts JSON only."""
    planter = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client, serializer="pickle", accept=["pickle"]),
        lock_provider=RedisLockProvider(redis_client, key_prefix=key_prefix),
        key_prefix=key_prefix,
    )
    planter.execute("cliadmin.charge:key:planted", Tripwire)
    args = ("inspect", "planted", "--task", "cliadmin.charge")

    doc = as_json(ok(run_cli(*args, "--json")))
    assert doc["record"]["content_type"] == "application/x-python-serialize"
    assert doc["record"]["size"] > 0

    refused = run_cli(*args, "--show-result", "--json")
    assert refused.exit_code == 1
    doc = as_json(refused)
    assert doc["result"] is None
    assert "application/x-python-serialize" in doc["result_error"]
    human = run_cli(*args, "--show-result")
    assert human.exit_code == 1
    assert "result not shown" in human.stderr
    assert TRIPPED == []


# --------------------------------------------------------------------------- forget one


def test_forget_one_key_dry_run_confirmation_and_yes(
    cli_app: Celery, run_cli: Callable[..., Result], redis_client: redis.Redis, key_prefix: str
) -> None:
    charge(cli_app)
    key = "cliadmin.charge:key:payment-42"
    rname = record_key(key_prefix, key)
    first_fence = fence_of(redis_client, rname)
    args = ("forget", "payment-42", "--task", "cliadmin.charge")

    dry = ok(run_cli(*args, "--dry-run"))
    assert rname in dry.stdout
    assert as_json(ok(run_cli(*args, "--dry-run", "--json")))["would_delete"] == [rname]
    assert redis_client.exists(rname)

    declined = run_cli(*args, input="n\n")
    assert declined.exit_code == 1
    assert "Its next delivery runs the body again" in declined.stderr
    assert redis_client.exists(rname)

    ok(run_cli(*args, input="y\n"))
    assert not redis_client.exists(rname)

    charge(cli_app)  # the body runs again, under a newer fencing token
    assert fence_of(redis_client, rname) > first_fence
    doc = as_json(ok(run_cli(*args, "--yes", "--json")))
    assert doc["deleted"] == [rname]
    assert not redis_client.exists(rname)

    doc = as_json(ok(run_cli(*args, "--yes", "--json")))
    assert doc["state"] == "absent"
    assert doc["deleted"] == []


def test_forget_refuses_a_held_lock_without_force(
    run_cli: Callable[..., Result], hold: Callable[[], Holder], redis_client: redis.Redis
) -> None:
    holder = hold()
    args = ("forget", "--task", "cliadmin.hold", "--args", json.dumps([holder.gate]), "--yes")
    refused = run_cli(*args)
    assert refused.exit_code == 1
    assert "running the body now" in refused.stderr
    assert "--force" in refused.stderr
    doc = as_json(run_cli(*args, "--json"))
    assert doc["refused"]
    assert doc["deleted"] == []
    lock_name = as_json(ok(run_cli("inspect", *args[1:5], "--json")))["lock"]["name"]
    assert redis_client.exists(lock_name)

    assert holder.release().get() == f"released {holder.gate}"  # untouched: it commits


def test_forget_force_deletes_the_held_lock_and_the_holder_loses_its_lease(
    run_cli: Callable[..., Result], hold: Callable[[], Holder], redis_client: redis.Redis
) -> None:
    holder = hold()
    selector = ("--task", "cliadmin.hold", "--args", json.dumps([holder.gate]))
    lock_name = as_json(ok(run_cli("inspect", *selector, "--json")))["lock"]["name"]

    doc = as_json(ok(run_cli("forget", *selector, "--force", "--yes", "--json")))
    assert doc["deleted"] == [lock_name]

    result = holder.release()
    assert result.failed()
    assert isinstance(result.result, LockLostError)  # its result was not stored
    assert as_json(ok(run_cli("inspect", *selector, "--json")))["state"] == "absent"


# --------------------------------------------------------------------------- forget a task


def test_forget_every_key_of_a_task_in_batches(
    cli_app: Celery,
    run_cli: Callable[..., Result],
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    keys = fill(cli_app, guard, 3000)
    charge(cli_app, key="payment-42")
    cli_app.tasks["cliadmin.ship"].apply((5, "Main St")).get()  # another task: kept
    busy = RedisLockProvider(redis_client, owner_id="crashed-worker").acquire(
        lock_resource(key_prefix, "cliadmin.charge:key:busy"), 60
    )
    assert busy is not None
    before = commandstats(redis_client)

    dry = as_json(ok(run_cli("forget", "--task", "cliadmin.charge", "--dry-run", "--json")))
    assert (dry["records"], dry["held_locks"]) == (3001, 1)
    assert len(dry["sample"]) == 10
    assert redis_client.exists(record_key(key_prefix, keys[0]))

    declined = run_cli("forget", "--task", "cliadmin.charge", "--batch-size", "500", input="n\n")
    assert declined.exit_code == 1
    assert "Forget 3001 record(s) and 1 held lock(s) of task cliadmin.charge" in declined.stderr
    assert "1 held lock(s) (bodies running now) are kept" in declined.stderr
    assert "counting: 3000 key(s)" in declined.stderr  # progress of the counting pass
    assert redis_client.exists(record_key(key_prefix, keys[-1]))

    done = ok(run_cli("forget", "--task", "cliadmin.charge", "--batch-size", "500", input="y\n"))
    progress = re.findall(r"^deleting: batch (\d+), (\d+) key\(s\) deleted", done.stderr, re.M)
    assert [int(b) for b, _ in progress] == [1, 2, 3, 4, 5, 6]
    assert [int(n) for _, n in progress] == [500, 1000, 1500, 2000, 2500, 3000]
    assert "deleted 3001 record(s) and 0 lock(s) of task cliadmin.charge" in done.stdout

    left = names(redis_client, key_prefix)
    charge_records = f"{key_prefix}{{cliadmin.charge:"
    assert not [n for n in left if n.startswith(charge_records)]
    assert lock_resource(key_prefix, "cliadmin.charge:key:busy") in left  # held: kept
    assert record_key(key_prefix, "cliadmin.ship:key:order:5") in left  # other task: kept
    after = commandstats(redis_client)
    assert after.get("keys", 0) == before.get("keys", 0)  # SCAN only, never KEYS
    assert after["scan"] - before.get("scan", 0) >= 3


def test_forget_a_task_with_yes_and_force(
    cli_app: Celery,
    run_cli: Callable[..., Result],
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    fill(cli_app, guard, 5)
    busy = lock_resource(key_prefix, "cliadmin.charge:key:busy")
    assert RedisLockProvider(redis_client).acquire(busy, 60) is not None

    doc = as_json(ok(run_cli("forget", "--task", "cliadmin.charge", "--yes", "--json")))
    assert doc["deleted"] == {"records": 5, "locks": 0}
    assert redis_client.exists(busy)
    doc = as_json(ok(run_cli("forget", "--task", "cliadmin.charge", "--yes", "--force", "--json")))
    assert doc["deleted"] == {"records": 0, "locks": 1}
    assert not redis_client.exists(busy)
    nothing = ok(run_cli("forget", "--task", "cliadmin.charge"))
    assert "nothing to forget" in nothing.stdout


def test_task_names_and_prefixes_are_glob_escaped(
    run_cli: Callable[..., Result], redis_client: redis.Redis, key_prefix: str
) -> None:
    prefix = f"{key_prefix}[a]*?:"  # under key_prefix: cleaned up with it
    guard = DistributedIdempotencyGuard(
        store=RedisIdempotencyStore(redis_client),
        lock_provider=RedisLockProvider(redis_client, key_prefix=prefix),
        key_prefix=prefix,
    )
    for key in ("tasks.a*:key:1", "tasks.ab:key:1", "tasks.a?:key:1", "tasks.a:key:1"):
        guard.execute(key, lambda: 1)

    doc = as_json(
        ok(
            run_cli(
                "forget", "--task", "tasks.a*", "--any-task", "--prefix", prefix, "--yes", "--json"
            )
        )
    )
    assert doc["deleted"] == {"records": 1, "locks": 0}
    stats = as_json(ok(run_cli("stats", "--prefix", prefix, "--json")))
    assert set(stats["tasks"]) == {"tasks.ab", "tasks.a?", "tasks.a"}
    assert as_json(ok(run_cli("stats", "--prefix", key_prefix, "--json")))["tasks"] == {}


def test_shortened_keys(
    run_cli: Callable[..., Result],
    guard: DistributedIdempotencyGuard,
) -> None:
    """Keys over 200 characters (or with braces) are stored under ``head…#sha256``, the head
    being the key's first 64 characters."""
    long_key = "x" * 300
    guard.execute(f"cliadmin.charge:key:{long_key}", lambda: 1)
    guard.execute("cliadmin.charge:key:{braced}", lambda: 2)
    mid_task = "cliadmin." + "m" * 51  # 60 characters: the head ends inside ":key:"
    guard.execute(f"{mid_task}:key:{long_key}", lambda: 3)
    long_task = "cliadmin." + "t" * 60  # 69 characters: the head ends inside the name
    guard.execute(f"{long_task}:key:{long_key}", lambda: 4)
    guard.execute(f"{long_task}:key:short", lambda: 5)
    guard.execute("no-task-namespace", lambda: 6)  # a guard used directly

    for key in (long_key, "{braced}"):
        doc = as_json(ok(run_cli("inspect", key, "--task", "cliadmin.charge", "--json")))
        assert doc["state"] == "completed"
        assert "…#" in doc["record"]["name"]

    stats = as_json(ok(run_cli("stats", "--json")))["tasks"]
    assert stats == {
        "cliadmin.charge": {"completed": 2, "in_progress": 0, "queued": 0},
        long_task: {"completed": 1, "in_progress": 0, "queued": 0},
        # long_task's long key, and mid_task's: its head ends inside ":key:", so it could be
        # another task's whose name starts with mid_task + ":" (issue 22): never attributed.
        "(shortened)": {"completed": 2, "in_progress": 0, "queued": 0},
        "(no task)": {"completed": 1, "in_progress": 0, "queued": 0},
    }
    only = as_json(ok(run_cli("stats", "--task", mid_task, "--any-task", "--json")))["tasks"]
    assert only == {}

    left = ok(run_cli("forget", "--task", mid_task, "--any-task", "-y"))
    assert "cannot be attributed" in left.stderr
    doc = as_json(ok(run_cli("inspect", long_key, "--task", mid_task, "--any-task", "--json")))
    assert doc["state"] == "completed"  # left alone
    done = ok(run_cli("forget", "--task", long_task, "--any-task", "--yes"))
    assert "deleted 1 record(s)" in done.stdout
    assert "cannot be attributed" in done.stderr
    doc = as_json(ok(run_cli("inspect", long_key, "--task", long_task, "--any-task", "--json")))
    assert doc["state"] == "completed"  # the unattributable one was left alone
    assert "deleted 2 record(s)" in ok(run_cli("forget", "--task", "cliadmin.charge", "-y")).stdout


def test_forget_task_leaves_a_longer_namespace_alone(
    run_cli: Callable[..., Result],
    guard: DistributedIdempotencyGuard,
) -> None:
    """Issue 22: task B's namespace is A's plus ``":v2"``; with A's namespace 58 characters
    or longer, B's shortened names (long keys, braces) begin with A's name and ``:``.
    ``forget --task A`` deletes only names whose head holds ``A:<kind>:`` whole."""
    a = "cliadmin." + "a" * 49  # 58 characters
    b = a + ":v2"
    guard.execute(f"{b}:key:" + "x" * 300, lambda: "b-long")
    guard.execute(f"{b}:key:{{braced}}", lambda: "b-braced")
    guard.execute(f"{a}:key:short", lambda: "a-short")

    done = ok(run_cli("forget", "--task", a, "--any-task", "--yes"))
    assert "deleted 1 record(s)" in done.stdout  # A's own
    assert "cannot be attributed" in done.stderr
    for key in ("x" * 300, "{braced}"):
        doc = as_json(ok(run_cli("inspect", key, "--task", b, "--any-task", "--json")))
        assert doc["state"] == "completed", key  # B's records are still there
    stats = as_json(ok(run_cli("stats", "--task", a, "--any-task", "--json")))["tasks"]
    assert stats == {}


# --------------------------------------------------------------------------- stats


def test_stats_by_state_and_task(
    cli_app: Celery,
    run_cli: Callable[..., Result],
    hold: Callable[[], Holder],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    for order in range(3):
        charge(cli_app, order, key=None)
    cli_app.tasks["cliadmin.ship"].apply((5, "Main St")).get()
    holder = hold()
    redis_client.set(f"{key_prefix}not-ours", "1")
    # Two calls published by apply_async and not committed: their record names hold the
    # publish side's queued markers, which are not completed records.
    store = RedisIdempotencyStore(redis_client)
    for order in (7, 8):
        key = cli_app.tasks["cliadmin.charge"].idempotency_key_for((order, 1), {})
        decided = store.check_publish(
            record_key(key_prefix, key), lock_resource(key_prefix, key), f"t-{order}", None, 60
        )
        assert decided.action == "publish"

    doc = as_json(ok(run_cli("stats", "--json")))
    assert doc["tasks"] == {
        "cliadmin.charge": {"completed": 3, "in_progress": 0, "queued": 2},
        "cliadmin.hold": {"completed": 0, "in_progress": 1, "queued": 0},
        "cliadmin.ship": {"completed": 1, "in_progress": 0, "queued": 0},
    }
    assert doc["total"] == {"completed": 4, "in_progress": 1, "queued": 2}
    assert doc["other"] == 1
    assert doc["maxmemory_policy"] == "noeviction"

    lines = ok(run_cli("stats", "--batch-size", "2")).stdout.splitlines()
    assert lines[0].endswith(", maxmemory-policy noeviction")
    assert lines[1].split() == ["TASK", "COMPLETED", "IN", "PROGRESS", "QUEUED"]
    assert lines[2].split() == ["cliadmin.charge", "3", "0", "2"]
    assert lines[-2].split() == ["TOTAL", "4", "1", "2"]
    assert len({len(line) for line in lines[1:-1]}) == 1  # aligned columns

    holder.release()
    only = as_json(ok(run_cli("stats", "--task", "cliadmin.hold", "--json")))
    assert only["tasks"] == {"cliadmin.hold": {"completed": 1, "in_progress": 0, "queued": 0}}


# --------------------------------------------------------------------------- settings, usage


def test_settings_come_from_the_app_and_url_overrides(
    cli_app: Celery, run_cli: Callable[..., Result], redis_url: str, key_prefix: str
) -> None:
    from cliadmin_app import make_app

    charge(cli_app)
    other = make_app("redis://127.0.0.1:1/0", key_prefix)  # nothing listens there
    failed = run_cli("stats", app=other)
    assert failed.exit_code == 1
    assert "Redis failed" in failed.stderr
    doc = as_json(ok(run_cli("stats", "--url", redis_url, "--json", app=other)))
    assert doc["total"]["completed"] == 1

    broker_only = make_app(None, key_prefix, broker_url=redis_url)
    assert as_json(ok(run_cli("stats", "--json", app=broker_only)))["total"]["completed"] == 1

    amqp = make_app(None, key_prefix, broker_url="amqp://guest@localhost//")
    failed = run_cli("stats", app=amqp)
    assert failed.exit_code == 2
    assert "pass --url" in failed.stderr

    memory = make_app("memory://", key_prefix)
    failed = run_cli("stats", app=memory)
    assert failed.exit_code == 2
    assert "memory://" in failed.stderr


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("inspect", "payment-42"), "--task NAME is needed"),
        (("inspect", "--task", "cliadmin.charge"), "name one key"),
        (("inspect", "k", "--task", "cliadmin.charge", "--task-id", "x"), "name one key"),
        (("inspect", "--task", "nope.task", "--args", "[1]"), "defines no IdempotentTask"),
        (("inspect", "--task", "cliadmin.report", "--args", "[1]"), "use --task-id"),
        (("inspect", "--task", "cliadmin.charge", "--args", "{}"), "JSON list"),
        (("forget",), "pass --task NAME"),
        (("stats", "--prefix", "a{b}"), "without braces"),
    ],
)
def test_usage_errors(run_cli: Callable[..., Result], args: tuple[str, ...], message: str) -> None:
    result = run_cli(*args)
    assert result.exit_code == 2, result.stdout
    assert message in result.stderr


def test_name_parsing() -> None:
    assert parse_redis_name("p:{t:key:k}", "p:") == ("record", "t:key:k")
    assert parse_redis_name("p:lock:{t:key:k}", "p:") == ("lock", "t:key:k")
    assert parse_redis_name("p:lock:{t:key:k}:fence", "p:") == ("fence", "t:key:k")
    assert parse_redis_name("p:other", "p:") is None
    assert parse_redis_name("q:{t:key:k}", "p:") is None
    assert task_of_slot("a.b:key:x:args:y") == "a.b"
    assert task_of_slot("a.b:id:1") == "a.b"
    assert task_of_slot("no-marker") is None


# --------------------------------------------------------------------------- real `celery`


def test_celery_subprocess_inspect_forget_stats(
    cli_app: Celery,
    celery_cli: Callable[..., subprocess.CompletedProcess[str]],
    hold: Callable[[], Holder],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    """``celery -A cliadmin_app idempotency ...`` finds the entry point and the app's settings."""
    charge(cli_app)
    holder = hold()
    held = ("--task", "cliadmin.hold", "--args", json.dumps([holder.gate]))

    proc = celery_cli("inspect", "payment-42", "--task", "cliadmin.charge")
    assert proc.returncode == 0, proc.stderr
    assert re.search(r"^state\s+completed$", proc.stdout, re.M)
    doc = json.loads(celery_cli("inspect", *held, "--json").stdout)
    assert doc["state"] == "in_progress"
    assert HOLDER_RE.match(doc["lock"]["holder"])  # this test process holds it
    doc = json.loads(celery_cli("inspect", "gone", "--task", "cliadmin.charge", "--json").stdout)
    assert doc["state"] == "absent"

    stats = json.loads(celery_cli("stats", "--json").stdout)
    assert stats["total"] == {"completed": 1, "in_progress": 1, "queued": 0}

    refused = celery_cli("forget", *held, "--yes")
    assert refused.returncode == 1
    assert "running the body now" in refused.stderr

    dry = celery_cli("forget", "--task", "cliadmin.charge", "--dry-run")
    assert "would forget 1 record(s)" in dry.stdout
    rname = record_key(key_prefix, "cliadmin.charge:key:payment-42")
    assert redis_client.exists(rname)
    proc = celery_cli("forget", "--task", "cliadmin.charge", input="y\n")
    assert proc.returncode == 0, proc.stderr
    assert "deleted 1 record(s)" in proc.stdout
    assert not redis_client.exists(rname)
    holder.release()


def test_celery_subprocess_large_set(
    cli_app: Celery,
    celery_cli: Callable[..., subprocess.CompletedProcess[str]],
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    fill(cli_app, guard, 3000)
    proc = celery_cli("forget", "--task", "cliadmin.charge", "--yes", "--json")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["deleted"] == {"records": 3000, "locks": 0}
    assert proc.stderr.count("deleting: batch") == 3
    assert not names(redis_client, f"{key_prefix}{{")


# --------------------------------------------------------------------------- idempotency_client


@pytest.mark.cluster
def test_the_client_setting_reaches_a_redis_cluster_for_inspect_stats_and_forget(
    run_cli: Callable[..., Result], redis_cluster: Any, key_prefix: str
) -> None:
    """``idempotency_client`` (here a factory of a ``RedisCluster`` client) is what the command
    talks to: records spread over the cluster's masters are inspected, counted and forgotten
    (SCAN on every master); ``--url`` still overrides it."""
    from cliadmin_app import make_app

    made: list[Any] = []

    def factory() -> Any:
        made.append(redis_cluster.client())
        return made[-1]

    app = make_app(None, key_prefix, idempotency_client=factory)
    try:
        for order in range(40):
            charge(app, order, key=None)
        charge(app)  # the explicit key payment-42
        cluster = made[0]
        per_master = [
            sum(1 for _ in node.redis_connection.scan_iter(match=f"{key_prefix}*"))
            for node in cluster.get_primaries()
        ]
        assert sum(per_master) >= 41
        assert sum(1 for n in per_master if n) >= 2, f"records on one master only: {per_master}"

        doc = as_json(
            ok(run_cli("inspect", "payment-42", "--task", "cliadmin.charge", "--json", app=app))
        )
        assert doc["state"] == "completed"
        assert doc["record"]["fingerprint"] == fingerprint_payload({"order_id": 42, "amount": 999})
        assert "cluster of 3 primaries" in ok(run_cli("stats", app=app)).stdout

        stats = as_json(ok(run_cli("stats", "--json", app=app)))
        assert stats["tasks"] == {
            "cliadmin.charge": {"completed": 41, "in_progress": 0, "queued": 0}
        }

        gone = ok(run_cli("forget", "--task", "cliadmin.charge", "--yes", app=app))
        assert "deleted 41 record(s)" in gone.stdout
        left = [n for n in cluster.scan_iter(match=f"{key_prefix}*") if not n.endswith(b":fence")]
        assert left == []

        # --url wins over the client setting: nothing listens there, so the command fails
        failed = run_cli("stats", "--url", "redis://127.0.0.1:1/0", app=app)
        assert failed.exit_code == 1
        assert "Redis failed" in failed.stderr
    finally:
        for client in made:
            client.close()


def test_a_sentinel_broker_is_followed_to_its_master(
    run_cli: Callable[..., Result], redis_sentinel: Any, key_prefix: str
) -> None:
    """No idempotency setting, a ``sentinel://`` broker: the command finds the records on the
    master the Sentinel names (the same fallback the tasks use)."""
    from cliadmin_app import make_app

    host, port = redis_sentinel.sentinel_hosts[0]
    app = make_app(
        None,
        key_prefix,
        broker_url=f"sentinel://{host}:{port}/2",
        broker_transport_options={"master_name": redis_sentinel.master_name},
    )
    for order in range(3):
        charge(app, order, key=None)
    stats = ok(run_cli("stats", app=app))
    assert f"sentinel master '{redis_sentinel.master_name}' (db 2)" in stats.stdout
    doc = as_json(ok(run_cli("stats", "--json", app=app)))
    assert doc["tasks"] == {"cliadmin.charge": {"completed": 3, "in_progress": 0, "queued": 0}}
    import redis as redis_module

    host, port = redis_sentinel.master_address()
    master = redis_module.Redis(host=host, port=port, db=2)
    try:
        assert len(list(master.scan_iter(match=f"{key_prefix}*"))) >= 3
    finally:
        master.close()


def test_forget_include_fences_for_one_key_and_tokens_still_increase(
    cli_app: Celery, run_cli: Callable[..., Result], redis_client: redis.Redis, key_prefix: str
) -> None:
    """Layout v2 writes a fence key only while the server clock is behind a token; 0.1.0 left
    one per key for 7 days (it names its key). --include-fences deletes a fence the clock has
    passed, keeps one it has not, and the key's next fencing token is higher either way."""
    charge(cli_app)
    key = "cliadmin.charge:key:payment-42"
    rname = record_key(key_prefix, key)
    fence_name = lock_resource(key_prefix, key) + ":fence"
    assert not redis_client.exists(fence_name)
    first_fence = fence_of(redis_client, rname)
    redis_client.set(fence_name, str(first_fence), px=7 * 86_400_000)  # as 0.1.0 left it
    args = ("forget", "payment-42", "--task", "cliadmin.charge", "--include-fences")

    dry = as_json(ok(run_cli(*args, "--dry-run", "--json")))
    assert dry["would_delete"] == [rname, fence_name]
    doc = as_json(ok(run_cli(*args, "--yes", "--json")))
    assert doc["deleted"] == [rname, fence_name]
    assert not redis_client.exists(rname)
    assert not redis_client.exists(fence_name)

    charge(cli_app)  # runs again: its token is above the forgotten one all the same
    second = fence_of(redis_client, rname)
    assert second > first_fence

    sec, usec = redis_client.time()
    ahead = int(sec) * 1_000_000 + int(usec) + 3_600_000_000  # a clock that stepped back 1 h
    redis_client.set(fence_name, str(ahead), px=3_600_000)
    out = ok(run_cli(*args, "--yes"))
    assert "server clock is behind" in out.stderr
    assert int(redis_client.get(fence_name)) == ahead  # kept: it still floors the next token
    charge(cli_app)
    assert fence_of(redis_client, rname) > ahead


def test_forget_a_task_include_fences_keeps_other_tasks_fences(
    cli_app: Celery,
    run_cli: Callable[..., Result],
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    keys = fill(cli_app, guard, 5)
    cli_app.tasks["cliadmin.ship"].apply((5, "Main St")).get()
    other_fence = lock_resource(key_prefix, "cliadmin.ship:key:order:5") + ":fence"
    # The fences 0.1.0 left for these keys (7 days, a token the clock has passed).
    for key in [*keys, "cliadmin.ship:key:order:5"]:
        fence = fence_of(redis_client, record_key(key_prefix, key))
        redis_client.set(lock_resource(key_prefix, key) + ":fence", str(fence), px=604_800_000)
    fences = [n for n in names(redis_client, key_prefix) if n.endswith(":fence")]
    charge_fences = [n for n in fences if "{cliadmin.charge:" in n]
    assert len(charge_fences) == 5
    assert other_fence in fences

    dry = as_json(ok(run_cli("forget", "--task", "cliadmin.charge", "--dry-run", "--json")))
    assert "fences" not in dry  # only counted when asked for
    dry = as_json(
        ok(
            run_cli(
                "forget", "--task", "cliadmin.charge", "--include-fences", "--dry-run", "--json"
            )
        )
    )
    assert (dry["records"], dry["fences"]) == (5, 5)

    out = ok(run_cli("forget", "--task", "cliadmin.charge", "--include-fences", "--yes"))
    assert "deleted 5 record(s), 5 fence(s) and 0 lock(s) of task cliadmin.charge" in out.stdout
    left = names(redis_client, key_prefix)
    assert not [n for n in left if "{cliadmin.charge:" in n]
    assert other_fence in left
    assert record_key(key_prefix, "cliadmin.ship:key:order:5") in left
