"""celery_idempotent.testing, the pytest plugin for users' own tests.

The sample project (``sample_project/``) is a user's project: its tests use only the plugin's
public fixtures and helpers, eagerly, through Celery's in-process test worker and through real
``celery worker`` processes. It runs here in a pytest process of its own, as its user would run
it, with the plugin loaded through its ``pytest11`` entry point.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

from celery_idempotent import IdempotentTask
from celery_idempotent.testing import IdempotencyTester

HERE = Path(__file__).resolve().parent
SAMPLE = HERE / "sample_project"


def _pytest(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.mark.worker
def test_the_sample_project_passes_with_only_the_plugins_public_api() -> None:
    run = _pytest(SAMPLE, "-q", "-p", "no:randomly", "-rA")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\b14 passed\b", summary), summary
    assert not re.search(r"skipped|xfail|error|failed|warning", summary), summary
    # Each way of running it took part: eagerly, an in-process worker, worker processes.
    for name in (
        "test_eager.py::test_a_redelivered_charge_runs_once",
        "test_eager.py::test_a_redelivery_while_the_charge_runs_waits_for_it",
        "test_eager.py::test_on_both_backends[redis]",
        "test_worker.py::test_with_celerys_own_fixtures",
        "test_worker.py::test_the_shop_through_a_worker",
        "test_processes.py::test_duplicates_run_once_on_real_workers",
    ):
        assert f"PASSED tests/{name}" in out, name


def test_the_plugin_is_off_unless_used(tmp_path: Path) -> None:
    """Installed, the plugin is loaded in every pytest run; a test that asks for none of its
    fixtures gets none of them, and neither Celery nor Redis is imported for it."""
    (tmp_path / "test_user.py").write_text(
        textwrap.dedent(
            """
            import sys

            def test_nothing_was_imported_for_it(request):
                assert "celery_idempotent.testing" in sys.modules  # loaded by its entry point
                assert not [n for n in request.fixturenames if "idempotency" in n]
            """
        )
    )
    run = _pytest(tmp_path, "-q", "-p", "no:cacheprovider", "--fixtures-per-test")
    out = run.stdout + run.stderr
    assert run.returncode == 0, out
    assert "idempotency" not in out.split("test_user.py")[-1].split("passed")[0], out
    listed = _pytest(tmp_path, "-q", "-p", "no:cacheprovider", "--fixtures")
    assert "fixtures defined from celery_idempotent.testing" in listed.stdout, listed.stdout
    # What loading it costs a user who does not use it: no Celery, no Redis client.
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, celery_idempotent.testing; print(sorted("
            "{'celery', 'redis', 'kombu', 'celery_idempotent.celery.task'} & set(sys.modules)))",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert probe.stdout.strip() == "[]", probe.stdout


def test_a_body_that_runs_twice_fails_the_helpers(celery_app: Any, idempotency: Any) -> None:
    @celery_app.task(base=IdempotentTask, idempotency_enabled=False)
    def unguarded(x: int) -> int:
        return x

    @celery_app.task(base=IdempotentTask, idempotency_key="task_id")
    def per_message(x: int) -> int:
        return x

    with pytest.raises(AssertionError, match=r"unguarded ran 2 times .*idempotency_enabled"):
        idempotency.deliver_twice(unguarded, (1,))
    with pytest.raises(AssertionError, match="per_message ran 2 times"):
        idempotency.deliver_twice(per_message, (1,))
    assert idempotency.redeliver(per_message, (1,)).executions == 1

    @celery_app.task
    def plain() -> int:
        return 1

    with pytest.raises(TypeError, match="plain is not an IdempotentTask"):
        idempotency.deliver(plain)


def test_everything_switched_is_put_back(celery_app: Any) -> None:
    celery_app.conf.idempotency_url = "redis://127.0.0.1:1/0"  # nothing listens there

    @celery_app.task(base=IdempotentTask, idempotency_wait_replicas=1)
    def charge_fn(order_id: int) -> int:
        return order_id

    charge = celery_app.tasks[charge_fn.name]  # the task, not its lazy proxy

    tester = IdempotencyTester("memory://")
    tester.use(celery_app)
    assert tester.deliver_twice(charge, (7,)).record is not None
    assert tester.stored(charge, (7,)).result == 7  # type: ignore[union-attr]
    assert type(charge).idempotency_url == "memory://"
    tester.close()

    assert celery_app.conf.idempotency_url == "redis://127.0.0.1:1/0"
    assert "idempotency_client" not in celery_app.conf
    assert type(charge).__dict__["idempotency_wait_replicas"] == 1
    assert "idempotency_url" not in type(charge).__dict__
    assert "run" not in charge.__dict__
    settings = charge.idempotency_settings()
    assert (settings.idempotency_url, settings.idempotency_wait_replicas) == (
        "redis://127.0.0.1:1/0",
        1,
    )


def test_a_delivery_no_worker_takes_times_out_with_the_reason(
    celery_app: Any, idempotency: Any
) -> None:
    @celery_app.task(base=IdempotentTask)
    def lonely() -> None:
        return None

    idempotency.through_worker = True
    with pytest.raises(TimeoutError, match="does the test use celery_worker"):
        idempotency.deliver(lonely, timeout=0.3)


@pytest.mark.parametrize("idempotency_backend", ["sqlite"])
def test_an_unknown_backend_is_named(
    request: pytest.FixtureRequest, idempotency_backend: str
) -> None:
    with pytest.raises(ValueError, match="idempotency_backend must be one of memory, redis"):
        request.getfixturevalue("idempotency")


def test_a_task_id_key_needs_the_task_id(celery_app: Any, idempotency: Any) -> None:
    @celery_app.task(base=IdempotentTask, idempotency_key="task_id")
    def receipt(order_id: int) -> str:
        return f"r{order_id}"

    with pytest.raises(ValueError, match="is the task id: pass task_id="):
        idempotency.stored(receipt, (1,))
    twice = idempotency.redeliver(receipt, (1,))
    stored = idempotency.stored(receipt, (1,), task_id=twice.task_ids[0])
    assert stored is not None
    assert stored.result == "r1"


def test_a_duplicate_that_arrives_while_the_body_runs(celery_app: Any, idempotency: Any) -> None:
    from celery_idempotent import LockAcquisitionError

    @celery_app.task(base=IdempotentTask, idempotency_retry_base_delay=0.01)
    def slow(x: int) -> int:
        return x * 2

    @celery_app.task(base=IdempotentTask, idempotency_on_locked="raise", idempotency_retry_count=0)
    def impatient(x: int) -> int:
        return x

    @celery_app.task(base=IdempotentTask, idempotency_enabled=False)
    def unguarded(x: int) -> int:
        return x

    twice = idempotency.redeliver(slow, (21,), while_running=True)
    assert twice.results == (42, 42)
    assert twice.executions == 1
    assert idempotency.deliver_twice(slow, (5,), while_running=True).executions == 1

    with pytest.raises(LockAcquisitionError):  # the policy says: refuse, do not wait
        idempotency.redeliver(impatient, (1,), while_running=True)
    assert not idempotency.is_locked(impatient, (1,))
    with pytest.raises(AssertionError, match="never found the key held"):
        idempotency.deliver_twice(unguarded, (1,), while_running=True)
    idempotency.through_worker = True
    with pytest.raises(ValueError, match="applies the deliveries eagerly"):
        idempotency.redeliver(slow, (1,), while_running=True)
