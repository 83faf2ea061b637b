"""``celery -A proj idempotency forget --all`` and ``admin.forget_all(app)`` (issue 24):
celery-singleton's ``clear_locks(app)``, on real records in a real Redis.

Every key of every idempotent task of the app goes (records and queued markers; held locks
only with ``--force``), each looked up where its own settings put it; keys of tasks the app
does not register stay.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

from celery_idempotent import DistributedIdempotencyGuard, IdempotentTask, RedisLockProvider
from celery_idempotent.admin import forget_all, idempotent_tasks
from celery_idempotent.core.fingerprint import lock_resource, record_key

if TYPE_CHECKING:
    import subprocess

    import redis
    from celery import Celery
    from click.testing import Result

pytestmark = pytest.mark.redis


def ok(result: Result) -> Result:
    assert result.exit_code == 0, (result.exit_code, result.stdout, result.stderr)
    return result


def names(client: redis.Redis, prefix: str) -> set[str]:
    return {n.decode() for n in client.scan_iter(match=f"{prefix}*", count=1000)}


def records_of(client: redis.Redis, prefix: str, task: str) -> set[str]:
    return {n for n in names(client, prefix) if n.startswith(f"{prefix}{{{task}:")}


def fill(app: Celery, guard: DistributedIdempotencyGuard, key_prefix: str) -> Any:
    """Records of three of the app's tasks, a queued marker, a held lock, and a record of a
    task this app does not register (another app's, under the same prefix)."""
    for order in range(3):
        app.tasks["cliadmin.charge"].apply((order, 10)).get()
    app.tasks["cliadmin.ship"].apply((5, "Main St")).get()
    app.tasks["cliadmin.report"].apply(("monday",), task_id="r-1").get()
    # A queued marker, as the publish side leaves it for a call no worker took yet.
    marker = record_key(key_prefix, "cliadmin.charge:key:queued")
    guard.store.client.set(marker, "q|t-queued|", px=60_000)  # type: ignore[attr-defined]
    busy = RedisLockProvider(guard.store.client, owner_id="crashed-worker").acquire(  # type: ignore[attr-defined]
        lock_resource(key_prefix, "cliadmin.ship:key:busy"), 60
    )
    assert busy is not None
    guard.execute("other.task:key:x", lambda: "theirs")
    return busy


def test_idempotent_tasks_lists_the_apps_idempotent_tasks_only(cli_app: Celery) -> None:
    @cli_app.task(shared=False, name="cliadmin.plain")
    def plain() -> None:
        """Not idempotent: has no keys."""

    # Shared tasks (``@app.task`` without ``shared=False``) that other suites defined in this
    # process are registered on every app finalized after them: they are this app's tasks
    # too, so only the app's own names are compared.
    names_found = [
        task.name for task in idempotent_tasks(cli_app) if task.name.startswith("cliadmin.")
    ]
    assert names_found == ["cliadmin.charge", "cliadmin.hold", "cliadmin.report", "cliadmin.ship"]
    assert all(isinstance(task, IdempotentTask) for task in idempotent_tasks(cli_app))


def test_forget_all_dry_run_confirmation_and_force(
    cli_app: Celery,
    run_cli: Callable[..., Result],
    guard: DistributedIdempotencyGuard,
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    fill(cli_app, guard, key_prefix)
    theirs = record_key(key_prefix, "other.task:key:x")
    busy = lock_resource(key_prefix, "cliadmin.ship:key:busy")
    before = names(redis_client, key_prefix)

    dry = json.loads(ok(run_cli("forget", "--all", "--dry-run", "--json")).stdout)
    assert dry["dry_run"] is True
    assert (dry["records"], dry["locks"], dry["kept_locks"]) == (6, 0, 1)
    # Other suites' shared tasks are registered on this app too (see above); they hold no keys.
    by_namespace = {
        n["namespace"]: n for n in dry["namespaces"] if n["namespace"].startswith("cliadmin.")
    }
    assert all(
        n["records"] == n["locks"] == n["kept_locks"] == 0
        for n in dry["namespaces"]
        if not n["namespace"].startswith("cliadmin.")
    ), dry["namespaces"]
    assert set(by_namespace) == {
        "cliadmin.charge",
        "cliadmin.hold",
        "cliadmin.report",
        "cliadmin.ship",
    }
    assert by_namespace["cliadmin.charge"]["records"] == 4  # three records and the marker
    assert by_namespace["cliadmin.ship"]["kept_locks"] == 1
    assert names(redis_client, key_prefix) == before  # a dry run deletes nothing

    declined = run_cli("forget", "--all", input="n\n")
    assert declined.exit_code == 1
    assert "would forget 4 record(s) of cliadmin.charge" in declined.stdout
    # 4 namespaces of this app's own, plus those of shared tasks other suites registered.
    assert re.search(r"Forget 6 record\(s\) of \d+ task namespace\(s\)\?", declined.stderr)
    assert names(redis_client, key_prefix) == before

    done = ok(run_cli("forget", "--all", input="y\n"))
    assert "forgot 4 record(s) of cliadmin.charge" in done.stdout
    assert "1 held lock(s) kept" in done.stdout
    assert "total: 6 record(s), 0 held lock(s), 1 kept" in done.stdout
    for task in ("cliadmin.charge", "cliadmin.ship", "cliadmin.report"):
        assert not records_of(redis_client, key_prefix, task)
    assert theirs in names(redis_client, key_prefix)  # another app's task: kept
    assert busy in names(redis_client, key_prefix)  # held: kept without --force

    forced = json.loads(ok(run_cli("forget", "--all", "--yes", "--force", "--json")).stdout)
    assert (forced["records"], forced["locks"]) == (0, 1)
    assert busy not in names(redis_client, key_prefix)
    assert theirs in names(redis_client, key_prefix)
    # The next delivery runs the body again.
    assert cli_app.tasks["cliadmin.ship"].apply((5, "Main St")).get() == "shipped 5 to Main St"
    assert records_of(redis_client, key_prefix, "cliadmin.ship")


def test_forget_all_refuses_a_key_or_a_task_with_it(run_cli: Callable[..., Result]) -> None:
    for extra in (("payment-42",), ("--task", "cliadmin.charge")):
        result = run_cli("forget", "--all", *extra, "--yes")
        assert result.exit_code == 2
        assert "--all names every key already" in result.output


def test_forget_all_python_api_follows_each_tasks_own_settings(
    cli_app: Celery, redis_client: redis.Redis, redis_url: str, key_prefix: str
) -> None:
    own_prefix = f"{key_prefix}own:"

    @cli_app.task(
        base=IdempotentTask,
        shared=False,
        name="cliadmin.elsewhere",
        idempotency_key_prefix=own_prefix,
        idempotency_namespace="billing",
    )
    def elsewhere(x: int) -> int:
        return x

    @cli_app.task(
        base=IdempotentTask, shared=False, name="cliadmin.billing2", idempotency_namespace="billing"
    )
    def billing2(x: int) -> int:
        return x

    @cli_app.task(
        base=IdempotentTask, shared=False, name="cliadmin.local", idempotency_url="memory://"
    )
    def local(x: int) -> int:
        return x

    elsewhere.apply((1,)).get()
    elsewhere.apply((2,)).get()
    billing2.apply((1,)).get()
    cli_app.tasks["cliadmin.charge"].apply((1, 1)).get()
    assert len([n for n in names(redis_client, own_prefix) if "{billing:" in n]) == 2

    dry = forget_all(cli_app, dry_run=True)
    by_task = {each.tasks: each for each in dry.namespaces}
    assert by_task[("cliadmin.elsewhere",)].prefix == own_prefix
    assert by_task[("cliadmin.elsewhere",)].records == 2
    assert by_task[("cliadmin.billing2",)].records == 1  # "billing" under the app's prefix
    assert by_task[("cliadmin.local",)].skipped is not None
    assert "memory://" in (by_task[("cliadmin.local",)].skipped or "")
    assert dry.records == 4
    assert names(redis_client, own_prefix)

    done = forget_all(cli_app)
    assert not done.dry_run
    assert done.records == 4
    assert not [n for n in names(redis_client, own_prefix) if "{billing:" in n]
    assert not records_of(redis_client, key_prefix, "cliadmin.charge")
    assert not records_of(redis_client, key_prefix, "billing")
    # --url / --prefix override every task's: only that prefix is walked.
    cli_app.tasks["cliadmin.charge"].apply((2, 2)).get()
    elsewhere.apply((3,)).get()
    only = forget_all(cli_app, prefix=own_prefix, url=redis_url)
    assert {each.prefix for each in only.namespaces} == {own_prefix}
    assert only.records == 1
    assert records_of(redis_client, key_prefix, "cliadmin.charge")


def test_forget_all_from_the_celery_program(
    cli_app: Celery,
    celery_cli: Callable[..., subprocess.CompletedProcess[str]],
    redis_client: redis.Redis,
    key_prefix: str,
) -> None:
    cli_app.tasks["cliadmin.charge"].apply((7, 7)).get()
    cli_app.tasks["cliadmin.report"].apply(("friday",), task_id="r-2").get()
    run = celery_cli("forget", "--all", "--yes")
    assert run.returncode == 0, run.stderr
    assert "total: 2 record(s), 0 held lock(s)" in run.stdout
    assert not records_of(redis_client, key_prefix, "cliadmin.charge")
    assert not records_of(redis_client, key_prefix, "cliadmin.report")
