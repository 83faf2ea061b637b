"""The settings are resolved once per guarded call (issue 28), and read again when they change.

``IdempotentTask.__call__`` resolves them once and hands the resolved settings down to the key,
the fingerprint, the guard and the delivery; ``apply_async`` does the same on the publish side.
Counted on the one name the call path resolves through (``celery_idempotent.celery.task``'s
``resolve``), with a real worker consuming the message in this process (Celery's own testing
worker, solo pool) over the test Redis, and with ``apply()``.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery
from celery.contrib.testing.worker import start_worker

from celery_idempotent import IdempotentTask, settings
from celery_idempotent.celery import task as task_module
from celery_idempotent.celery.checks import at_first_publish

pytestmark = pytest.mark.redis


class Counter:
    """Wraps ``resolve``: counts its calls."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.calls = 0
        self.lock = threading.Lock()

    def __call__(self, app: Any, task: Any) -> Any:
        with self.lock:
            self.calls += 1
        return self.real(app, task)

    def take(self) -> int:
        with self.lock:
            calls, self.calls = self.calls, 0
            return calls


@pytest.fixture
def resolves(monkeypatch: pytest.MonkeyPatch) -> Counter:
    counter = Counter(task_module.resolve)
    monkeypatch.setattr(task_module, "resolve", counter)
    return counter


@pytest.fixture
def app(make_app: Callable[..., Celery]) -> Celery:
    return make_app(task_acks_late=True, task_reject_on_worker_lost=True)


def _tasks(app: Celery, tag: str) -> dict[str, Any]:
    runs: dict[str, int] = {}

    @app.task(base=IdempotentTask, name=f"once.args.{tag}", shared=False)
    def by_args(n: int, note: str = "") -> int:
        runs["args"] = runs.get("args", 0) + 1
        return n * 2

    @app.task(
        base=IdempotentTask,
        name=f"once.format.{tag}",
        shared=False,
        idempotency_key="order:{n}",
        idempotency_fingerprint=("n", "note"),
    )
    def by_format(n: int, note: str = "") -> int:
        runs["format"] = runs.get("format", 0) + 1
        return n * 3

    return {"args": by_args, "format": by_format, "runs": runs}


@pytest.mark.parametrize("kind", ["args", "format"])
def test_one_resolve_per_delivery_and_per_publish_with_a_real_worker(
    app: Celery, resolves: Counter, kind: str
) -> None:
    tag = uuid.uuid4().hex[:10]
    tasks = _tasks(app, tag)
    task = tasks[kind]
    # Warm: the app's first publish checks every task of it once (resolving each).
    at_first_publish(app)
    with start_worker(app, pool="solo", perform_ping_check=False, shutdown_timeout=10):
        resolves.take()
        first = task.apply_async((7,), {"note": "x"})
        published = resolves.take()
        assert first.get(timeout=20) == (14 if kind == "args" else 21)
        delivered = resolves.take()
        # A duplicate publish is stopped at publish: one resolve, no delivery.
        again = task.apply_async((7,), {"note": "x"})
        assert again.get(timeout=20) == first.get()
        duplicate = resolves.take()
    assert tasks["runs"][kind] == 1
    assert (published, delivered, duplicate) == (1, 1, 1)


def test_one_resolve_per_eager_call_first_run_and_replay(app: Celery, resolves: Counter) -> None:
    tasks = _tasks(app, uuid.uuid4().hex[:10])
    task = tasks["format"]
    task.idempotency_settings()
    resolves.take()
    assert task.apply((5,), {"note": "y"}).get() == 15
    assert resolves.take() == 1
    assert task.apply((5,), {"note": "y"}).get() == 15
    assert resolves.take() == 1
    assert tasks["runs"]["format"] == 1


def test_a_settings_change_is_seen_by_the_next_call(app: Celery, resolves: Counter) -> None:
    # Resolved once per call, not once per task: clearing the cache after changing app.conf
    # (what the docs say to do) takes effect at the next call.
    tasks = _tasks(app, uuid.uuid4().hex[:10])
    task = tasks["args"]
    assert task.apply((3,)).get() == 6
    assert task.apply((3,)).get() == 6
    assert tasks["runs"]["args"] == 1
    app.conf.idempotency_enabled = False
    settings.clear_cache(app)
    assert task.apply((3,)).get() == 6
    assert tasks["runs"]["args"] == 2  # disabled: the body ran, no replay
