"""The two modes of issue 24 with RabbitMQ as the broker (records, results and run counts on
Redis): there the publish side checks before kombu publishes (no fused push), so this is
the other path of ``apply_async``, with a real prefork worker."""

from __future__ import annotations

import os
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from celery_idempotent import DuplicatePublishError
from celery_idempotent import settings as idem_settings
from celery_idempotent.celery.task import reset_backends
from tests.support.keys import delete_keys_with_prefix
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup, start_workers

pytestmark = [pytest.mark.redis, pytest.mark.rabbitmq]

APPS_DIR = Path(__file__).resolve().parent / "apps"
TIMEOUT = 30


@pytest.fixture(scope="module")
def env(redis_url: str, rabbitmq_url: str) -> Iterator[dict[str, str]]:
    session = uuid.uuid4().hex[:10]
    values = {
        "MIG_REDIS_URL": redis_url,
        "MIG_BROKER_URL": rabbitmq_url,
        "MIG_PREFIX": f"test:migr-{session}:",
        "MIG_QUEUE": f"migr-{session}",
    }
    yield values
    import redis
    from kombu import Connection

    client = redis.Redis.from_url(redis_url)
    try:
        delete_keys_with_prefix(client, values["MIG_PREFIX"])
    finally:
        client.close()
    with Connection(rabbitmq_url, connect_timeout=5) as conn:
        conn.default_channel.queue_delete(values["MIG_QUEUE"])


@pytest.fixture(scope="module")
def mig(env: dict[str, str]) -> Iterator[ModuleType]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)
    sys.path.insert(0, str(APPS_DIR))
    sys.modules.pop("migrate_app", None)
    try:
        import migrate_app

        idem_settings.clear_cache()
        reset_backends()
        yield migrate_app
        migrate_app.app.close()
    finally:
        sys.modules.pop("migrate_app", None)
        sys.path.remove(str(APPS_DIR))
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        idem_settings.clear_cache()
        reset_backends()


@pytest.fixture(scope="module")
def worker(env: dict[str, str]) -> Iterator[WorkerGroup]:
    group = start_workers(
        1,
        "migrate_app",
        env=env,
        pythonpath=[APPS_DIR],
        pool="prefork",
        concurrency=2,
        queues=[env["MIG_QUEUE"]],
    )
    yield group
    group.stop()
    for each in group:
        each.remove_log()


def no_overlap(spans: list[tuple[float, float]]) -> bool:
    ordered = sorted(spans)
    return all(a_end <= b_start for (_, a_end), (b_start, _) in zip(ordered, ordered[1:]))


def test_ttl_zero_over_rabbitmq(mig: ModuleType, worker: WorkerGroup) -> None:
    assert mig.app.conf.broker_url.startswith("amqp")
    t = uuid.uuid4().hex[:10]
    first = mig.once.delay(t, 1.0)
    wait_for(lambda: mig.count("once", t) >= 1, timeout=TIMEOUT)
    with pytest.raises(DuplicatePublishError) as caught:
        mig.once.delay(t, 1.0)
    assert (caught.value.task_id, caught.value.state) == (first.id, "running")
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert mig.once.delay(t, 1.0).get(timeout=TIMEOUT)["run"] == 2  # nothing kept
    assert no_overlap(mig.runs("once", t))


def test_publish_until_started_over_rabbitmq(mig: ModuleType, worker: WorkerGroup) -> None:
    t = uuid.uuid4().hex[:10]
    first = mig.unlock_before_run.delay(t, 1.5)
    wait_for(lambda: mig.count("ubr", t) >= 1, timeout=TIMEOUT)
    second = mig.unlock_before_run.delay(t, 1.5)
    assert second.id != first.id
    assert mig.unlock_before_run.delay(t, 1.5).id == second.id
    assert first.get(timeout=TIMEOUT)["run"] == 1
    assert second.get(timeout=TIMEOUT)["run"] == 2
    assert no_overlap(mig.runs("ubr", t))
