"""The basic duplicate test with RabbitMQ as the broker (records and results on Redis)."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from types import ModuleType

import pytest
from celery import Celery

from tests.celery.cidem_helpers import count, settled
from tests.support.waiting import wait_for
from tests.support.workers import WorkerGroup

pytestmark = [pytest.mark.worker, pytest.mark.redis, pytest.mark.rabbitmq]

TIMEOUT = 30


@pytest.fixture(scope="module")
def rabbit_env(
    rabbitmq_url: str, redis_url: str, cidem_env: dict[str, str]
) -> Iterator[dict[str, str]]:
    queue = f"cidem-rabbit-{uuid.uuid4().hex[:10]}"
    yield {
        **cidem_env,
        "CIDEM_BROKER_URL": rabbitmq_url,
        "CIDEM_BACKEND_URL": redis_url,
        "CIDEM_IDEMPOTENCY_URL": redis_url,  # an amqp broker is no fallback for the store
        "CIDEM_QUEUE": queue,
    }
    from kombu import Connection

    with Connection(rabbitmq_url, connect_timeout=5) as conn:
        conn.default_channel.queue_delete(queue)


@pytest.fixture(scope="module")
def rabbit_app(cidem: ModuleType, rabbit_env: dict[str, str]) -> Iterator[Celery]:
    app = Celery("cidem_rabbit", set_as_current=False)
    cidem.configure(app, rabbit_env)
    yield app
    app.close()


@pytest.fixture(scope="module")
def rabbit_workers(
    worker_factory: Callable[..., WorkerGroup], rabbit_env: dict[str, str]
) -> Iterator[WorkerGroup]:
    group = worker_factory(
        2, pool="prefork", concurrency=2, env=rabbit_env, queues=[rabbit_env["CIDEM_QUEUE"]]
    )
    yield group
    group.stop()


def test_duplicates_over_rabbitmq_run_once(
    cidem: ModuleType, rabbit_app: Celery, rabbit_workers: WorkerGroup, tag: str
) -> None:
    assert rabbit_app.conf.broker_url.startswith("amqp")
    results = [rabbit_app.send_task("cidem_app.work", (tag, 5, 0.3)) for _ in range(8)]
    task_id = str(uuid.uuid4())
    by_id = [
        rabbit_app.send_task("cidem_app.work_by_id", (tag, 5, 0.3), task_id=task_id)
        for _ in range(4)
    ]
    values = [r.get(timeout=TIMEOUT) for r in results]
    same_id = by_id[0].get(timeout=TIMEOUT)
    key = f"cidem_app.work_by_id:id:{task_id}"
    wait_for(lambda: settled(cidem, key, 4), TIMEOUT, what="4 deliveries settled")

    assert values == [values[0]] * 8
    assert count(cidem, "work", tag) == 1
    assert same_id["x"] == 5
    assert count(cidem, "work_by_id", tag) == 1
