"""Fixtures for the IdempotentTask suite: the shared app module, real workers, clean config.

The worker subprocesses and this process load the same app, ``apps/cidem_app.py``, configured
from environment variables (see its doc). Everything one test session puts in Redis (broker
queues through kombu's ``global_keyprefix``, result-backend keys, idempotency records and
locks, side-effect counters) starts with one session prefix, and the default queue has a
unique name, so that suites sharing the Redis of ``REDIS_URL`` never see each other's
messages. The session's keys are deleted at its end.
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from celery import Celery

from celery_idempotent import settings
from celery_idempotent.celery.task import reset_backends
from tests.support.keys import delete_keys_with_prefix
from tests.support.workers import WorkerGroup, start_workers

APPS_DIR = Path(__file__).resolve().parent / "apps"
if str(APPS_DIR) not in sys.path:
    sys.path.insert(0, str(APPS_DIR))

APP_MODULE = "cidem_app"


@pytest.fixture(scope="session")
def cidem_env(redis_url: str) -> Iterator[dict[str, str]]:
    """The environment that configures ``cidem_app`` for this session (broker = backend =
    idempotency store = the test Redis, under a session prefix, on a unique queue)."""
    session = uuid.uuid4().hex[:10]
    prefix = f"test:cidem-{session}:"
    env = {
        "CIDEM_BROKER_URL": redis_url,
        "CIDEM_BACKEND_URL": redis_url,
        "CIDEM_PREFIX": prefix,
        "CIDEM_QUEUE": f"cidem-{session}",
    }
    yield env
    import redis

    client = redis.Redis.from_url(redis_url)
    try:
        delete_keys_with_prefix(client, prefix)
    finally:
        client.close()


@pytest.fixture(scope="session")
def cidem(cidem_env: dict[str, str]) -> Iterator[ModuleType]:
    """The app module, its app configured as the workers' is (for publishing and results)."""
    import cidem_app

    cidem_app.configure(cidem_app.app, cidem_env)
    settings.clear_cache(cidem_app.app)
    yield cidem_app
    cidem_app.app.close()


@pytest.fixture(scope="session")
def worker_factory(
    cidem_env: dict[str, str],
) -> Iterator[Callable[..., WorkerGroup]]:
    """``worker_factory(n=1, pool="prefork", concurrency=2, env={...}, **options)`` starts
    ``n`` workers on the session's queue; every one is stopped at the end of the session at
    the latest (stop them yourself to free the machine sooner)."""
    groups: list[WorkerGroup] = []

    def factory(n: int = 1, *, env: dict[str, str] | None = None, **options: Any) -> WorkerGroup:
        options.setdefault("pool", "prefork")
        options.setdefault("concurrency", 2)
        options.setdefault("queues", [cidem_env["CIDEM_QUEUE"]])
        group = start_workers(
            n,
            APP_MODULE,
            env={**cidem_env, **(env or {})},
            pythonpath=[APPS_DIR],
            **options,
        )
        groups.append(group)
        return group

    yield factory
    for group in groups:
        group.stop()
        for worker in group:
            worker.remove_log()


@pytest.fixture(scope="module")
def workers(worker_factory: Callable[..., WorkerGroup]) -> Iterator[WorkerGroup]:
    """Two prefork workers with three children each, shared by the tests of a module."""
    group = worker_factory(2, pool="prefork", concurrency=3)
    yield group
    group.stop()


@pytest.fixture
def tag() -> str:
    """A unique first argument, so that every test has its own keys and counters."""
    return uuid.uuid4().hex[:12]


@pytest.fixture
def fresh_config() -> Iterator[None]:
    """Forget cached settings and backends before and after a test that changes config."""
    settings.clear_cache()
    reset_backends()
    yield
    settings.clear_cache()
    reset_backends()


@pytest.fixture
def make_app(
    redis_url: str, key_prefix: str, fresh_config: None
) -> Iterator[Callable[..., Celery]]:
    """A factory of fresh in-process apps on the test Redis (records under ``key_prefix``):
    memory broker, in-memory results, ``task_eager_propagates`` off; keywords add settings."""
    apps: list[Celery] = []

    def factory(**conf: Any) -> Celery:
        app = Celery(f"inproc-{uuid.uuid4().hex[:8]}", set_as_current=False)
        app.conf.update(
            broker_url="memory://",
            result_backend="cache+memory://",
            idempotency_url=redis_url,
            idempotency_key_prefix=key_prefix,
            task_eager_propagates=False,
            **conf,
        )
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.close()
