"""``idempotency_client``: a ready redis-py client, or a factory called once per process, used
instead of ``idempotency_url`` (how Sentinel and Redis Cluster users configure the task).

On a standalone Redis, on the local Redis Cluster eagerly, and in a real prefork worker whose
children each build their own cluster client after the fork.
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import Any

import pytest
import redis
from celery import Celery

from celery_idempotent import IdempotentTask
from celery_idempotent.celery.task import reset_backends
from celery_idempotent.settings import resolve
from tests.celery.cidem_helpers import key_of, redis_names
from tests.support.workers import WorkerGroup

TIMEOUT = 60


@pytest.fixture(autouse=True)
def _fresh_backends() -> Iterator[None]:
    reset_backends()
    yield
    reset_backends()


@pytest.fixture
def make_app() -> Iterator[Callable[..., Celery]]:
    apps: list[Celery] = []

    def factory(**conf: Any) -> Celery:
        app = Celery(f"client-{uuid.uuid4().hex[:8]}", set_as_current=False)
        app.conf.update(result_backend="cache+memory://", **conf)
        apps.append(app)
        return app

    yield factory
    for app in apps:
        app.close()


class Factory:
    """An ``idempotency_client`` factory that counts its calls and keeps what it made."""

    def __init__(self, make: Callable[[], Any]) -> None:
        self.make = make
        self.made: list[Any] = []
        self.lock = threading.Lock()

    def __call__(self) -> Any:
        with self.lock:
            client = self.make()
            self.made.append(client)
            return client

    def close(self) -> None:
        for client in self.made:
            client.close()


def counting_task(app: Celery, runs: list[Any], **options: Any) -> Any:
    @app.task(shared=False, base=IdempotentTask, name=f"c{uuid.uuid4().hex[:8]}", **options)
    def task(order_id: int, amount: int = 10) -> dict[str, int]:
        runs.append(order_id)
        return {"order_id": order_id, "run": len(runs)}

    return task


# --------------------------------------------------------------------------- standalone Redis


def test_a_client_factory_is_called_once_per_process_and_used_for_every_key(
    make_app: Callable[..., Celery], redis_url: str, redis_client: Any, key_prefix: str
) -> None:
    factory = Factory(lambda: redis.Redis.from_url(redis_url))
    app = make_app(
        broker_url="amqp://guest@127.0.0.1:5672//",  # not Redis: no broker fallback involved
        idempotency_client=factory,
        idempotency_key_prefix=key_prefix,
    )
    runs: list[Any] = []
    first, second = counting_task(app, runs), counting_task(app, runs)
    try:
        assert first.apply((1,)).get() == {"order_id": 1, "run": 1}
        assert first.apply((1,)).get() == {"order_id": 1, "run": 1}  # replayed
        assert second.apply((2,)).get() == {"order_id": 2, "run": 2}
        assert runs == [1, 2]
        assert len(factory.made) == 1, "one client per process, shared by the app's tasks"
        assert resolve(app, first).idempotency_url is None
        _, record = redis_names(first, key_of(first, 1))
        assert redis_client.exists(record) == 1  # the record is where the client points
    finally:
        factory.close()


def test_a_ready_client_object_is_used_as_it_is(
    make_app: Callable[..., Celery], redis_url: str, redis_client: Any, key_prefix: str
) -> None:
    client = redis.Redis.from_url(redis_url)
    app = make_app(
        broker_url="amqp://guest@127.0.0.1:5672//",
        idempotency_client=client,
        idempotency_key_prefix=key_prefix,
    )
    runs: list[Any] = []
    task = counting_task(app, runs)
    try:
        results = [task.apply((7,), {"amount": 5}).get() for _ in range(3)]
        assert runs == [7]
        assert results == [{"order_id": 7, "run": 1}] * 3
        assert task.idempotency_guard().store.client is client
    finally:
        client.close()


def test_a_factory_that_returns_no_client_fails_the_call_naming_the_setting(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(broker_url="redis://127.0.0.1:6379/0", idempotency_client=lambda: "redis://x")
    runs: list[Any] = []
    task = counting_task(app, runs)

    result = task.apply((1,))
    assert result.state == "FAILURE"
    assert isinstance(result.result, TypeError)
    assert "idempotency_client" in str(result.result)
    assert "returned str" in str(result.result)
    assert runs == [], "the body must not run without its guard"


def test_url_and_client_both_in_the_app_settings_is_an_error_naming_both(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(idempotency_url="memory://", idempotency_client=lambda: None)
    runs: list[Any] = []
    task = counting_task(app, runs)

    with pytest.raises(ValueError, match="idempotency_url and idempotency_client"):
        resolve(app, task)
    assert task.apply((1,)).state == "FAILURE"
    assert runs == []


def test_a_task_option_beats_the_apps_other_backend_setting(
    make_app: Callable[..., Celery], redis_url: str, key_prefix: str
) -> None:
    factory = Factory(lambda: redis.Redis.from_url(redis_url))
    app = make_app(idempotency_client=factory, idempotency_key_prefix=key_prefix)
    runs: list[Any] = []
    in_memory = counting_task(app, runs, idempotency_url="memory://")
    cfg = resolve(app, in_memory)
    assert cfg.idempotency_url == "memory://"
    assert cfg.idempotency_client is None
    assert in_memory.apply((3,)).get() == in_memory.apply((3,)).get()
    assert runs == [3]
    assert factory.made == [], "the app's client is not made for a task that does not use it"

    other = make_app(idempotency_url="memory://", idempotency_key_prefix=key_prefix)
    by_client = counting_task(other, runs, idempotency_client=factory)
    cfg = resolve(other, by_client)
    assert cfg.idempotency_client is factory
    assert cfg.idempotency_url is None
    try:
        assert by_client.apply((4,)).get() == by_client.apply((4,)).get()
        assert runs == [3, 4]
        assert len(factory.made) == 1
    finally:
        factory.close()


# --------------------------------------------------------------------------- Redis Cluster


@pytest.mark.cluster
def test_tasks_run_once_per_key_on_a_redis_cluster_through_a_client_factory(
    make_app: Callable[..., Celery], redis_cluster: Any, key_prefix: str
) -> None:
    factory = Factory(redis_cluster.client)
    app = make_app(
        broker_url="amqp://guest@127.0.0.1:5672//",
        idempotency_client=factory,
        idempotency_key_prefix=key_prefix,
    )
    runs: list[Any] = []
    task = counting_task(app, runs)
    keys = list(range(30))
    try:
        first = {n: task.apply((n,)).get() for n in keys}
        again = {n: task.apply((n,)).get() for n in keys}
        assert first == again
        assert sorted(runs) == keys
        assert len(factory.made) == 1
        client = factory.made[0]
        masters = set()
        for n in keys:
            lock, record = redis_names(task, key_of(task, n))
            assert client.exists(record) == 1
            assert client.exists(lock) == 0  # released by the commit
            masters.add(client.get_node_from_key(record).name)
        assert len(masters) > 1, "keys should spread over the cluster's masters"
    finally:
        factory.close()


@pytest.mark.cluster
@pytest.mark.worker
def test_prefork_children_each_make_their_own_cluster_client_and_run_a_key_once(
    cidem: ModuleType,
    worker_factory: Callable[..., WorkerGroup],
    redis_cluster: Any,
    redis_client: Any,
    tag: str,
) -> None:
    nodes = ",".join(f"{host}:{port}" for host, port in redis_cluster.startup_nodes)
    queue = f"cluster-{tag}"
    cidem.client().delete(cidem.ckey("client-factory"))
    group = worker_factory(
        1,
        pool="prefork",
        concurrency=2,
        queues=[queue],
        env={"CIDEM_IDEMPOTENCY_CLUSTER": nodes},
    )
    worker = group[0]
    try:
        children = set(worker.child_pids(wait=True))
        sent = [cidem.work.apply_async((tag, n), queue=queue) for n in range(6) for _ in range(4)]
        values = [r.get(timeout=TIMEOUT) for r in sent]
        main_pid = worker.pid
    finally:
        group.stop()

    by_n: dict[int, set[str]] = {}
    for value in values:
        by_n.setdefault(value["x"], set()).add(value["token"])
    assert {n: len(tokens) for n, tokens in by_n.items()} == dict.fromkeys(range(6), 1)
    assert int(cidem.client().get(cidem.ckey("work", tag)) or 0) == 6  # one run per key

    raw = cidem.client().hgetall(cidem.ckey("client-factory"))
    calls = {int(pid): int(n) for pid, n in raw.items()}
    assert calls, "the worker never made its client"
    assert all(n == 1 for n in calls.values()), f"one client per process: {calls}"
    assert set(calls) <= children, f"made in the pool children {children}, not {set(calls)}"
    assert main_pid not in calls, "never in the parent before the fork"

    cluster = redis_cluster.client()
    try:
        for n in range(6):
            _, record = redis_names(cidem.work, key_of(cidem.work, tag, n))
            assert cluster.exists(record) == 1, "records live in the cluster"
            assert redis_client.exists(record) == 0, "and not on the broker's Redis"
    finally:
        cluster.close()


# --------------------------------------------------------------------------- Sentinel broker


def test_a_sentinel_broker_gives_a_client_factory_like_kombus(
    make_app: Callable[..., Celery],
) -> None:
    """No idempotency setting and a ``sentinel://`` broker: the keys go to the same Sentinel
    master, built as kombu builds the broker's (Sentinels from every URL, db and password of
    the first, master_name and sentinel_kwargs from the transport options)."""
    app = make_app(
        broker_url="sentinel://:s3cret@10.0.0.1:26379/3;sentinel://10.0.0.2",
        broker_transport_options={"master_name": "orders", "sentinel_kwargs": {"password": "x"}},
    )
    runs: list[Any] = []
    first, second = counting_task(app, runs), counting_task(app, runs)
    cfg = resolve(app, first)
    factory = cfg.idempotency_client
    assert cfg.idempotency_url is None
    assert factory.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26379)]
    assert (factory.master_name, factory.db, factory.password) == ("orders", 3, "s3cret")
    assert factory.sentinel_kwargs == {"password": "x"}
    assert "s3cret" not in factory.label
    assert "s3cret" not in repr(factory)
    assert resolve(app, second).idempotency_client is factory, "one client for all tasks"
    client = factory()
    try:
        pool = client.connection_pool
        assert pool.service_name == "orders"
        assert pool.connection_kwargs["db"] == 3
        assert pool.connection_kwargs["password"] == "s3cret"
    finally:
        client.close()


def test_a_sentinel_broker_given_as_a_list_names_every_sentinel(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(
        broker_url=["sentinel://10.0.0.1:26379/1", "sentinel://10.0.0.2:26380/1"],
        broker_transport_options={"master_name": "orders"},
    )
    runs: list[Any] = []
    factory = resolve(app, counting_task(app, runs)).idempotency_client
    assert factory.sentinels == [("10.0.0.1", 26379), ("10.0.0.2", 26380)]
    assert factory.db == 1


def test_a_sentinel_broker_without_master_name_is_an_error_naming_it(
    make_app: Callable[..., Celery],
) -> None:
    app = make_app(broker_url="sentinel://10.0.0.1:26379/0")
    runs: list[Any] = []
    with pytest.raises(ValueError, match="broker_transport_options has no 'master_name'"):
        resolve(app, counting_task(app, runs))


@pytest.mark.worker
def test_a_worker_on_a_sentinel_broker_keeps_its_keys_on_the_sentinels_master(
    cidem: ModuleType,
    cidem_env: dict[str, str],
    worker_factory: Callable[..., WorkerGroup],
    redis_sentinel: Any,
    tag: str,
) -> None:
    """A real worker whose broker is kombu's Sentinel transport and that has no idempotency
    setting at all: every key runs once, its record is on the master the Sentinel names."""
    host, port = redis_sentinel.sentinel_hosts[0]
    env = {
        "CIDEM_BROKER_URL": f"sentinel://{host}:{port}/1",
        "CIDEM_BROKER_MASTER": redis_sentinel.master_name,
    }
    queue = f"sentinel-{tag}"
    group = worker_factory(1, pool="prefork", concurrency=2, queues=[queue], env=env)
    sender = Celery("cidem_app", set_as_current=False)
    cidem.configure(sender, {**cidem_env, **env})
    try:
        sent = [
            (n, sender.send_task("cidem_app.work", (tag, n), queue=queue))
            for n in range(5)
            for _ in range(3)
        ]
        values = [(n, r.get(timeout=TIMEOUT)) for n, r in sent]
        log = group[0].log()
    finally:
        group.stop()
        sender.close()

    tokens: dict[int, set[str]] = {}
    for n, value in values:
        assert value["x"] == n
        tokens.setdefault(n, set()).add(value["token"])
    assert all(len(t) == 1 for t in tokens.values()), tokens
    assert int(cidem.client().get(cidem.ckey("work", tag)) or 0) == 5
    assert f"at sentinel://{host}:{port} master '{redis_sentinel.master_name}' db 1" in log

    master_host, master_port = redis_sentinel.master_address()
    master = redis.Redis(host=master_host, port=master_port, db=1)
    try:
        for n in range(5):
            _, record = redis_names(cidem.work, key_of(cidem.work, tag, n))
            assert master.exists(record) == 1, "the record is on the Sentinel's master"
            assert cidem.client().exists(record) == 0  # not on the result backend's Redis
    finally:
        master.close()
